"""How wide each step drafts: measured step costs against measured acceptance.

A step verifies `width` draft nodes per sequence (width 0: plain decoding). What that brings is
acc(w), the drafts accepted per sequence at that width; what it costs is the step's wall time
cost(b, w) at the batch-size bucket b. Each step takes the width with the most tokens per
second, S (1 + acc(w)) / cost(b, w), among the widths that fit (S (w + 1) tokens at most
`max_verify_tokens`, and as many free KV slots).

- Acceptance is read off the drafter's whole trees, which come back every SHADOW_EVERY steps
  whether the step drafts or not (drafting runs on the device and costs the host nothing):
  once the tree's sequence has emitted the tokens after its root, acc(w) for every width is
  how deep the tree's top-w nodes match them (spec/speculator.py). Under counter-based
  sampling a draft is accepted exactly when it equals the token the sequence emits anyway, so
  this is what verification would find, without verifying anything. Evaluations are averaged
  with decaying weights.
- Costs: steps overlap the host's work, so a step costs the larger of its device time and
  the host's time per step. Device times come from CUDA events around each step (exact, read
  one step late). A step's device time grows with its sequences' contexts (attention reads
  them all) whatever its width, while what a width adds (more tokens through the same
  weights) does not. So per bucket the budget keeps what a plain step costs the device now
  (the median of its last few) and, per width, what a drafting step cost above the plain cost
  of its time. The host's time per step is kept per (bucket, width): a wider step has more
  slots to lay out, keep or free and more tokens to append, and where the host is the
  bottleneck that, not the device, is what drafting costs. A width not measured yet at a
  bucket is taken to add nothing, so it gets tried as soon as acceptance says it may pay.
  While drafting, every REFRESH_EVERY-th step decodes plainly, so the plain cost follows the
  contexts as they grow.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from rollout.engine.step import bucket

SHADOW_EVERY = 8  # steps between the trees that come back for the acceptance statistics
COST_WINDOW = 5  # costs are medians of the last this many steps
REFRESH_EVERY = 16  # while drafting, one plain step in this many keeps the plain cost current
ACCEPT_WEIGHT = 0.3  # how much one evaluation of trees moves acc(w)
WIDTHS = (0, 1, 2, 4, 8, 16, 32, 63)  # the widths a step may take, up to SpecConfig.max_draft_tokens



@dataclass(frozen=True)
class StepPlan:
    width: int  # draft nodes verified per sequence (0: plain decoding)
    drafting: bool  # the drafter runs (width > 0, or for the statistics only)
    shadow: bool  # its whole trees come back to the host


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, adaptive: bool = True):
        self.widths = [w for w in WIDTHS if w <= max_draft_tokens]
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self.acc = np.zeros(len(self.widths))  # accepted drafts per sequence, by width
        self._plain: dict[int, deque] = {}  # bucket -> recent device times of plain steps
        self._extra: dict[tuple[int, int], deque] = {}  # (bucket, width) -> recent device times above plain
        self._host: dict[tuple[int, int], deque] = {}  # (bucket, width) -> recent host times per step
        self._drafting: dict[int, int] = {}  # bucket -> drafting steps since its last plain one
        self._steps = 0

    def plan(self, num_seqs: int, free_slots: int) -> StepPlan:
        self._steps += 1
        shadow = self._steps % SHADOW_EVERY == 0
        room = min(self.max_verify_tokens, free_slots)
        fits = [i for i, w in enumerate(self.widths) if num_seqs * (w + 1) <= room] or [0]
        if not self.adaptive:
            w = self.widths[fits[-1]]
        else:
            b = bucket(num_seqs)
            plain = _median(self._plain.get(b))
            w = 0
            if plain is not None:  # (a bucket's first steps measure plain decoding)
                cost = lambda w: max(plain + self._extra_cost(b, w), self._host_cost(b, w))  # noqa: E731
                w = self.widths[max(fits, key=lambda i: (1 + self.acc[i]) / cost(self.widths[i]))]
            if w:
                self._drafting[b] = self._drafting.get(b, 0) + 1
                if self._drafting[b] >= REFRESH_EVERY:
                    w, self._drafting[b] = 0, 0
        return StepPlan(w, w > 0 or shadow, shadow)

    def observe_step(self, num_seqs: int, width: int, device_s: float, host_s: float) -> None:
        b = bucket(num_seqs)
        self._host.setdefault((b, width), deque(maxlen=COST_WINDOW)).append(host_s)
        if width == 0:
            self._plain.setdefault(b, deque(maxlen=COST_WINDOW)).append(device_s)
        elif (plain := _median(self._plain.get(b))) is not None:
            self._extra.setdefault((b, width), deque(maxlen=COST_WINDOW)).append(device_s - plain)

    def observe_acceptance(self, accepted: np.ndarray) -> None:
        """accepted [S, widths]: the drafts each sequence's tree would have had accepted at each width."""
        if len(accepted):
            self.acc += ACCEPT_WEIGHT * (accepted.mean(axis=0) - self.acc)

    def _extra_cost(self, b: int, width: int) -> float:
        return max(_median(self._extra.get((b, width))) or 0.0, 0.0) if width else 0.0

    def _host_cost(self, b: int, width: int) -> float:
        """The host's time per step at this width, or at plain decoding until this width is measured."""
        return _median(self._host.get((b, width))) or _median(self._host.get((b, 0))) or 0.0

    def costs(self) -> dict[str, float]:
        """Milliseconds by bucket: plain steps, and what each width adds (for stats and benchmarks)."""
        out = {f"b{b}_plain": 1e3 * _median(v) for b, v in self._plain.items() if v}
        out.update({f"b{b}_w{w}_host": 1e3 * _median(v) for (b, w), v in self._host.items() if v})
        out.update({f"b{b}_w{w}_extra": 1e3 * _median(v) for (b, w), v in self._extra.items() if v})
        return out


def _median(values) -> float | None:
    return statistics.median(values) if values else None
