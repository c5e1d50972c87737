"""Each draw's noise counter: the token it follows and how often the sample followed that token before.

A sampled token is the argmax of z + Gumbel noise hashed from (key, counter, token id)
(rollout/engine/sampler.py says why the counter is indexed by content). For a decode step's
tree (node 0 the root, the sequence's last token), node n draws after the sequence's tokens and
the path down to n, so its count is how often its own token appears among the predecessors of
the sample's earlier draws: the committed tokens from the prompt's last up to the root
(excluded), then the path's nodes above n, the root included.

`draw_counters` is one Triton program per sequence on CUDA, reading only the sequence's own
tokens (its length, not the table's capacity: the torch reference compares every node against
the whole row, some ten small kernels and [S, N, C] booleans a step), and `draw_counters_ref`
elsewhere, the definition the kernel is held to.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fused import triton, use_triton

if triton is not None:
    import triton.language as tl

BLOCK_C = 256  # committed tokens a loop iteration compares


def count_bits(vocab: int) -> int:
    """Bits of a counter that hold the count: what 32 bits leave beside a token id."""
    return 32 - max(1, (vocab - 1).bit_length())


def pack_counter(last_token, count, vocab: int):
    """A draw's counter: (last token, count) in 32 bits, one-to-one while the count stays below
    2^count_bits(vocab) (65,536 at a 49,152 vocabulary, 16,384 at 151,936); Python ints or int64 tensors."""
    bits = count_bits(vocab)
    return (last_token << bits) | (count & ((1 << bits) - 1))


def draw_counters(table_tokens: torch.Tensor, lengths: torch.Tensor, prompt_lens: torch.Tensor, rows: torch.Tensor,
                  tree_tokens: torch.Tensor, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """table_tokens [R, C] int32, lengths and prompt_lens [R] int32; rows [S]; tree_tokens [S, N]
    int64 (node 0: the sequence's last token); ancestors [S, N] int64 (bit m of node n: m is n
    or above it). Returns each node's counter, [S, N] int64."""
    if use_triton(tree_tokens) and tree_tokens.numel():
        return _draw_counters_triton(table_tokens, lengths, prompt_lens, rows, tree_tokens, ancestors, vocab)
    return draw_counters_ref(table_tokens, lengths, prompt_lens, rows, tree_tokens, ancestors, vocab)


def draw_counters_ref(table_tokens, lengths, prompt_lens, rows, tree_tokens, ancestors, vocab) -> torch.Tensor:
    """`draw_counters` in torch."""
    rows = rows.long()
    own = table_tokens[rows]  # [S, C]
    cols = torch.arange(own.shape[1], device=own.device)
    first, root = prompt_lens[rows].long() - 1, lengths[rows].long() - 1
    before_root = (cols >= first[:, None]) & (cols < root[:, None])
    tok = tree_tokens.long()
    committed = ((own[:, None, :] == tok[:, :, None]) & before_root[:, None, :]).sum(-1)  # [S, N]
    node = torch.arange(tok.shape[1], device=tok.device)
    above = ((ancestors[:, :, None] >> node) & 1).bool() & (node[:, None] != node)  # [S, n, m]: m strictly above n
    on_path = (above & (tok[:, :, None] == tok[:, None, :])).sum(-1)
    return pack_counter(tok, committed + on_path, vocab)


def _draw_counters_triton(table_tokens, lengths, prompt_lens, rows, tree_tokens, ancestors, vocab) -> torch.Tensor:
    s, n = tree_tokens.shape
    out = torch.empty(s, n, dtype=torch.int64, device=tree_tokens.device)
    bits = count_bits(vocab)
    _draw_counters_kernel[(s,)](
        table_tokens, lengths, prompt_lens, rows, tree_tokens.contiguous(), ancestors.contiguous(), out,
        table_tokens.stride(0), n, bits, (1 << bits) - 1,
        BLOCK_N=triton.next_power_of_2(n), BLOCK_C=BLOCK_C, num_warps=4, **pdl.launch_args(),
    )
    return out


if triton is not None:

    @triton.jit
    def _draw_counters_kernel(tokens_ptr, lengths_ptr, prompt_lens_ptr, rows_ptr, tree_ptr, anc_ptr, out_ptr,
                              stride, N, bits, mask, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                              PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        seq = tl.program_id(0)
        row = tl.load(rows_ptr + seq).to(tl.int64)
        first = tl.load(prompt_lens_ptr + row) - 1
        root = tl.load(lengths_ptr + row) - 1
        j = tl.arange(0, BLOCK_N)
        node_ok = j < N
        tok = tl.load(tree_ptr + seq * N + j, mask=node_ok, other=-1)
        count = tl.zeros([BLOCK_N], dtype=tl.int64)
        for c0 in range(first, root, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            own = tl.load(tokens_ptr + row * stride + cols, mask=cols < root, other=-1).to(tl.int64)
            count += tl.sum((own[None, :] == tok[:, None]).to(tl.int64), 1)
        anc = tl.load(anc_ptr + seq * N + j, mask=node_ok, other=0)
        above = ((anc[:, None] >> j[None, :].to(tl.int64)) & 1) != 0
        above = above & (j[:, None] != j[None, :]) & node_ok[None, :]
        count += tl.sum((above & (tok[:, None] == tok[None, :])).to(tl.int64), 1)
        tl.store(out_ptr + seq * N + j, (tok << bits) | (count & mask), mask=node_ok)
