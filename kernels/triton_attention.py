"""Triton attention over the token-granular paged KV cache (see kernels/attention.py).

One step = `plan(meta)` once on the host, then `forward(...)` once per layer, which launches:

  _store_kv_kernel      grid (T,): writes this step's K/V at meta.out_slots.
  _attention_kernel     grid (m_blocks * num_splits, num_kv_heads, num_seqs): flash attention
                        over the slots of one sequence, for one kv head, one block of query rows
                        and one slice ("split") of the keys.
  _merge_splits_kernel  grid (T, num_heads), only when num_splits > 1: log-sum-exp merge of
                        the splits' partial outputs (flash-decoding).

GQA: the rows of a block are (new token, head of the group) pairs, token-major
(row r = token r // GROUP, head kv_head * GROUP + r % GROUP), so a K/V tile loaded for a kv
head serves all query heads of the group and the block's new tokens in one tl.dot. The same
kernel serves decode / tree verify (blocks of 16 rows, so a root alone costs one small block
however wide the step's trees; keys split across programs so batch 1 with a long context still
fills the GPU) and prefill / extend (many row blocks, usually one split), with different block
sizes chosen in plan().

Softmax runs in base 2 (scores pre-multiplied by scale * log2 e) and accumulates in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl, sm_count
from kernels.attention import MAX_TREE_TOKENS, AttentionMetadata

LOG2E = 1.4426950408889634

# A step whose longest query is at most this many tokens uses the decode/verify configuration
# (small row blocks, split-KV); longer ones (prefill, chunked extend) use the prefill one.
DECODE_MAX_Q_LEN = MAX_TREE_TOKENS
# Split-KV: aim for this many programs per SM, and give each split at least this many keys so
# the merge and the per-program overhead stay small next to the key loop.
PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Batch-invariant steps (coupled sampling): splits of this many keys from the first, whatever the
# step, so a query's partial sums, and their merge, depend on its position alone. 2,048: a large batch wants
# few splits, a rollout's tail of long samples many; on an H200 512 ran the 8B shape's b64 (1k keys) at 0.88x of
# the default mode and rl 64 x 8 at 0.96x, 2,048 at 0.955x and 0.92x (bench/results/session-20261129e/
# deterministic-ab-8b.log; RESULTS at commit dbfeafd)
INVARIANT_KEYS_PER_SPLIT = 2048


@triton.jit
def _load_tile(ptrs, row_ok, dims, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Loads a [R, BLOCK_D] tile. The head-dim mask exists only when head_dim is not a power of
    two: a mask that varies along the contiguous axis would stop the loads being vectorised."""
    if MASK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store_tile(ptrs, tile, row_ok, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, tile, mask=row_ok[:, None])
    else:
        tl.store(ptrs, tile, mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM))


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    out_slots_ptr,  # [T] int64
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(out_slots_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_KV_HEADS
    k = _load_tile(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
                   head_ok, dims, True, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
                   head_ok, dims, True, HEAD_DIM, BLOCK_D)
    # the cast fuses the q dtype -> cache dtype conversion into the write
    _store_tile(k_cache_ptr + slot * stride_kc_slot + heads[:, None] * stride_kc_head + dims[None, :],
                k.to(k_cache_ptr.dtype.element_ty), head_ok, dims, HEAD_DIM, BLOCK_D)
    _store_tile(v_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_head + dims[None, :],
                v.to(v_cache_ptr.dtype.element_ty), head_ok, dims, HEAD_DIM, BLOCK_D)


@triton.jit
def _attend_block(
    acc, m_i, l_i,  # [BLOCK_M, BLOCK_D] fp32, [BLOCK_M] fp32 (base-2 running max), [BLOCK_M] fp32
    q,  # [BLOCK_M, BLOCK_D]
    start, hi, num_cached,
    slot_row_ptr, stride_slot_col,
    k_head_ptr, v_head_ptr, stride_k_slot, stride_v_slot,
    tok, tree,  # [BLOCK_M] int32 index among the new tokens; [BLOCK_M] int64 tree bits
    qk_scale, dims,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys, online softmax. MASKED=False only for whole tiles inside the
    cached prefix, which every query of the sequence sees."""
    cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the sequence
    col_ok = cols < hi
    if MASKED:
        slots = tl.load(slot_row_ptr + cols * stride_slot_col, mask=col_ok, other=0).to(tl.int64)
    else:
        slots = tl.load(slot_row_ptr + cols * stride_slot_col).to(tl.int64)
    k = _load_tile(k_head_ptr + slots[:, None] * stride_k_slot + dims[None, :], col_ok, dims, MASKED, HEAD_DIM, BLOCK_D)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        new = cols - num_cached  # index among the new tokens; < 0 for cached keys
        if HAS_TREE:
            shift = tl.minimum(tl.maximum(new, 0), 63).to(tl.int64)
            sees_new = ((tree[:, None] >> shift[None, :]) & 1) != 0  # bit 63 is the sign bit: & 1 after the shift
        else:
            sees_new = new[None, :] <= tok[:, None]
        allowed = col_ok[None, :] & ((new < 0)[None, :] | sees_new)
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_head_ptr + slots[:, None] * stride_v_slot + dims[None, :], col_ok, dims, MASKED, HEAD_DIM, BLOCK_D)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attention_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    out_ptr,  # [T, num_heads, head_dim], written when SPLIT is False
    part_out_ptr,  # [T, num_heads, num_splits, head_dim] fp32, written when SPLIT
    part_lse_ptr,  # [T, num_heads, num_splits] fp32 (base 2), written when SPLIT
    seq_rows_ptr, kv_lens_ptr, qo_indptr_ptr, slot_table_ptr, tree_mask_ptr,
    qk_scale, num_splits, keys_per_split, num_heads,
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_slot_row, stride_slot_col,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    # axis 0 varies fastest, so the row blocks and splits of one (sequence, kv head) run side by
    # side and share its K/V through L2
    m_block = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(qo_indptr_ptr + seq)
    q_len = tl.load(qo_indptr_ptr + seq + 1) - q_start
    m_start = m_block * BLOCK_M
    if m_start >= q_len * GROUP:  # the grid is sized for max_q_len; this sequence is shorter
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    num_cached = kv_len - q_len
    if HAS_TREE:
        # tree bits may name any new token, so every block reads up to kv_len (at most 64 extra keys)
        kv_end = kv_len
    else:
        # causal: nothing past the block's last new token
        last_tok = tl.minimum((m_start + BLOCK_M - 1) // GROUP, q_len - 1)
        kv_end = num_cached + last_tok + 1
    # This split's keys [lo, hi): whole BLOCK_N tiles, sized from the real kv_len read here, so a
    # graph captured for an upper-bound max_kv_len still spreads the real keys over all splits;
    # or, batch-invariant, a fixed number of keys, so a query's splits depend on its position alone.
    if keys_per_split > 0:
        chunk = keys_per_split
    else:
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    rows = m_start + tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # [BLOCK_M] index among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = tok < q_len
    q_rows = (q_start + tok).to(tl.int64)  # [BLOCK_M] row in q / out
    if SPLIT:
        if lo >= kv_end:  # past this block's keys (fixed splits up to a graph's bound): decided before any
            # load, as most of a batch-invariant step's programs are (the merge skips the split)
            part = (q_rows * num_heads + head) * num_splits + split
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return
    slot_row_ptr = slot_table_ptr + tl.load(seq_rows_ptr + seq).to(tl.int64) * stride_slot_row
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                   row_ok, dims, True, HEAD_DIM, BLOCK_D)
    if HAS_TREE:
        tree = tl.load(tree_mask_ptr + q_rows, mask=row_ok, other=0)
    else:
        tree = tok  # unused
    # whole tiles before `mid` lie in the cached prefix: no mask needed there. Batch-invariant:
    # every tile masked, since where the cached prefix ends depends on the step (a decode step
    # caches all but its token, a verify step only the root), and with the unmasked tiles the
    # two kinds of step came out in other bits (bench/coupled_divergence.py; commit da467b5)
    if keys_per_split > 0:
        mid = lo
    else:
        mid = lo + tl.maximum(tl.minimum(hi, num_cached) - lo, 0) // BLOCK_N * BLOCK_N

    k_head_ptr = k_cache_ptr + kv_head * stride_k_head
    v_head_ptr = v_cache_ptr + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, start, hi, num_cached, slot_row_ptr, stride_slot_col,
            k_head_ptr, v_head_ptr, stride_k_slot, stride_v_slot, tok, tree, qk_scale, dims,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_TREE, DOT_PRECISION)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, start, hi, num_cached, slot_row_ptr, stride_slot_col,
            k_head_ptr, v_head_ptr, stride_k_slot, stride_v_slot, tok, tree, qk_scale, dims,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_TREE, DOT_PRECISION)

    # l_i == 0 only for a split with no keys (or a malformed mask): output 0 there, never NaN
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        part = (q_rows * num_heads + head) * num_splits + split  # [BLOCK_M] row in the partials
        _store_tile(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, row_ok, dims, HEAD_DIM, BLOCK_D)
        tl.store(part_lse_ptr + part, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok)
    else:
        _store_tile(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                    o.to(out_ptr.dtype.element_ty), row_ok, dims, HEAD_DIM, BLOCK_D)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [T, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [T, num_heads, num_splits] fp32, base 2; -inf for a split that saw no key
    out_ptr,  # [T, num_heads, head_dim]
    num_splits, num_heads, stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait_for_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    first = (tok * num_heads + head) * num_splits
    lses = tl.load(part_lse_ptr + first + splits, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lses, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    used = tl.max(tl.where(lses > float("-inf"), splits + 1, 0), 0)  # past the last split with keys: nothing
    # one split after another, skipping the empty ones: the sum's order does not depend on how
    # many splits the step has, so a batch-invariant step merges a query's splits alike in any step
    total = 0.0
    merged = tl.zeros([BLOCK_D], tl.float32)
    for split in range(used):
        lse = tl.load(part_lse_ptr + first + split)
        if lse > float("-inf"):
            weight = tl.exp2(lse - lse_max)
            o = tl.load(part_out_ptr + (first + split) * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0)
            merged += o * weight
            total += weight
    merged = merged / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    out = out_ptr + tok * stride_o_tok + head * stride_o_head + dims
    if BLOCK_D == HEAD_DIM:
        tl.store(out, merged.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class LaunchConfig:
    """Host-side choices for one (step, layer shape): everything a launch needs but pointers."""

    group: int
    block_m: int
    block_n: int
    num_m_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int


class TritonAttention:
    """Triton backend of the `AttentionBackend` protocol (kernels/attention.py).

    plan(meta) does host work only: it reads the host ints of `meta` (num_seqs, max_q_len,
    max_kv_len, whether tree_mask is set) and never a device value, and launches nothing.
    forward(...) launches the kernels of the module docstring; it never syncs with the host,
    so it can be captured in a CUDA graph.

    CUDA graphs. Grids come from host ints only: num_seqs and T from tensor shapes, row blocks
    from max_q_len, the number of KV splits from max_q_len, max_kv_len and the SM count. The
    kernels read seq_rows, kv_lens, qo_indptr, slot_table, out_slots and tree_mask on the
    device and mask by the real lengths. So, to capture:
      1. build the metadata tensors once for the padded batch size (static storage), with
         max_q_len the per-sequence query bound of the graph and max_kv_len an upper bound
         fixed for the graph (e.g. the longest context it serves);
      2. call plan(meta) and capture forward() for every layer;
      3. before each replay, write the real values into those same tensors in place (copy_,
         never rebinding), keeping num_seqs, T, max_q_len, max_kv_len and tree_mask-or-None
         as captured. Any real values with q_len <= max_q_len and q_len <= kv_len <= max_kv_len
         are served, and the keys are spread over the captured splits by the real kv_len.
    Padding: every one of the T token rows has its K/V written at its out_slot, so padding
    tokens must point at a scratch slot. Padding sequences may then have either
    q_len = kv_len = 0 (no attention program does any work for them; output rows that belong
    to no sequence, from qo_indptr[num_seqs] on, are left unwritten), or q_len = kv_len = 1
    with their slot-table row's first entry at the scratch slot (their output rows hold finite
    garbage). Scratch buffers are allocated inside forward(), so under capture they come from
    the graph's private pool and stay valid for every replay; pass `out=` to write into a
    static output buffer instead of a fresh one.

    `num_splits` pins the KV split count (tests use it); by default plan() picks it so that
    num_seqs * num_kv_heads * row_blocks * splits gives about PROGRAMS_PER_SM programs per SM.

    `batch_invariant`: a query's output is the same bits in any step, whatever else the step holds
    (a decode step, a draft tree's verify, a prefill chunk): blocks of 16 rows (a prefill's 32, each
    half laid out as a 16-row block), and keys split every INVARIANT_KEYS_PER_SPLIT from the first,
    merged in key order. Coupled sampling needs it: its
    later rollout verifies as trees the tokens its earlier one decoded a row at a time.
    """

    def __init__(self, num_splits: int | None = None, batch_invariant: bool = False) -> None:
        if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
        if num_splits is not None and batch_invariant:
            raise ValueError("a batch-invariant backend splits the keys by position; num_splits cannot be pinned")
        self._forced_splits = num_splits
        self.batch_invariant = batch_invariant
        self._meta_bounds: tuple[int, int, int, bool] | None = None  # num_seqs, max_q_len, max_kv_len, has_tree
        self._configs: dict[tuple, LaunchConfig] = {}

    def plan(self, meta: AttentionMetadata) -> None:
        if meta.max_q_len > DECODE_MAX_Q_LEN and meta.tree_mask is not None:
            raise ValueError(f"tree_mask covers at most {MAX_TREE_TOKENS} new tokens per sequence, got max_q_len={meta.max_q_len}")
        self._meta_bounds = (meta.num_seqs, meta.max_q_len, meta.max_kv_len, meta.tree_mask is not None)
        self._configs.clear()

    def launch_config(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> LaunchConfig:
        """The launch choices of the planned step for one layer shape (cached until the next plan)."""
        if self._meta_bounds is None:
            raise RuntimeError("TritonAttention.forward called before plan(meta)")
        key = (num_heads, num_kv_heads, head_dim, dtype, device)
        config = self._configs.get(key)
        if config is None:
            config = self._choose_config(num_heads, num_kv_heads, head_dim, dtype, device)
            self._configs[key] = config
        return config

    def _choose_config(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> LaunchConfig:
        num_seqs, max_q_len, max_kv_len, _ = self._meta_bounds
        group = num_heads // num_kv_heads
        rows = max(max_q_len, 1) * group  # query rows of one (sequence, kv head)
        block_d = triton.next_power_of_2(head_dim)
        if max_q_len <= DECODE_MAX_Q_LEN or self.batch_invariant:
            # decode / verify: blocks of 16 rows (tl.dot's least). Most sequences of a verify step
            # have their root alone (GROUP rows), and a block sized for the widest tree made each
            # of them pay for its rows: 27% more attention for 12% more rows at 512 sequences
            # (RESULTS at commit c294012). A tree's further blocks re-read its K/V; they run beside each
            # other on axis 0, so mostly from L2 (not profiled).
            block_m = 16
            if self.batch_invariant and max_q_len > DECODE_MAX_Q_LEN and dtype != torch.float32 and block_d <= 128:
                # a batch-invariant prefill in blocks of 32 rows, still 4 warps: Triton lays each 16-row
                # half out as a 16-row block (its warps along the keys), so every row keeps the bits
                # a decode step gives it, and a key tile is read once per 32 rows: the 8B shape's 4 x 1k
                # prefill 353 -> 275 us on an H200, where 64 rows or 8 warps changed the bits
                # (bench/probes/invariant_prefill_rows.py)
                block_m = 32
            # 128-key tiles, not 64: rl's tail (96 rows of 1-2k keys) 1.42x alone, the invariant
            # kernel 1.65x; rl 1.11x, the 8B shape b64 1.04x (bench/results/session-20261130f/); as two 64-key splits
            # did alone, more bytes in flight a program, where the tail ran at half the bandwidth.
            # The same in both kernels, so the invariant one's tiles never depend on the batch.
            block_n = 128 if block_d <= 128 else 32
            # three stages where a tile is small (heads of 64, 32 KiB of K/V a stage): rl 1.03x, its
            # tail 1.09x alone; not at heads of 128 (0.97x alone), nor in the invariant kernel,
            # whose 512 rows of 300-600 keys took 1.09x longer (bench/results/session-20261130g/)
            num_stages = 3 if block_d <= 64 and not self.batch_invariant else 2
        else:
            block_m = 128 if block_d <= 128 else 64
            block_n = 64 if block_d <= 128 else 32
            num_stages = 2
        if dtype == torch.float32:
            # fp32 (tests) through 3xTF32 needs ~2.5x the shared memory of bf16: the bf16 tiles
            # would ask for 256 KiB at head_dim 128, over the H100's 227 KiB
            block_m, block_n, num_stages = min(block_m, 64), 32, 1
        # the fp32 accumulator is block_m x block_d: from 64 x 128 on, 4 warps need ~240+ registers
        # a thread and spill (seen in sm_90 compiles), so use 8
        num_warps = 8 if block_m * block_d >= 64 * 128 else 4
        num_m_blocks = triton.cdiv(rows, block_m)
        if self.batch_invariant:
            num_splits = triton.cdiv(max(max_kv_len, 1), INVARIANT_KEYS_PER_SPLIT)
        elif self._forced_splits is not None:
            num_splits = self._forced_splits
        else:
            programs = num_seqs * num_kv_heads * num_m_blocks
            wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count(device), max(programs, 1))
            num_splits = max(1, min(wanted, triton.cdiv(max_kv_len, MIN_KEYS_PER_SPLIT), MAX_SPLITS))
        return LaunchConfig(group, block_m, block_n, num_m_blocks, num_splits, num_warps, num_stages)

    def _alloc_partials(self, num_tokens: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device):
        """Split-KV scratch: per-split normalised outputs and their base-2 log-sum-exp."""
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
        return part_out, part_lse

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim], q's dtype; allocated when None
    ) -> torch.Tensor:
        """Write this step's K/V at meta.out_slots, then attend (`attend`)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or k.shape[1:] != k_cache.shape[1:]:
            raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, k_cache {tuple(k_cache.shape)}")
        for name, t in (("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)}); call .contiguous()")
        if meta.out_slots.shape[0] != num_tokens:
            raise ValueError(f"meta.out_slots has {meta.out_slots.shape[0]} slots for {num_tokens} new tokens")
        if num_tokens:
            _store_kv_kernel[(num_tokens,)](
                k, v, k_cache, v_cache, meta.out_slots,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
                **pdl.launch_args(),
            )
        return self.attend(q, k_cache, v_cache, meta, scale, out)

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], this step's K/V already written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)}); call .contiguous()")
        config = self.launch_config(num_heads, num_kv_heads, head_dim, q.dtype, q.device)
        if out is None:
            out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        elif out.shape != q.shape or out.stride(-1) != 1:
            raise ValueError(f"out must have q's shape {tuple(q.shape)} and be contiguous in head_dim")
        if num_tokens == 0:
            return out
        block_d = triton.next_power_of_2(head_dim)

        # A batch-invariant step whose keys fit one split writes its rows directly: merging one
        # split, or one beside empty ones, multiplies by exp2(0) = 1 and divides by 1, so a row has
        # the same bits either way (and a prefill of 1k-token prompts skips the merge's pass)
        split = config.num_splits > 1
        if split:
            part_out, part_lse = self._alloc_partials(num_tokens, num_heads, config.num_splits, head_dim, q.device)
        else:
            part_out, part_lse = out, out  # not touched when SPLIT is False
        tree_mask = meta.tree_mask if meta.tree_mask is not None else meta.out_slots  # dummy pointer when causal
        grid = (config.num_m_blocks * config.num_splits, num_kv_heads, meta.num_seqs)
        _attention_kernel[grid](
            q, k_cache, v_cache, out, part_out, part_lse,
            meta.seq_rows, meta.kv_lens, meta.qo_indptr, meta.slot_table, tree_mask,
            scale * LOG2E, config.num_splits, INVARIANT_KEYS_PER_SPLIT if self.batch_invariant else 0, num_heads,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            out.stride(0), out.stride(1),
            meta.slot_table.stride(0), meta.slot_table.stride(1),
            GROUP=config.group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            HAS_TREE=meta.tree_mask is not None, SPLIT=split,
            # fp32 inputs: plain tf32 would cost ~1e-3 relative error; 3xTF32 keeps ~fp32 accuracy on tensor cores
            DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(),
        )
        if split:
            _merge_splits_kernel[(num_tokens, num_heads)](
                part_out, part_lse, out, config.num_splits, num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(config.num_splits),
                **pdl.launch_args(),
            )
        return out
