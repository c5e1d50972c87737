"""A decode or verify step's outcome on the device: which drafts its trees accepted, applied.

Every sequence of the step feeds a tree of N nodes in a uniform layout ([S, N]: node 0 the
root, its last token; local parent indices, -1 for the root and -2 for padding nodes, which
carry no draft). The step draws a target token at every node. A node is accepted when every
node from the root down to it carries its parent's draw (so a padding node never is); the
accepted nodes form a chain, one per depth. That is the walk of multi-draft verification:
from the root, descend to the child carrying the token drawn at the current node, while there
is one; the draw at the last accepted node is the bonus token.

`accept_trees` then applies the outcome where the next step will read it, so that step can be
launched before the host has seen any of this one:
- each accepted node's KV slot moves in the slot table to its depth's position (the layout
  placed node i at position kv + i, kv being the tokens cached before the step);
- the emitted tokens (the draws at the accepted nodes: the accepted drafts, then the bonus
  token) go into the token table after the sequence's tokens, whose count grows by as many;
- and they come back with their logprobs, depth by depth, for the host.

On CUDA it is one Triton kernel, one program per sequence; elsewhere the torch reference.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fused import triton, use_triton

if triton is not None:
    import triton.language as tl


def accept_trees(
    parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor,
    drawn: torch.Tensor, drawn_logprobs: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
    slot_table: torch.Tensor, token_table: torch.Tensor, token_lens: torch.Tensor, padding_row: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, ancestors (bit j: node j is the node or above it), depths, tokens, drawn (int64),
    drawn_logprobs (float32) and slots: [S, N]; rows [S] int32 (the padding row for padding
    sequences, which change nothing). Each sequence's cached tokens are token_lens[row] - 1.

    Returns emitted tokens [S, N] int64 and logprobs [S, N] float32 by depth (the first `length`
    are real), each sequence's accepted length [S] int64 (the root included: tokens emitted) and
    its accepted nodes as a bitmask [S] int64."""
    if use_triton(tokens):
        return _accept_triton(parents, ancestors, depths, tokens, drawn, drawn_logprobs, rows, slots, slot_table,
                              token_table, token_lens, padding_row)
    return accept_trees_ref(parents, ancestors, depths, tokens, drawn, drawn_logprobs, rows, slots, slot_table,
                            token_table, token_lens, padding_row)


def accept_trees_ref(parents, ancestors, depths, tokens, drawn, drawn_logprobs, rows, slots, slot_table, token_table,
                     token_lens, padding_row):
    """`accept_trees` in torch (the CPU path and the kernel's definition)."""
    s, n = tokens.shape
    dev = tokens.device
    node = torch.arange(n, device=dev)
    parent_draw = drawn.gather(1, parents.clamp(min=0))
    matched = (parents == -1) | ((parents >= 0) & (tokens == parent_draw))
    matched_bits = (matched.long() << node).sum(dim=1, keepdim=True)  # distinct bits: the sum is their OR
    accepted = (ancestors & ~matched_bits) == 0
    length = accepted.sum(dim=1)
    bits = (accepted.long() << node).sum(dim=1)
    real = rows.long() != padding_row
    kv = (token_lens[rows.long()].long() - 1).clamp(min=0)
    d = torch.where(accepted, depths, n)  # rejected nodes write past the end: column n is dropped
    out_tok = torch.zeros(s, n + 1, dtype=torch.int64, device=dev).scatter_(1, d, drawn)[:, :n]
    out_lp = torch.zeros(s, n + 1, dtype=torch.float32, device=dev).scatter_(1, d, drawn_logprobs.float())[:, :n]
    keep = accepted & real[:, None]
    r = rows.long()[:, None].expand(s, n)[keep]
    slot_table[r, (kv[:, None] + depths)[keep]] = slots[keep].to(slot_table.dtype)
    token_table[r, (kv[:, None] + 1 + depths)[keep]] = drawn[keep].to(token_table.dtype)
    token_lens.index_add_(0, rows.long()[real], length[real].to(token_lens.dtype))
    return out_tok, out_lp, length, bits


def _accept_triton(parents, ancestors, depths, tokens, drawn, drawn_logprobs, rows, slots, slot_table, token_table,
                   token_lens, padding_row):
    s, n = tokens.shape
    # the kernel indexes [S, N] inputs as rows of N
    parents, ancestors, depths, tokens, drawn, drawn_logprobs, slots = (
        t.contiguous() for t in (parents, ancestors, depths, tokens, drawn, drawn_logprobs, slots))
    dev = tokens.device
    out_tok = torch.empty(s, n, dtype=torch.int64, device=dev)
    out_lp = torch.empty(s, n, dtype=torch.float32, device=dev)
    length = torch.empty(s, dtype=torch.int64, device=dev)
    bits = torch.empty(s, dtype=torch.int64, device=dev)
    _accept_kernel[(s,)](
        parents, ancestors, depths, tokens, drawn, drawn_logprobs, rows, slots, slot_table, token_table, token_lens,
        out_tok, out_lp, length, bits, slot_table.stride(0), token_table.stride(0), padding_row, n,
        BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1, **pdl.launch_args(),
    )
    return out_tok, out_lp, length, bits


if triton is not None:

    @triton.jit
    def _accept_kernel(
        parents_ptr, ancestors_ptr, depths_ptr, tokens_ptr, drawn_ptr, lp_ptr, rows_ptr, slots_ptr, slot_table_ptr,
        token_table_ptr, token_lens_ptr, out_tok_ptr, out_lp_ptr, length_ptr, bits_ptr,
        stride_slots, stride_tokens, padding_row, n, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.wait_for_previous(PDL)
        seq = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        ok = lane < n
        at = seq * n + lane
        parent = tl.load(parents_ptr + at, mask=ok, other=-2)
        token = tl.load(tokens_ptr + at, mask=ok, other=-1)
        parent_draw = tl.load(drawn_ptr + seq * n + tl.maximum(parent, 0), mask=ok, other=-1)
        matched = ok & ((parent == -1) | ((parent >= 0) & (token == parent_draw)))
        # distinct bits add without carries, so the sum is their OR (bit 63 wraps to the sign as it should)
        one = tl.full([BLOCK], 1, tl.int64)
        matched_bits = tl.sum(tl.where(matched, one << lane.to(tl.int64), 0))
        ancestors = tl.load(ancestors_ptr + at, mask=ok, other=-1)
        accepted = ok & ((ancestors & ~matched_bits) == 0)
        length = tl.sum(accepted.to(tl.int64))
        tl.store(length_ptr + seq, length)
        tl.store(bits_ptr + seq, tl.sum(tl.where(accepted, one << lane.to(tl.int64), 0)))
        depth = tl.load(depths_ptr + at, mask=ok, other=0)
        draw = tl.load(drawn_ptr + at, mask=ok, other=0)
        tl.store(out_tok_ptr + seq * n + depth, draw, mask=accepted)
        tl.store(out_lp_ptr + seq * n + depth, tl.load(lp_ptr + at, mask=ok, other=0.0), mask=accepted)
        row = tl.load(rows_ptr + seq).to(tl.int64)
        real = row != padding_row
        kv = tl.maximum(tl.load(token_lens_ptr + row).to(tl.int64) - 1, 0)
        keep = accepted & real
        slot = tl.load(slots_ptr + at, mask=keep, other=0)
        tl.store(slot_table_ptr + row * stride_slots + kv + depth, slot.to(tl.int32), mask=keep)
        tl.store(token_table_ptr + row * stride_tokens + kv + 1 + depth, draw.to(tl.int32), mask=keep)
        tl.debug_barrier()  # every lane has read the old length before it changes
        if real:
            tl.store(token_lens_ptr + row, (kv + 1 + length).to(tl.int32))
