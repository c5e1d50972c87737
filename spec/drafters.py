"""The drafter seam: each drafter proposes trees for a decode step's sequences on the device, and
the step takes, for each sequence, the tree of the first drafter in DRAFTERS' order that has one.

    class Drafter:
        name, source, width          its name (DRAFTERS', the statistics'), its trees' Source code, nodes a tree has
        scale                        what its keys estimate acceptance on: drafters of one scale compare keys
        trees(step)                  (tokens, parents, depths, ancestors, keys) [S, step.width + 1] and
                                     [S] bool where it has a tree (None: where a tree has a draft)
        runs(head_work)              whether it works in the step past its trees (a head's pass)
        aux_layers, aux_width        the target's hidden states it reads, written by the forward
        after_forward(...)           its work over the step's rows once the target drew
        after_accept(...)            once the accept walk ran: what it learns from the accepted tokens
        after_prefill(...)           a prefill step's rows
        sleep()                      it stops running

What a drafter costs is measured, not declared: the budget times the steps of each draft-row
count (spec/budget.py), a head's pass and tree are timed on the captured graphs (spec/head_watch.py).
The n-gram index and the coupled chains learn on the host (the token table and the scan lines,
spec/index.py); a head learns in the step. Adding a drafter: its module and its line in DRAFTERS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.coupled_draft import coupled_chains
from kernels.ngram_draft import KEY_SCALE, draft_trees
from spec.step import DraftSettings, HeadWork, Source
from spec.token_table import TokenTable

Trees = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, parents, depths, ancestors, keys


@dataclass(frozen=True)
class DraftStep:
    """A decode step as its drafters see it."""

    table: TokenTable
    rows: torch.Tensor  # [S] int32: the sequences' token-table rows
    groups: torch.Tensor  # [S]: their search groups (the scan table's lines)
    kv: torch.Tensor  # [S]: their last tokens' positions (the trees' roots)
    width: int  # nodes past the root of the step's trees
    head: HeadWork  # what a draft head does this step

    @property
    def roots(self) -> torch.Tensor:
        return self.table.tokens[self.rows.long(), self.kv].long()


class Drafter(ABC):
    """A drafter: its trees, and defaults for one that works only through them."""

    name: str = ""
    source: Source = Source.NGRAM
    scale: str = "ngram"
    width: int = 0
    aux_layers: tuple[int, ...] = ()
    aux_width: int = 0

    @abstractmethod
    def trees(self, step: DraftStep) -> tuple[Trees, torch.Tensor | None]:
        """(tokens, parents, depths, ancestors, keys) [S, step.width + 1], and [S] where it has a tree (None: where one has a draft)."""

    def runs(self, head: HeadWork) -> bool:
        return False

    def attach(self, backend, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The target's attention backend and rope tables, for a drafter that runs layers of its own."""

    def after_forward(self, step: DraftStep, drawn: torch.Tensor, aux: torch.Tensor | None, ctx):
        """Its work over the step's rows once the target drew (`drawn` [R]); returns what after_accept takes."""

    def after_accept(self, step: DraftStep, state, bits: torch.Tensor, row_of_node: torch.Tensor | None,
                     max_kv_len: int | None) -> None:
        """Once the accept walk ran: `bits` [S] each sequence's accepted nodes, `row_of_node` their rows."""

    def after_prefill(self, batch, starts, ctx, aux: torch.Tensor | None, drawn: torch.Tensor, logits_rows: list[int],
                      table: TokenTable) -> None:
        """A prefill step's rows, once its samples drew their first tokens."""

    def sleep(self) -> None:
        """It stops running (queued behind the steps in flight)."""


class _TableDrafter(Drafter):
    """A drafter that reads the token table along the index's scan lines (DraftSettings)."""

    def __init__(self, settings: DraftSettings):
        self.settings = settings
        self.width = settings.depth


class NgramDrafter(_TableDrafter):
    """The n-gram index's search over the prompt, the sample, its siblings and earlier rollouts (kernels/ngram_draft.py)."""

    name, source = "ngram", Source.NGRAM

    def trees(self, step: DraftStep) -> tuple[Trees, torch.Tensor | None]:
        d, t = self.settings, step.table
        return draft_trees(t.tokens, t.lengths, t.prompt_lens, t.history_start, step.rows, d.scan[step.groups.long()],
                           d.window, d.min_match, d.cands, d.depth, step.width), None


class CoupledDrafter(_TableDrafter):
    """Under coupled sampling, a sample's earlier rollout drawn with its key, while the two agree
    (kernels/coupled_draft.py): keyed above every n-gram draft, on the same scale."""

    name, source = "coupled", Source.COUPLED

    def trees(self, step: DraftStep) -> tuple[Trees, torch.Tensor | None]:
        d, t = self.settings, step.table
        followed, chains = coupled_chains(t.tokens, t.lengths, t.keys, t.history_start, step.rows,
                                          d.scan[step.groups.long()], d.window, step.width)
        return chains, followed


# name -> builder(n-gram settings, draft head drafter or None) -> Drafter or None (not configured);
# the order is the priority: a sequence's tree is the first of these that has one
DRAFTERS = {
    "coupled": lambda settings, head: CoupledDrafter(settings) if settings is not None and settings.coupled else None,
    "ngram": lambda settings, head: NgramDrafter(settings) if settings is not None else None,
    "eagle": lambda settings, head: head if head is not None and head.name == "eagle" else None,
    "mtp": lambda settings, head: head if head is not None and head.name == "mtp" else None,
}


class DraftOrder:
    """The step's drafters in DRAFTERS' order: what a decode step asks of drafting."""

    def __init__(self, settings: DraftSettings | None = None, head: Drafter | None = None):
        self.drafters = [d for build in DRAFTERS.values() if (d := build(settings, head)) is not None]
        readers = [d for d in self.drafters if d.aux_layers]
        if len(readers) > 1:
            raise ValueError("at most one drafter reads the target's hidden states")
        self.reader = readers[0] if readers else None
        self.head = head  # the draft head's drafter, if any (its weights are pushed under HEAD_PREFIX)
        self.scales = list(dict.fromkeys(d.scale for d in self.drafters))
        self._running = {d.name: True for d in self.drafters}  # (a drafter starts awake)

    def get(self, name: str) -> Drafter | None:
        return next((d for d in self.drafters if d.name == name), None)

    @property
    def width(self) -> int:
        """Draft nodes per sequence per step: the first drafter's (the others' trees are padded to it)."""
        return self.drafters[0].width if self.drafters else 0

    @property
    def source_names(self) -> tuple[str, ...]:
        """Each Source's name in the statistics."""
        names = {Source.NGRAM: "ngram", Source.HEAD: "head", Source.COUPLED: "coupled"}
        names.update({d.source: d.name for d in self.drafters})
        return tuple(names[s] for s in Source)

    def trees(self, step: DraftStep, drafting: bool) -> tuple[Trees | None, torch.Tensor]:
        """The step's trees, [S, width + 1] each (None where the step does not draft), and the
        drafter that made each sequence's (Source). A drafter that does not run this step (a
        sleeping head) makes none; the last that does takes the sequences no other has a tree for."""
        taking = [d for d in self.drafters if d.runs(step.head) or not d.aux_layers]
        last = taking[-1].source if taking else Source.NGRAM  # (without drafts a sequence's source counts nothing)
        source = torch.full((step.rows.shape[0],), int(last), dtype=torch.long, device=step.rows.device)
        if not drafting or not taking:
            return None, source
        scales = list(dict.fromkeys(d.scale for d in taking))
        proposed = [(d, *d.trees(step)) for d in taking]
        trees = _ranked(proposed[-1][1], scales, proposed[-1][0].scale)
        for d, own, has in reversed(proposed[:-1]):  # each earlier drafter takes where it has a tree
            own = _ranked(own, scales, d.scale)
            has = (own[4][:, 1:] >= 0).any(dim=1) if has is None else has
            trees = tuple(torch.where(has[:, None], o, t.to(o.dtype)) for t, o in zip(trees, own))
            source = torch.where(has, int(d.source), source)
        return trees, source

    def counts(self, codes, drafting: bool) -> tuple[int | None, int | None]:
        """From a collected step's Source codes [S] (numpy): (sequences the index left to a head
        after it, sequences that followed their earlier rollout), each None where it does not apply."""
        if not drafting or self.get("ngram") is None:
            return None, None
        misses = int((codes == Source.HEAD).sum()) if self.head is not None else None
        coupled = int((codes == Source.COUPLED).sum()) if self.get("coupled") is not None else None
        return misses, coupled

    # ---------------- the step's work past the trees ----------------
    def attach(self, backend, cos: torch.Tensor, sin: torch.Tensor) -> None:
        for d in self.drafters:
            d.attach(backend, cos, sin)

    def start_step(self, head: HeadWork) -> None:
        """On the host, before a step is queued: the drafters that stop working in it sleep."""
        for d in self.drafters:
            runs = d.runs(head)
            if self._running[d.name] and not runs:
                d.sleep()
            self._running[d.name] = runs

    def working(self, head: HeadWork) -> list[Drafter]:
        """The drafters that work in a step with this head work (inside the step: a CUDA graph captures it)."""
        return [d for d in self.drafters if d.runs(head)]

    def reading(self, head: HeadWork) -> Drafter | None:
        """The drafter whose input is the target's hidden states, if it works in this step."""
        return self.reader if self.reader is not None and self.reader.runs(head) else None


def banded(keys: torch.Tensor, band: int, bands: int) -> torch.Tensor:
    """Keys of drafters on different scales never compare: each scale takes its own band of the key
    range, band 0 the highest (kernels/draft_rows.py verifies the best keys first), so the batch's
    draft rows go to the first scale's drafts before any of the next's, each in its own order;
    roots and padding (-1) stay."""
    shifted = (bands - 1 - band) * (KEY_SCALE // bands) + keys // bands
    return torch.where(keys >= 0, shifted, keys)


def _ranked(trees: Trees, scales: list[str], scale: str) -> Trees:
    if len(scales) == 1:
        return trees
    return (*trees[:4], banded(trees[4], scales.index(scale), len(scales)))
