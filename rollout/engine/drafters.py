"""What drafts on the device, handed to the runner when it is built (rollout/engine/model_runner.py).

The n-gram index's search (kernels/ngram_draft.py), with coupled chains ahead of its trees under
coupled sampling (kernels/coupled_draft.py), and a draft head (spec/eagle.py): either, both (a
hybrid: the index's tree where it found one, else the head's) or neither. `trees` is the one
place a decode step asks which of them runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.coupled_draft import coupled_chains
from kernels.ngram_draft import KEY_SCALE, draft_trees
from spec.eagle import EagleDrafter
from spec.step import DraftSettings, HeadWork, Source
from spec.token_table import TokenTable

Trees = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # tokens, parents, depths, ancestors, keys


@dataclass(frozen=True)
class Drafters:
    index: DraftSettings | None = None
    head: EagleDrafter | None = None

    @property
    def width(self) -> int:
        """Draft nodes per sequence per step: the n-gram trees' (a hybrid's head trees are padded
        to them), or a head's tree (the likeliest of its levels' nodes)."""
        return self.index.depth if self.index else self.head.nodes if self.head else 0

    @property
    def source_names(self) -> tuple[str, str, str]:
        """Each Source's name in the statistics."""
        return "ngram", self.head.source if self.head is not None else "head", "coupled"

    def trees(self, table: TokenTable, rows: torch.Tensor, groups: torch.Tensor, kv: torch.Tensor,
              head_work: HeadWork, drafting: bool) -> tuple[Trees | None, torch.Tensor]:
        """The step's trees, [S, width] each (None where the step does not draft), and which
        drafter made each sequence's (Source). `rows` [S] int32 and `groups` [S]: the sequences'
        token-table rows and search groups; `kv` [S]: their last tokens' positions (a head's roots)."""
        alone = self.index is None
        source = torch.full((rows.shape[0],), int(Source.HEAD if alone else Source.NGRAM), dtype=torch.long,
                            device=rows.device)
        if not drafting:
            return None, source
        if alone:  # a head alone: the trees the step before left
            return self.head.trees(rows.long(), table.tokens[rows.long(), kv].long(), self.head.nodes), source
        d = self.index
        scan = d.scan[groups.long()]
        trees = draft_trees(table.tokens, table.lengths, table.prompt_lens, table.history_start,
                            rows, scan, d.window, d.min_match, d.cands, d.depth, d.depth)
        if d.coupled:  # a sample's earlier rollout with its key, ahead of the n-gram tree
            followed, chains = coupled_chains(table.tokens, table.lengths, table.keys, table.history_start,
                                              rows, scan, d.window, d.depth)
            trees = tuple(torch.where(followed[:, None], c, t) for t, c in zip(trees, chains))
            source = torch.where(followed, int(Source.COUPLED), source)
        # hybrid: the index's tree where it found one, else the head's; a sleeping head left none
        # (its merge cost ShareGPT b1's steps 0.95 ms against the index's 0.88 on the H100)
        if self.head is not None and head_work != HeadWork.NONE:
            chains = self.head.trees(rows.long(), table.tokens[rows.long(), kv].long(), d.depth)
            from_head = (trees[4][:, 1:] < 0).all(dim=1)
            tok, par, dep, anc, key = (torch.where(from_head[:, None], c.to(t.dtype), t) for t, c in zip(trees, chains))
            trees = tok, par, dep, anc, index_first(key, from_head)
            source = torch.where(from_head, int(Source.HEAD), source)
        return trees, source

    def counts(self, codes, drafting: bool) -> tuple[int | None, int | None]:
        """From a collected step's Source codes [S] (numpy): (sequences a hybrid's index left to the
        head, sequences that followed their earlier rollout), each None where it does not apply."""
        if not drafting or self.index is None:
            return None, None
        misses = int((codes == Source.HEAD).sum()) if self.head is not None else None
        coupled = int((codes == Source.COUPLED).sum()) if self.index.coupled else None
        return misses, coupled


def index_first(keys: torch.Tensor, from_head: torch.Tensor) -> torch.Tensor:
    """A hybrid's keys [S, N] (-1: root and padding) so that the batch's draft rows go to the
    index's drafts before any of the head's (kernels/draft_rows.py takes the best keys): the index's
    in the upper half of the key range, the head's in the lower, each in its own order. The head
    fills what the index leaves, and the two drafters' keys, which estimate acceptance each its
    own way, are never compared."""
    half = KEY_SCALE // 2
    shifted = torch.where(from_head[:, None], keys // 2, half + keys // 2)
    return torch.where(keys >= 0, shifted, keys)
