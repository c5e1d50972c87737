"""A verify step computes only the batch's best drafts: which, and where each sits among its rows.

A drafting step holds a tree per sequence in a uniform layout ([S, N]: node 0 the root, then
the drafts in rank order, kernels/ngram_draft.py), but its forward pass runs over `S + capacity`
rows: every root, and the `capacity` drafts of the whole batch with the highest keys. A
tree's keys never grow with its rank, so the drafts a sequence keeps are its first few nodes,
themselves a tree. Each sequence's rows are contiguous, root first (attention's `qo_indptr`);
rows left over when the batch has fewer drafts than capacity belong to no sequence, compute a
dummy token and are dropped.

What a draft costs is then one row, whichever sequence it belongs to, rather than a row for
every sequence at every width; a sequence with nothing to draft costs only its root. Shapes
are fixed by (S, N, capacity), so all of it runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ngram_draft import PADDING


def choose_drafts(parents: torch.Tensor, keys: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `capacity` draft nodes with the highest keys (ties: the earlier node); every other
    node becomes padding. parents, keys [S, N] int64 (keys of the root and of padding: -1).
    Returns the parents and each sequence's kept nodes, root included ([S])."""
    s, n = parents.shape
    drafts = s * (n - 1)
    kept = parents[:, 1:] >= 0  # [S, W]
    if capacity < drafts:
        flat = torch.arange(drafts, device=parents.device)
        order = keys[:, 1:].reshape(-1) * drafts + (drafts - 1 - flat)  # distinct; a child below its parent
        best = torch.zeros(drafts, dtype=torch.bool, device=parents.device)
        best.scatter_(0, order.topk(capacity).indices, True)
        kept = kept & best.view(s, n - 1)
    parents = torch.cat([parents[:, :1], torch.where(kept, parents[:, 1:], PADDING)], dim=1)
    return parents, 1 + kept.sum(dim=1)


@dataclass
class RowLayout:
    """Where each tree node's row is: sequence i's first `counts[i]` nodes, in order, from row
    `qo_indptr[i]` on."""

    node_of_row: torch.Tensor  # [R] flat node index (S * N for a row left over)
    row_of_node: torch.Tensor  # [S, N] (R for a node without a row)
    qo_indptr: torch.Tensor  # [S + 1] int32

    @staticmethod
    def of(counts: torch.Tensor, nodes: int, num_rows: int) -> RowLayout:
        """counts [S] int64: rows of each sequence, at most `nodes`; their sum at most `num_rows`."""
        s, dev = counts.shape[0], counts.device
        node = torch.arange(nodes, device=dev)
        ends = torch.cumsum(counts, 0)
        row_of_node = torch.where(node < counts[:, None], (ends - counts)[:, None] + node, num_rows)
        node_of_row = torch.full((num_rows + 1,), s * nodes, dtype=torch.long, device=dev)
        node_of_row.scatter_(0, row_of_node.view(-1), torch.arange(s * nodes, device=dev))  # (nodes without a row: the extra entry)
        qo_indptr = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        return RowLayout(node_of_row[:num_rows], row_of_node, qo_indptr)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """[S, N] per node -> [R] per row (0 for a row left over)."""
        return torch.cat([t.reshape(-1), t.new_zeros(1)])[self.node_of_row]

    def nodes(self, t: torch.Tensor) -> torch.Tensor:
        """[R] per row -> [S, N] per node (0 for a node without a row)."""
        return torch.cat([t, t.new_zeros(1)])[self.row_of_node]
