"""A verify step's outcome on the device: which drafts its trees accepted, for the step chained after it.

After a verify step has drawn a target token at every tree node, each tree's accepted path
is the walk of `spec.verify.accept_paths`: from the root, descend to the child carrying the
token drawn at the current node, while there is one. Here that walk runs on the device, as
part of the step (inside its CUDA graph), so that a decode step launched before the host has
the step's tokens can continue from it. `verify_outcome` returns each sequence's path length
(root included) and bonus token, and moves the accepted drafts' KV slots in the slot table
to the positions right after the root, as the host does later when it collects the step.

On CUDA it is one Triton kernel, one program per tree: a node is accepted iff every node on
its way from the root (itself included) carries its parent's draw, which the tree's ancestor
bitmask (the attention's `tree_mask`) turns into one AND per node. Elsewhere it is the torch
reference below, some 50 small tensor operations.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fused import triton, use_triton

if triton is not None:
    import triton.language as tl


def accept_on_device(
    parents: torch.Tensor, depths: torch.Tensor, trees: torch.Tensor, first: torch.Tensor,
    max_depth: int, tokens: torch.Tensor, drawn: torch.Tensor, real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk as tensor operations. parents [T] (-1: a root), depths [T], trees [T] (each node's
    tree) and first [B + 1] (tree b's nodes are first[b]:first[b + 1]) describe the trees;
    `max_depth` bounds their depth; `real` [T] bool marks the nodes of some tree (the rest are
    padding). Returns the accepted nodes [T] bool, each tree's path length [B] (its root
    included) and its path's last node [B], whose draw is the bonus token."""
    node = torch.arange(len(parents), device=parents.device)
    up = torch.where(parents >= 0, parents, node)  # a root is its own parent
    accepted = (parents < 0) | (tokens == drawn.long()[up])
    if real is not None:
        accepted &= real
    for _ in range(max_depth.bit_length()):  # pointer doubling: after k rounds, 2**k - 1 ancestors are in
        accepted = accepted & accepted[up]
        up = up[up]
    counted = torch.zeros(len(parents) + 1, dtype=torch.int64, device=parents.device)
    torch.cumsum(accepted, 0, out=counted[1:])
    lengths = counted[first[1:]] - counted[first[:-1]]
    # the accepted nodes of a tree form a chain from its root, one per depth: the last is the deepest
    last = torch.where(accepted & (depths == lengths[trees] - 1), node, 0)
    return accepted, lengths, torch.zeros_like(lengths).index_add_(0, trees, last)


def verify_outcome(
    parents: torch.Tensor, ancestors: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
    out_slots: torch.Tensor, drawn: torch.Tensor, qo_indptr: torch.Tensor, seq_rows: torch.Tensor,
    slot_table: torch.Tensor, padding_row: int, max_tree_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's layout on the device (parents [T], step-wide, -1: a root; ancestors [T], the
    tree mask; tokens, positions, out_slots [T]; qo_indptr [B + 1]; seq_rows [B]) and its draws
    (drawn [>= T], float64). Returns each sequence's bonus token [B] and path length [B] (root
    included; 0 for a padding sequence), and writes the accepted drafts' slots into `slot_table`.
    Tokens past qo_indptr[-1] are padding and change nothing."""
    if not use_triton(tokens):
        return verify_outcome_ref(parents, tokens, positions, out_slots, drawn, qo_indptr, seq_rows, slot_table,
                                  padding_row, max_tree_tokens)
    b = len(seq_rows)
    bonus = torch.empty(b, dtype=torch.int64, device=tokens.device)
    lengths = torch.empty(b, dtype=torch.int64, device=tokens.device)
    _tree_accept_kernel[(b,)](
        parents, ancestors, tokens, positions, out_slots, drawn, qo_indptr, seq_rows, slot_table,
        bonus, lengths, slot_table.stride(0), BLOCK=max(16, triton.next_power_of_2(max_tree_tokens)),
        num_warps=1, **pdl.launch_args(),
    )
    return bonus, lengths


def verify_outcome_ref(
    parents: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
    drawn: torch.Tensor, qo_indptr: torch.Tensor, seq_rows: torch.Tensor, slot_table: torch.Tensor,
    padding_row: int, max_tree_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_outcome` in torch. Each node rewrites the slot-table entry `_tree_layout` gave it (with
    its own slot, or the accepted one of its depth); padding tokens rewrite slot 0 into the padding
    row's first entry, which holds 0."""
    t, b = len(tokens), len(seq_rows)
    node = torch.arange(t, device=tokens.device)
    first = qo_indptr.long()
    real = node < first[-1]
    trees = torch.searchsorted(first[1:], node, right=True).clamp_(max=b - 1)
    roots = first[trees]
    depths = positions - positions[roots]
    accepted, lengths, last = accept_on_device(
        parents, depths, trees, first, max_tree_tokens - 1, tokens, drawn[:t], real
    )
    moved = torch.cat([out_slots, out_slots[:1]])  # the extra entry takes every rejected node's write
    moved[torch.where(accepted, roots + depths, t)] = out_slots
    rows = torch.where(real, seq_rows.long()[trees], padding_row)
    cols = torch.where(real, positions[roots] + node - roots, 0)
    slot_table[rows, cols] = torch.where(real, moved[:t], 0).to(torch.int32)
    return drawn[last].long(), lengths


if triton is not None:

    @triton.jit
    def _tree_accept_kernel(
        parents_ptr, ancestors_ptr, tokens_ptr, positions_ptr, out_slots_ptr, drawn_ptr, qo_indptr_ptr,
        seq_rows_ptr, slot_table_ptr, bonus_ptr, lengths_ptr, stride_table,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.wait_for_previous(PDL)
        b = tl.program_id(0)
        start = tl.load(qo_indptr_ptr + b).to(tl.int64)
        n = tl.load(qo_indptr_ptr + b + 1).to(tl.int64) - start
        local = tl.arange(0, BLOCK)
        ok = local < n
        node = start + local
        parent = tl.load(parents_ptr + node, mask=ok, other=-1)
        token = tl.load(tokens_ptr + node, mask=ok, other=-1)
        parent_draw = tl.load(drawn_ptr + parent, mask=ok & (parent >= 0), other=-1.0).to(tl.int64)
        matches = ok & ((parent < 0) | (token == parent_draw))
        # distinct bits add without carries, so the sum is their OR (bit 63 wraps to the sign as it should)
        match_bits = tl.sum(tl.where(matches, tl.full([BLOCK], 1, tl.int64) << local.to(tl.int64), 0))
        ancestors = tl.load(ancestors_ptr + node, mask=ok, other=-1)
        accepted = ok & ((ancestors & ~match_bits) == 0)  # every node from the root to this one matches
        length = tl.sum(accepted.to(tl.int64))
        root_position = tl.load(positions_ptr + start, mask=n > 0, other=0)
        depth = tl.load(positions_ptr + node, mask=ok, other=0) - root_position
        # the accepted nodes form a chain from the root, and children follow their parents: the path
        # ends at the last of them
        last = tl.max(tl.where(accepted, local, 0))
        bonus = tl.load(drawn_ptr + start + last, mask=n > 0, other=0.0).to(tl.int64)
        tl.store(bonus_ptr + b, bonus)
        tl.store(lengths_ptr + b, length)
        row = tl.load(seq_rows_ptr + b).to(tl.int64)
        slot = tl.load(out_slots_ptr + node, mask=accepted, other=0).to(tl.int32)
        tl.store(slot_table_ptr + row * stride_table + root_position + depth, slot, mask=accepted)
