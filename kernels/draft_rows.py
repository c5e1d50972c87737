"""A verify step computes only the batch's best drafts: which, and where each sits among its rows.

A drafting step holds a tree per sequence in a uniform layout ([S, N]: node 0 the root, then
the drafts in rank order, kernels/ngram_draft.py), but its forward pass runs over `S + capacity`
rows: every root, and the `capacity` drafts of the whole batch with the highest keys (ties: the
earlier node, sequence by sequence). A tree's keys never grow with its rank, so the drafts a
sequence keeps are its first few nodes, themselves a tree. Each sequence's rows are contiguous,
root first (attention's `qo_indptr`); rows left over when the batch has fewer drafts than
capacity belong to no sequence, compute a dummy token and are dropped.

What a draft costs is then one row, whichever sequence it belongs to, rather than a row for
every sequence at every width; a sequence with nothing to draft costs only its root. Shapes
are fixed by (S, N, capacity), so all of it runs inside a CUDA graph.

`lay_out_drafts` is two Triton kernels on CUDA (a histogram of the keys, then a block of
sequences per program: the histogram gives the lowest key kept, and each program lays its
sequences' rows out after counting the earlier blocks' rows) and `lay_out_drafts_ref`
elsewhere, the definition the kernels are held to. In torch ops the same work was ~100 us of
small index kernels (choosing, laying out, gathering) at 128 sequences on an H100, a fixed cost of
every drafting step whatever its number of rows (bench/RESULTS.md at commit 8a4b12b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.fused import triton, use_triton
from kernels.ngram_draft import KEY_SCALE, PADDING

if triton is not None:
    import triton.language as tl


@dataclass
class DraftRows:
    """The step's rows: sequence i's first `counts[i]` nodes, in order, from row `qo_indptr[i]` on;
    R = S + capacity rows in all."""

    parents: torch.Tensor  # [S, N] the trees' parents, PADDING for a node not kept
    counts: torch.Tensor  # [S] int64 rows of each sequence, its root included
    qo_indptr: torch.Tensor  # [S + 1] int32
    node_of_row: torch.Tensor  # [R] flat node index (S * N for a row left over)
    row_of_node: torch.Tensor  # [S, N] (R for a node without a row)
    tokens: torch.Tensor  # [R] each row's token (0 for a row left over, as below)
    positions: torch.Tensor  # [R] its position in its sequence
    draw_positions: torch.Tensor  # [R] the output position its draw is for
    tree: torch.Tensor  # [R] its node's ancestor bits (attention's tree mask)
    seq: torch.Tensor  # [R] its sequence (S - 1 for a row left over)
    slots: torch.Tensor  # [S, N] the KV slot of each node's row (0 for a node without a row)

    def nodes(self, t: torch.Tensor) -> torch.Tensor:
        """[R] per row -> [S, N] per node (0 for a node without a row)."""
        return torch.cat([t, t.new_zeros(1)])[self.row_of_node]


def lay_out_drafts(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                   keys: torch.Tensor, kv: torch.Tensor, out_pos: torch.Tensor, slots: torch.Tensor,
                   capacity: int) -> DraftRows:
    """Keep the `capacity` drafts with the highest keys and lay the step's rows out.

    tokens, parents, depths, ancestors, keys [S, N] int64: the drafter's trees (keys of the root
    and of padding: -1; of a draft: below KEY_SCALE). kv, out_pos [S] int64: each root's position
    and the output position of its draw; slots [S + capacity] int64: the step's KV slots, a row each."""
    if use_triton(keys) and keys.numel():
        return _lay_out_triton(tokens, parents, depths, ancestors, keys, kv, out_pos, slots, capacity)
    return lay_out_drafts_ref(tokens, parents, depths, ancestors, keys, kv, out_pos, slots, capacity)


# ---------------- the reference ----------------
def lay_out_drafts_ref(tokens, parents, depths, ancestors, keys, kv, out_pos, slots, capacity) -> DraftRows:
    """`lay_out_drafts` in torch (the CPU path and the kernel's definition)."""
    s, n = parents.shape
    dev = parents.device
    drafts = s * (n - 1)
    kept = parents[:, 1:] >= 0  # [S, W]
    if capacity < drafts:
        flat = torch.arange(drafts, device=dev)
        order = keys[:, 1:].reshape(-1) * drafts + (drafts - 1 - flat)  # distinct; a child below its parent
        best = torch.zeros(drafts, dtype=torch.bool, device=dev)
        best.scatter_(0, order.topk(capacity).indices, True)
        kept = kept & best.view(s, n - 1)
    counts = 1 + kept.sum(dim=1)
    num_rows = s + capacity
    node = torch.arange(n, device=dev)
    ends = torch.cumsum(counts, 0)
    row_of_node = torch.where(node < counts[:, None], (ends - counts)[:, None] + node, num_rows)
    node_of_row = torch.full((num_rows + 1,), s * n, dtype=torch.long, device=dev)
    node_of_row.scatter_(0, row_of_node.view(-1), torch.arange(s * n, device=dev))  # (nodes without a row: the extra entry)
    node_of_row = node_of_row[:num_rows]

    def rows(t: torch.Tensor) -> torch.Tensor:  # [S, N] per node -> [R] per row
        return torch.cat([t.reshape(-1), t.new_zeros(1)])[node_of_row]

    return DraftRows(
        parents=torch.cat([parents[:, :1], torch.where(kept, parents[:, 1:], PADDING)], dim=1),
        counts=counts, qo_indptr=torch.cat([ends.new_zeros(1), ends]).to(torch.int32),
        node_of_row=node_of_row, row_of_node=row_of_node, tokens=rows(tokens), positions=rows(kv[:, None] + depths),
        draw_positions=rows(out_pos[:, None] + depths), tree=rows(ancestors), seq=(node_of_row // n).clamp(max=s - 1),
        slots=torch.cat([slots, slots.new_zeros(1)])[row_of_node],
    )


# ---------------- the kernels ----------------
BLOCK_S = 64  # sequences per program
BINS = 2 * KEY_SCALE  # histogram bins: bin key + 1 for a draft (keys are below KEY_SCALE), bin 0 for any other node


def _lay_out_triton(tokens, parents, depths, ancestors, keys, kv, out_pos, slots, capacity) -> DraftRows:
    s, n = parents.shape
    r = s + capacity
    dev = parents.device
    tokens, parents, depths, ancestors, keys = (t.contiguous() for t in (tokens, parents, depths, ancestors, keys))
    i64 = lambda *shape: torch.empty(*shape, dtype=torch.int64, device=dev)  # noqa: E731
    out = DraftRows(parents=i64(s, n), counts=i64(s), qo_indptr=torch.empty(s + 1, dtype=torch.int32, device=dev),
                    node_of_row=i64(r), row_of_node=i64(s, n), tokens=i64(r), positions=i64(r),
                    draw_positions=i64(r), tree=i64(r), seq=i64(r), slots=i64(s, n))
    grid = (triton.cdiv(s, BLOCK_S),)
    block_n = triton.next_power_of_2(n)
    hist = torch.zeros(BINS, dtype=torch.int32, device=dev)
    _key_histogram_kernel[grid](parents, keys, hist, s, n, BLOCK_S=BLOCK_S, BLOCK_N=block_n, PADDING=PADDING,
                                num_warps=4, **pdl.launch_args())
    _lay_out_kernel[grid](
        tokens, parents, depths, ancestors, keys, kv, out_pos, slots, hist,
        out.parents, out.counts, out.qo_indptr, out.node_of_row, out.row_of_node, out.tokens, out.positions,
        out.draw_positions, out.tree, out.seq, out.slots, s, n, capacity,
        BLOCK_S=BLOCK_S, BLOCK_N=block_n, BLOCK_R=BLOCK_S * block_n, BINS=BINS,
        PADDING=PADDING, num_warps=4, **pdl.launch_args(),
    )
    return out


if triton is not None:

    @triton.jit
    def _key_histogram_kernel(parents_ptr, keys_ptr, hist_ptr, S, N, BLOCK_S: tl.constexpr,
                              BLOCK_N: tl.constexpr, PADDING: tl.constexpr, PDL: tl.constexpr):
        """How many drafts have each key (bin key + 1), a block of sequences per program."""
        pdl.wait_for_previous(PDL)
        seq = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
        j = tl.arange(0, BLOCK_N)[None, :]
        ok = (seq < S) & (j < N)
        par = tl.load(parents_ptr + seq * N + j, mask=ok, other=PADDING)
        key = tl.load(keys_ptr + seq * N + j, mask=ok, other=-1)
        tl.atomic_add(hist_ptr + (key + 1).to(tl.int32), 1, mask=par >= 0, sem="relaxed")

    @triton.jit
    def _kept(par, key, lowest, take, ties_before):
        """Which of a block's nodes are kept drafts: keys above the lowest kept one, and the first
        `take` drafts at it in node order (`ties_before` of them in earlier blocks); and the ties."""
        bins = tl.where(par >= 0, key + 1, 0).to(tl.int32)
        tie = ((par >= 0) & (bins == lowest)).to(tl.int32)
        tie_rows = tl.sum(tie, 1)
        rank = (ties_before + tl.cumsum(tie_rows, 0) - tie_rows)[:, None] + tl.cumsum(tie, 1) - tie
        kept = (par >= 0) & ((bins > lowest) | ((tie > 0) & (rank < take)))
        return kept, tl.sum(tie_rows, 0)

    @triton.jit
    def _lay_out_kernel(
        tokens_ptr, parents_ptr, depths_ptr, ancestors_ptr, keys_ptr, kv_ptr, out_pos_ptr, slots_ptr, hist_ptr,
        out_par_ptr, counts_ptr, qo_ptr, node_of_row_ptr, row_of_node_ptr, row_tok_ptr, row_pos_ptr,
        row_draw_ptr, row_tree_ptr, row_seq_ptr, node_slots_ptr, S, N, C,
        BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BINS: tl.constexpr,
        PADDING: tl.constexpr, PDL: tl.constexpr,
    ):
        """A block of sequences per program: their kept nodes and rows. Where its rows start
        depends on every earlier block's kept drafts, which each program counts again (a few
        loads per earlier block) rather than waiting for the others."""
        pdl.wait_for_previous(PDL)
        R = S + C
        j = tl.arange(0, BLOCK_N)[None, :]
        # the lowest kept bin, and how many of its drafts are kept (the earliest)
        b = tl.arange(0, BINS)
        hist = tl.load(hist_ptr + b)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        lowest = tl.max(tl.where((b >= 1) & (at_or_above >= C), b, 1), 0)
        take = C - tl.sum(tl.where(b > lowest, hist, 0), 0)
        # the ties and rows of the blocks before this one
        ties_before = tl.sum(tl.zeros([1], tl.int32), 0)
        first_free = tl.sum(tl.zeros([1], tl.int32), 0)
        s_block = tl.program_id(0) * BLOCK_S
        for s0 in range(0, s_block, BLOCK_S):  # (earlier blocks are whole: no mask by sequence)
            seq = s0 + tl.arange(0, BLOCK_S)[:, None]
            ok = j < N
            par = tl.load(parents_ptr + seq * N + j, mask=ok, other=PADDING)
            key = tl.load(keys_ptr + seq * N + j, mask=ok, other=-1)
            kept, ties = _kept(par, key, lowest, take, ties_before)
            ties_before += ties
            first_free += BLOCK_S + tl.sum(tl.sum(kept.to(tl.int32), 1), 0)
        # this block's sequences: their kept nodes (a prefix of each tree) and rows
        seq1 = s_block + tl.arange(0, BLOCK_S)
        seq = seq1[:, None]
        ok = (seq < S) & (j < N)
        node = seq * N + j
        par = tl.load(parents_ptr + node, mask=ok, other=PADDING)
        key = tl.load(keys_ptr + node, mask=ok, other=-1)
        kept, ties = _kept(par, key, lowest, take, ties_before)
        count = tl.where(seq1 < S, 1 + tl.sum(kept.to(tl.int32), 1), 0)
        first = first_free + tl.cumsum(count, 0) - count
        first_free += tl.sum(count, 0)
        tl.store(counts_ptr + seq1, count.to(tl.int64), mask=seq1 < S)
        tl.store(qo_ptr + seq1, first, mask=seq1 < S)
        has_row = ok & (j < count[:, None])
        row = first[:, None] + j
        tl.store(row_of_node_ptr + node, tl.where(has_row, row, R).to(tl.int64), mask=ok)
        tl.store(out_par_ptr + node, tl.where(has_row, par, PADDING), mask=ok)
        depth = tl.load(depths_ptr + node, mask=has_row, other=0)
        tl.store(node_of_row_ptr + row, node.to(tl.int64), mask=has_row)
        tl.store(row_tok_ptr + row, tl.load(tokens_ptr + node, mask=has_row, other=0), mask=has_row)
        tl.store(row_pos_ptr + row, tl.load(kv_ptr + seq, mask=seq < S, other=0) + depth, mask=has_row)
        tl.store(row_draw_ptr + row, tl.load(out_pos_ptr + seq, mask=seq < S, other=0) + depth, mask=has_row)
        tl.store(row_tree_ptr + row, tl.load(ancestors_ptr + node, mask=has_row, other=0), mask=has_row)
        tl.store(row_seq_ptr + row, tl.broadcast_to(seq.to(tl.int64), [BLOCK_S, BLOCK_N]), mask=has_row)
        tl.store(node_slots_ptr + node, tl.load(slots_ptr + row, mask=has_row, other=0), mask=ok)
        if s_block + BLOCK_S >= S:  # the last block: the rows after its last are no sequence's
            tl.store(qo_ptr + S, first_free)
            for r0 in range(0, R, BLOCK_R):
                rest = r0 + tl.arange(0, BLOCK_R)
                left = (rest >= first_free) & (rest < R)
                zero = tl.zeros([BLOCK_R], tl.int64)
                tl.store(node_of_row_ptr + rest, zero + S * N, mask=left)
                tl.store(row_tok_ptr + rest, zero, mask=left)
                tl.store(row_pos_ptr + rest, zero, mask=left)
                tl.store(row_draw_ptr + rest, zero, mask=left)
                tl.store(row_tree_ptr + rest, zero, mask=left)
                tl.store(row_seq_ptr + rest, zero + S - 1, mask=left)
