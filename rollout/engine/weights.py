"""An engine's weights and their version: new weights land all or nothing (`swap`, the one door).

Every (name, shape, dtype) is checked against the model's weights, and a draft head's under
HEAD_PREFIX (a trainer that trains the head with the policy pushes both), before any is copied;
each tensor is cast to the engine's dtype as it lands. Under tensor parallelism rank 0 tells the
other ranks how to get theirs (`RankSwap`: relayed from rank 0, read from disk, or their own staged
copy of a push), and all swap or none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from rollout.models.llama import CausalLM
from rollout.models.weights import WeightError, check_weights, copy_weights, iter_checkpoint

log = logging.getLogger("rollout")

HEAD_PREFIX = "draft."  # a draft head's tensors in a weight push: its checkpoint names after this


@dataclass
class RankSwap:
    """How a tensor-parallel rank > 0 gets its part of a swap: `relay` (broadcast from rank 0 in
    `where`'s (name, shape, dtype) order), `disk` (read from the checkpoint at `where`) or `staged`
    (its own receiver's copy of the push)."""

    how: str
    where: object


class EngineWeights:
    """`before()`: the engine completes the step in flight (it ran on the old weights, its tokens say
    so); `after(head_pushed, recompute_kv)`: the engine takes the new weights in (speculation is
    told, KV is recomputed)."""

    def __init__(self, model: CausalLM, head, device: torch.device, tp, before: Callable[[], None],
                 after: Callable[[bool, bool], None]):
        self.model, self.head, self.device, self.tp = model, head, device, tp
        self.before, self.after = before, after
        self.version = 0
        self.sync_s = 0.0  # the last swap's seconds
        self.staged = None  # a rank > 0's own copy of a pushed update, by version (set by its server's receiver)
        self._targets: dict | None = None

    def targets(self) -> dict:
        """The target's weights by HF name, and a draft head's under HEAD_PREFIX. Made once: they are
        views of the parameters, which swaps copy into in place (the 30B-A3B shape's 18,432 expert
        targets took 0.08 s to make on the CPU, twice a push, where the copies took 0.05)."""
        if self._targets is None:
            self._targets = self.model.weight_targets()
            if self.head is not None:
                self._targets.update({HEAD_PREFIX + n: t for n, t in self.head.head.weight_targets().items()})
        return self._targets

    def check(self, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Raise WeightError unless every (name, shape, dtype) names one of the weights as it is."""
        check_weights(self.targets(), list(specs), require_all=False)

    def swap(self, specs, tensors: Iterable[tuple[str, torch.Tensor]], version: int | None, recompute_kv: bool,
             ranks: RankSwap | None = None) -> int:
        """Rank 0's swap (or the only rank's): every spec is checked before any tensor is copied; the
        other ranks get theirs as `ranks` says (default: relayed). Returns the new version."""
        specs = list(specs)
        t0 = time.perf_counter()
        self.before()
        self.check(specs)
        if self.tp is not None:
            version = self.version + 1 if version is None else int(version)
            ranks = ranks or RankSwap("relay", [(n, list(shape), str(dtype).removeprefix("torch.")) for n, shape, dtype in specs])
            self.tp.record("_swap_replayed", version, recompute_kv, ranks.how, ranks.where)
            self.tp.flush()
            if ranks.how == "relay":
                tensors = [(n, self.tp.group.broadcast(t.to(self.device).contiguous())) for n, t in tensors]
            if not self.tp.group.agree(True):
                raise WeightError("weights rejected, nothing changed: another tensor-parallel rank did not receive them")
        self._apply([name for name, _, _ in specs], tensors, version, recompute_kv)
        self.sync_s = time.perf_counter() - t0
        return self.version

    def swap_replayed(self, version: int, recompute_kv: bool, how: str, where) -> None:
        """A rank > 0's side of rank 0's `swap`: its tensors, then the ranks' agreement."""
        self.before()
        tensors, ok = [], True
        targets = self.targets()
        try:
            if how == "relay":  # every rank takes part in every broadcast, whatever it keeps
                for name, shape, dtype in where:
                    full = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                    tensors.append((name, targets[name].take(self.tp.group.broadcast(full)).clone()))
            elif how == "disk":
                tensors = list(iter_checkpoint(where, targets))
            else:
                tensors = self.staged(version)
        except Exception:  # noqa: BLE001 - told to every rank by the agreement
            log.exception("tensor-parallel rank %d could not get weight version %d", self.tp.rank, version)
            ok = False
        if self.tp.group.agree(ok):
            self._apply([n for n, _ in tensors], tensors, version, recompute_kv)

    def _apply(self, names, tensors, version: int | None, recompute_kv: bool) -> None:
        copy_weights(self.targets(), tensors)
        version = self.version + 1 if version is None else int(version)
        if version <= self.version:
            log.warning("weight version %d is not above the current %d", version, self.version)
        self.version = version
        self.after(any(name.startswith(HEAD_PREFIX) for name in names), recompute_kv)
