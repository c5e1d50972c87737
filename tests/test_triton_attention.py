"""The Triton attention backend held to the torch reference on random paged layouts and trees.

Tests marked `gpu` use real shapes and run on the H100 (`pytest -m gpu`). The unmarked ones use
small shapes and run on CUDA when there is a GPU, otherwise on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1 pytest -o addopts='' tests/test_triton_attention.py`; set in the
environment, not here: a variable set by a test module would reach every server the suite
starts after it). CI has no triton, so the whole module is skipped there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import triton_kernels  # noqa: F401  (skips the module without triton, or without a GPU or the interpreter)

from kernels.attention import MAX_TREE_TOKENS, AttentionMetadata  # noqa: E402
from kernels.torch_attention import TorchAttention  # noqa: E402
from kernels import triton_attention  # noqa: E402
from kernels.triton_attention import TritonAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tree_masks(parents: list[int]) -> np.ndarray:
    """Ancestor bitmask of each node (itself included), as int64 (bit 63 is the sign bit)."""
    masks = np.zeros(len(parents), dtype=np.int64)
    for i in range(len(parents)):
        node, bits = i, 0
        while node >= 0:
            bits |= 1 << node
            node = parents[node]
        masks[i] = np.array(bits, dtype=np.uint64).astype(np.int64)
    return masks


def random_parents(q_len: int, shape: str, rng: np.random.Generator) -> list[int]:
    if shape == "chain":  # deepest: every node under the previous one
        return list(range(-1, q_len - 1))
    if shape == "star":  # widest: every node under the root
        return [-1] + [0] * (q_len - 1)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, q_len)]


@dataclass
class Case:
    meta: AttentionMetadata
    q: torch.Tensor  # [T, heads, dim]
    k: torch.Tensor  # [T, kv_heads, dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_slots, kv_heads, dim]
    v_cache: torch.Tensor
    scale: float


def make_case(
    q_lens,
    cached,
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
    tree: str | None = None,  # None: causal; "random" | "chain" | "star"
    share_prefix: bool = True,
    device: torch.device = DEVICE,
) -> Case:
    """Sequences with `cached[b]` cached tokens and `q_lens[b]` new ones, on shuffled slots, in
    shuffled slot-table rows; with share_prefix, some sequences reuse another's prompt slots."""
    rng = np.random.default_rng(seed)
    q_lens, cached = np.asarray(q_lens, dtype=np.int64), np.asarray(cached, dtype=np.int64)
    num_seqs = len(q_lens)
    kv_lens = cached + q_lens
    num_slots = int(kv_lens.sum()) + 17  # a few slots no sequence uses
    free = rng.permutation(num_slots)
    num_rows = num_seqs + 3
    rows = rng.permutation(num_rows)[:num_seqs]
    # entries past kv_len are far out of range: a kernel that reads them faults
    slot_table = np.full((num_rows, int(kv_lens.max()) + 5), num_slots * 1000, dtype=np.int32)
    used, out_slots, masks = 0, [], []
    for b in range(num_seqs):
        n = int(kv_lens[b])
        slot_table[rows[b], :n] = free[used : used + n]
        used += n
        if share_prefix and b > 0 and cached[b] > 0 and rng.random() < 0.5:
            other = int(rng.integers(0, b))
            share = int(min(cached[b], cached[other]))  # only cached slots are shared, as n samples of one prompt
            slot_table[rows[b], :share] = slot_table[rows[other], :share]
        out_slots.append(slot_table[rows[b], cached[b] : n])
        if tree is not None:
            masks.append(tree_masks(random_parents(int(q_lens[b]), tree, rng)))
    meta = AttentionMetadata(
        seq_rows=torch.tensor(rows, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        qo_indptr=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device),
        slot_table=torch.from_numpy(slot_table).to(device),
        out_slots=torch.from_numpy(np.concatenate(out_slots).astype(np.int64)).to(device),
        tree_mask=torch.from_numpy(np.concatenate(masks)).to(device) if tree is not None else None,
        max_q_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
    )
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = int(q_lens.sum())

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    return Case(
        meta=meta,
        q=randn(total, heads, dim, scale=2.0),  # peakier softmax than unit queries
        k=randn(total, kv_heads, dim),
        v=randn(total, kv_heads, dim),
        k_cache=randn(num_slots, kv_heads, dim),
        v_cache=randn(num_slots, kv_heads, dim),
        scale=dim**-0.5,
    )


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 reference output and caches after the write, from the same (rounded) inputs."""
    k_cache, v_cache = case.k_cache.float().clone(), case.v_cache.float().clone()
    backend = TorchAttention()
    backend.plan(case.meta)
    out = backend.forward(case.q.float(), case.k.float(), case.v.float(), k_cache, v_cache, case.meta, case.scale)
    return out, k_cache, v_cache


def poison_partials(backend: TritonAttention) -> None:
    """Split-KV scratch starts as NaN, so a split that forgets to write its partial shows."""
    alloc = backend._alloc_partials

    def poisoned(*args, **kwargs):
        part_out, part_lse = alloc(*args, **kwargs)
        return part_out.fill_(float("nan")), part_lse.fill_(float("nan"))

    backend._alloc_partials = poisoned


def run_triton(case: Case, num_splits: int | None = None, batch_invariant: bool = False) -> tuple[torch.Tensor, TritonAttention]:
    backend = TritonAttention(num_splits=num_splits, batch_invariant=batch_invariant)
    poison_partials(backend)
    backend.plan(case.meta)
    out = torch.full_like(case.q, float("nan"))  # every element must be written
    result = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    assert result.data_ptr() == out.data_ptr()
    return out, backend


def rel_err_per_seq(out: torch.Tensor, ref: torch.Tensor, meta: AttentionMetadata) -> list[float]:
    qo = meta.qo_indptr.tolist()
    errs = []
    for b in range(meta.num_seqs):
        o, r = out[qo[b] : qo[b + 1]].float(), ref[qo[b] : qo[b + 1]]
        errs.append(float((o - r).norm() / r.norm().clamp_min(1e-6)))
    return errs


def check(case: Case, num_splits: int | None = None, batch_invariant: bool = False) -> TritonAttention:
    ref_out, ref_k_cache, ref_v_cache = reference(case)
    out, backend = run_triton(case, num_splits, batch_invariant)
    assert not out.isnan().any(), "some output elements were never written (or came out NaN)"
    # the write touches exactly the out_slots, with the same values as the reference
    assert torch.equal(case.k_cache.float(), ref_k_cache) and torch.equal(case.v_cache.float(), ref_v_cache)
    errs = rel_err_per_seq(out, ref_out, case.meta)
    worst = int(np.argmax(errs))
    assert errs[worst] < TOLERANCE[case.q.dtype], (
        f"sequence {worst}: rel err {errs[worst]:.2e}, kv_len {int(case.meta.kv_lens[worst])}, "
        f"config {backend.launch_config(case.q.shape[1], case.k_cache.shape[1], case.q.shape[2], case.q.dtype, DEVICE)}"
    )
    return backend


def invariant_rows_alike(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, lengths: list[int], chain: int) -> None:
    """Batch-invariant backend: the last `chain` queries of sequence 0 come out the same bits decoded
    one at a time alone, decoded beside other sequences under a graph's upper-bound max_kv_len,
    verified together as a chain (a coupled sample's draft; its last 64 at most), or prefilled as a
    causal chunk (past 64 tokens in 32-row blocks), and near the reference. Sequence 0 is long enough
    for several fixed key splits."""
    gen = torch.Generator(device="cpu").manual_seed(sum(lengths) + heads)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)

    num_slots = sum(lengths) + 1
    k_cache, v_cache = randn(num_slots, kv_heads, dim), randn(num_slots, kv_heads, dim)
    slots = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    slot_table = torch.zeros(len(lengths), max(lengths), dtype=torch.int32)
    used = 0
    for seq, n in enumerate(lengths):
        slot_table[seq, :n] = slots[used : used + n]
        used += n
    slot_table = slot_table.to(DEVICE)
    queries = [randn(n, heads, dim, scale=2.0) for n in lengths]  # a query for every position
    backend = TritonAttention(batch_invariant=True)

    def chain_masks(counts: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([tree_masks(list(range(-1, c - 1))) for c in counts])).to(DEVICE)

    def step(rows: list[tuple[int, int, int]], tree: bool, max_kv_len: int | None = None) -> torch.Tensor:
        """(sequence, first position, count) per sequence; returns sequence 0's output rows."""
        kv_lens = [first + count for _, first, count in rows]
        meta = AttentionMetadata(
            seq_rows=torch.tensor([seq for seq, _, _ in rows], dtype=torch.int32, device=DEVICE),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
            qo_indptr=torch.tensor(np.concatenate([[0], np.cumsum([c for _, _, c in rows])]), dtype=torch.int32,
                                   device=DEVICE),
            slot_table=slot_table,
            out_slots=torch.cat([slot_table[seq, first : first + count].long() for seq, first, count in rows]),
            tree_mask=chain_masks([count for _, _, count in rows]) if tree else None,
            max_q_len=max(c for _, _, c in rows),
            max_kv_len=max_kv_len or max(kv_lens),
        )
        backend.plan(meta)
        q = torch.cat([queries[seq][first : first + count] for seq, first, count in rows])
        out = backend.attend(q, k_cache, v_cache, meta, dim**-0.5)
        at = [r[0] for r in rows].index(0)
        start = sum(c for _, _, c in rows[:at])
        return out[start : start + rows[at][2]]

    first, drafted = lengths[0] - chain, min(chain, MAX_TREE_TOKENS)
    verified = step([(1, lengths[1] - 3, 3), (0, lengths[0] - drafted, drafted), (2, lengths[2] - 1, 1)], tree=True)
    prefilled = step([(0, first, chain)], tree=False)
    assert backend.launch_config(heads, kv_heads, dim, dtype, DEVICE).block_m == (32 if chain > MAX_TREE_TOKENS else 16)
    for j in range(chain):
        alone = step([(0, first + j, 1)], tree=False)
        beside = step([(2, lengths[2] - 1, 1), (0, first + j, 1), (1, lengths[1] - 1, 1)], tree=False,
                      max_kv_len=max(lengths) + 700)
        assert torch.equal(alone[0], beside[0]), j
        assert torch.equal(alone[0], prefilled[j]), j
        if j >= chain - drafted:
            assert torch.equal(alone[0], verified[j - chain + drafted]), j
    ref = TorchAttention()
    meta = AttentionMetadata(
        seq_rows=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        kv_lens=torch.tensor([lengths[0]], dtype=torch.int32, device=DEVICE),
        qo_indptr=torch.tensor([0, chain], dtype=torch.int32, device=DEVICE), slot_table=slot_table,
        out_slots=slot_table[0, first:].long(), tree_mask=None, max_q_len=chain, max_kv_len=lengths[0])
    ref.plan(meta)
    expected = ref.attend(queries[0][first:].float(), k_cache.float(), v_cache.float(), meta, dim**-0.5)
    assert float((prefilled.float() - expected).norm() / expected.norm()) < TOLERANCE[dtype]


# ---------------------------------------------------------------------------------------------
# Small shapes: Triton's interpreter on the CPU (or the GPU when there is one).
# ---------------------------------------------------------------------------------------------

SMALL_HEADS = [(4, 4, 32), (6, 2, 32), (8, 2, 64)]  # GQA ratios 1, 3, 4
SMALL_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("heads,kv_heads,dim", SMALL_HEADS)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_small_decode_matches_reference(heads, kv_heads, dim, dtype):
    rng = np.random.default_rng(0)
    cached = np.concatenate([[0, 1, 129], rng.integers(0, 200, 4)])  # kv_len 1 included
    check(make_case([1] * len(cached), cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=1))


@pytest.mark.parametrize("tree", ["random", "chain", "star"])
@pytest.mark.parametrize("heads,kv_heads,dim", SMALL_HEADS[1:])
def test_small_tree_verify_matches_reference(tree, heads, kv_heads, dim):
    q_lens = [64, 1, 13, 33]  # a 64-token chain sets bit 63 (the sign bit)
    cached = [70, 0, 5, 131]
    case = make_case(q_lens, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=torch.float32, seed=2, tree=tree)
    check(case)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_small_causal_extend_with_cached_prefix_matches_reference(dtype, num_splits):
    # prefill from nothing, extend after a prefix, and decode rows in the same batch
    q_lens, cached = [150, 77, 1, 3, 65], [0, 93, 40, 0, 1]
    case = make_case(q_lens, cached, heads=6, kv_heads=2, dim=32, dtype=dtype, seed=3)
    backend = check(case, num_splits=num_splits)
    assert backend.launch_config(6, 2, 32, dtype, DEVICE).num_m_blocks > 1


@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("tree", [None, "random"])
def test_small_forced_splits_match_reference(num_splits, tree):
    # kv lengths from 1 to a few hundred: with 7 splits the short sequences leave most splits empty
    q_lens, cached = [5, 1, 17, 2], [300, 0, 45, 190]
    case = make_case(q_lens, cached, heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=4, tree=tree)
    backend = check(case, num_splits=num_splits)
    assert backend.launch_config(8, 2, 32, torch.float32, DEVICE).num_splits == num_splits


@pytest.mark.parametrize("tree", [None, "random"])
def test_small_batch_invariant_splits_match_reference(tree, monkeypatch):
    """Fixed key splits of 64 (2,048 in steps), rows of one split and of several beside each other in one
    step, against the reference."""
    monkeypatch.setattr(triton_attention, "INVARIANT_KEYS_PER_SPLIT", 64)
    case = make_case([1, 3, 1, 4, 2], [20, 61, 150, 0, 200], heads=6, kv_heads=2, dim=32, dtype=torch.float32, seed=23,
                     tree=tree)
    backend = check(case, batch_invariant=True)
    assert backend.launch_config(6, 2, 32, torch.float32, DEVICE).num_splits == 4


def test_small_batch_invariant_rows_of_one_split_alike_written_directly_or_merged(monkeypatch):
    """Keys within one split (64 here, 2,048 in steps): a step whose every sequence fits writes its
    rows directly, and the same rows in a step of more splits (a graph's upper-bound max_kv_len)
    are merged from one split beside empty ones; the bits must not differ."""
    monkeypatch.setattr(triton_attention, "INVARIANT_KEYS_PER_SPLIT", 64)
    partials = []  # the split-KV scratch each step allocated: none without a merge
    alloc = TritonAttention._alloc_partials
    monkeypatch.setattr(TritonAttention, "_alloc_partials", lambda self, *a: partials.append(a) or alloc(self, *a))
    case = make_case([1, 5, 2], [30, 40, 62], heads=6, kv_heads=2, dim=32, dtype=torch.float16, seed=29)
    check(case, batch_invariant=True)
    direct, backend = run_triton(case, batch_invariant=True)
    assert backend.launch_config(6, 2, 32, torch.float16, DEVICE).num_splits == 1 and not partials
    case.meta.max_kv_len = 200
    merged, backend = run_triton(case, batch_invariant=True)
    assert backend.launch_config(6, 2, 32, torch.float16, DEVICE).num_splits == 4
    assert torch.equal(direct, merged)


def test_small_head_dim_not_power_of_two():
    case = make_case([1, 9, 3], [40, 70, 0], heads=4, kv_heads=2, dim=48, dtype=torch.float32, seed=5, tree="random")
    check(case, num_splits=2)


def test_long_context_batch_one_is_split_across_programs():
    backend = TritonAttention()
    case = make_case([1], [4095], heads=8, kv_heads=2, dim=32, dtype=torch.float32, seed=6)
    backend.plan(case.meta)
    assert backend.launch_config(8, 2, 32, torch.float32, DEVICE).num_splits > 1


@needs_cuda  # (the interpreter's tl.dot is numpy's matmul, whose float32 sums depend on a row's place in the block)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_small_batch_invariant_rows_alike_in_any_step(dtype, monkeypatch):
    monkeypatch.setattr(triton_attention, "INVARIANT_KEYS_PER_SPLIT", 512)  # (2,048 in steps)
    invariant_rows_alike(6, 2, 32, dtype, lengths=[1040, 40, 530], chain=24)  # across keys 1024: a tile, a split
    invariant_rows_alike(6, 2, 32, dtype, lengths=[1040, 40, 530], chain=90)  # a prefill: 32-row blocks


def test_small_batch_invariant_prefill_rows_in_blocks_of_32_only_where_they_keep_the_bits(monkeypatch):
    """The batch-invariant kernel takes a prefill (more than 64 new tokens) of 16-bit heads up to 128
    wide in 32-row blocks of 4 warps, which the H200 showed keep a 16-row block's bits; a verify step,
    float32 and wider heads keep 16 rows, whose bits no other block was shown to give."""
    def block(q_len: int, dim: int, dtype: torch.dtype) -> tuple[int, int]:
        backend = TritonAttention(batch_invariant=True)
        backend.plan(make_case([q_len], [40], heads=8, kv_heads=2, dim=dim, dtype=dtype, seed=3).meta)
        config = backend.launch_config(8, 2, dim, dtype, DEVICE)
        return config.block_m, config.num_warps

    assert block(65, 128, torch.bfloat16) == block(300, 64, torch.float16) == (32, 4)
    assert block(64, 128, torch.bfloat16) == block(65, 128, torch.float32) == block(65, 256, torch.bfloat16) == (16, 4)
    case = make_case([70, 97, 130], [0, 40, 5], heads=6, kv_heads=2, dim=32, dtype=torch.float16, seed=31)
    check(case, batch_invariant=True)


def test_plan_rejects_tree_longer_than_64_tokens():
    case = make_case([65], [0], heads=2, kv_heads=1, dim=16, dtype=torch.float32, seed=7)
    case.meta.tree_mask = torch.zeros(65, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="64"):
        TritonAttention().plan(case.meta)


# ---------------------------------------------------------------------------------------------
# Real shapes on the H100.
# ---------------------------------------------------------------------------------------------

GPU_HEADS = [(9, 3, 64), (32, 8, 128), (16, 16, 128), (12, 3, 64)]  # SmolLM2, Llama/Qwen3-8B, MHA, ratio 4
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_decode_37_sequences_mixed_lengths_matches_reference(heads, kv_heads, dim, dtype):
    rng = np.random.default_rng(10)
    cached = np.concatenate([[0, 2999, 1, 1023, 1024], rng.integers(0, 3000, 32)])  # kv_len 1..3000
    check(make_case([1] * 37, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=11))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tree", ["random", "chain", "star"])
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_tree_verify_37_sequences_matches_reference(tree, heads, kv_heads, dim, dtype):
    rng = np.random.default_rng(12)
    q_lens = np.concatenate([[64, 64, 1, 63], rng.integers(1, 65, 33)])
    cached = np.concatenate([[2936, 0, 1, 517], rng.integers(0, 2937, 33)])
    case = make_case(q_lens, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=13, tree=tree)
    check(case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_causal_verify_chains_match_reference(heads, kv_heads, dim, dtype):
    # linear drafts without a tree_mask: the causal path at decode sizes
    rng = np.random.default_rng(14)
    q_lens = np.concatenate([[64, 1, 7], rng.integers(1, 65, 34)])
    cached = rng.integers(0, 2937, 37)
    check(make_case(q_lens, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=15))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_chunked_prefill_mixed_with_decode_matches_reference(heads, kv_heads, dim, dtype):
    # full prefills, chunks after a cached prefix, and decode rows in one batch; odd lengths
    q_lens = [2049, 1, 777, 65, 1, 1500, 3]
    cached = [0, 2999, 1223, 0, 17, 1, 2000]
    check(make_case(q_lens, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=16))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_len", [4096, 4097, 333])
@pytest.mark.parametrize("tree", [None, "random"])
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS[:2])
def test_batch_one_long_context_split_kv_matches_reference(kv_len, tree, heads, kv_heads, dim):
    q_len = 1 if tree is None else 64
    case = make_case([q_len], [kv_len - q_len], heads=heads, kv_heads=kv_heads, dim=dim, dtype=torch.bfloat16,
                     seed=17, tree=tree)
    backend = check(case)
    if kv_len > 1000:
        assert backend.launch_config(heads, kv_heads, dim, torch.bfloat16, DEVICE).num_splits > 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS[:2])
def test_batch_invariant_rows_alike_in_any_step(heads, kv_heads, dim, monkeypatch):
    monkeypatch.setattr(triton_attention, "INVARIANT_KEYS_PER_SPLIT", 512)  # (2,048 in steps)
    invariant_rows_alike(heads, kv_heads, dim, torch.bfloat16, lengths=[1560, 70, 1500], chain=40)  # across 1536
    for dtype in (torch.bfloat16, torch.float16):  # a prefill: 32-row blocks
        invariant_rows_alike(heads, kv_heads, dim, dtype, lengths=[1560, 70, 1500], chain=100)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forced_splits_match_reference(num_splits, dtype):
    rng = np.random.default_rng(18)
    q_lens = rng.integers(1, 65, 37)
    cached = rng.integers(0, 2937, 37)
    case = make_case(q_lens, cached, heads=32, kv_heads=8, dim=128, dtype=dtype, seed=19, tree="random")
    check(case, num_splits=num_splits)


class GraphBuffers:
    """Static metadata for a captured graph: padded batch, fixed T, upper-bound max_kv_len."""

    def __init__(self, num_seqs, tokens_per_seq, max_kv_len, num_slots, heads, kv_heads, dim, dtype, tree):
        dev = DEVICE
        self.num_seqs, self.tokens, self.max_kv_len = num_seqs, num_seqs * tokens_per_seq, max_kv_len
        self.num_slots = num_slots
        self.scratch_slot = num_slots - 1  # padding tokens write here
        self.meta = AttentionMetadata(
            seq_rows=torch.zeros(num_seqs, dtype=torch.int32, device=dev),
            kv_lens=torch.ones(num_seqs, dtype=torch.int32, device=dev),
            qo_indptr=torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * tokens_per_seq,
            slot_table=torch.zeros(num_seqs + 1, max_kv_len, dtype=torch.int32, device=dev),
            out_slots=torch.full((self.tokens,), self.scratch_slot, dtype=torch.int64, device=dev),
            tree_mask=torch.ones(self.tokens, dtype=torch.int64, device=dev) if tree else None,
            max_q_len=tokens_per_seq,
            max_kv_len=max_kv_len,
        )
        self.q = torch.randn(self.tokens, heads, dim, device=dev).to(dtype)
        self.k = torch.randn(self.tokens, kv_heads, dim, device=dev).to(dtype)
        self.v = torch.randn(self.tokens, kv_heads, dim, device=dev).to(dtype)
        self.k_cache = torch.randn(num_slots, kv_heads, dim, device=dev).to(dtype)
        self.v_cache = torch.randn(num_slots, kv_heads, dim, device=dev).to(dtype)

    def load(self, case: Case, pad_with_empty_seqs: bool) -> None:
        """Copies a real case into the static buffers in place; pads the rest of the batch."""
        real = case.meta
        b, t = real.num_seqs, real.out_slots.shape[0]
        m = self.meta
        pad_row = m.slot_table.shape[0] - 1
        m.slot_table.zero_()
        m.slot_table[pad_row, 0] = self.scratch_slot
        m.seq_rows.fill_(pad_row)
        m.out_slots.fill_(self.scratch_slot)
        if pad_with_empty_seqs:  # padding sequences own no tokens; rows past qo_indptr[b] stay unwritten
            m.kv_lens.zero_()
            m.qo_indptr.fill_(t)
        else:  # padding sequences: one token each, reading and writing the scratch slot
            m.kv_lens.fill_(1)
            m.qo_indptr.copy_(torch.arange(self.num_seqs + 1, device=DEVICE, dtype=torch.int32) - b + t)
        rows = torch.arange(b, dtype=torch.int32, device=DEVICE)
        m.seq_rows[:b] = rows
        width = min(real.slot_table.shape[1], self.max_kv_len)
        m.slot_table[:b, :width] = real.slot_table[real.seq_rows.long(), :width]
        m.kv_lens[:b] = real.kv_lens
        m.qo_indptr[: b + 1] = real.qo_indptr
        m.out_slots[:t] = real.out_slots
        if m.tree_mask is not None:
            m.tree_mask.fill_(1)
            m.tree_mask[:t] = real.tree_mask
        for name in ("q", "k", "v"):
            getattr(self, name)[:t] = getattr(case, name)
        self.k_cache[: case.k_cache.shape[0]] = case.k_cache
        self.v_cache[: case.v_cache.shape[0]] = case.v_cache


def replay_padded_batches(*, use_graph, tree, tokens_per_seq, pad_with_empty_seqs, heads, kv_heads, dim, dtype,
                          max_kv_len, padded, rounds):
    """plan() once for a padded batch and an upper-bound max_kv_len; then, round after round, write
    new lengths, slots, trees and batch sizes into the same tensors in place and run again (a CUDA
    graph replay when use_graph, a plain forward otherwise); each round must match the reference."""
    bufs = GraphBuffers(padded, tokens_per_seq, max_kv_len, (padded + 1) * max_kv_len, heads, kv_heads, dim, dtype, tree)
    backend = TritonAttention()
    poison_partials(backend)
    backend.plan(bufs.meta)
    out = torch.empty_like(bufs.q)
    args = (bufs.q, bufs.k, bufs.v, bufs.k_cache, bufs.v_cache, bufs.meta, dim**-0.5)
    if use_graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            backend.forward(*args, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(*args, out=out)

    rng = np.random.default_rng(20)
    for round_, num_real in enumerate(rounds):
        if pad_with_empty_seqs:  # variable q lens, all real tokens packed at the front
            q_lens = rng.integers(1, tokens_per_seq + 1, num_real)
        else:
            q_lens = np.full(num_real, tokens_per_seq)
        cached = rng.integers(0, max_kv_len - tokens_per_seq + 1, num_real)
        cached[0] = max_kv_len - q_lens[0]  # one sequence right at the bound
        case = make_case(q_lens, cached, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, seed=100 + round_,
                         tree="random" if tree else None)
        assert case.k_cache.shape[0] < bufs.num_slots
        bufs.load(case, pad_with_empty_seqs)
        ref_case = Case(case.meta, case.q, case.k, case.v, bufs.k_cache[: case.k_cache.shape[0]].clone(),
                        bufs.v_cache[: case.v_cache.shape[0]].clone(), case.scale)
        ref_out, ref_k_cache, ref_v_cache = reference(ref_case)
        out.fill_(float("nan"))
        if use_graph:
            graph.replay()
            torch.cuda.synchronize()
        else:
            backend.forward(*args, out=out)
        t = case.meta.out_slots.shape[0]
        assert not out[:t].isnan().any(), round_
        assert torch.equal(bufs.k_cache[: ref_k_cache.shape[0]].float(), ref_k_cache)
        assert torch.equal(bufs.v_cache[: ref_v_cache.shape[0]].float(), ref_v_cache)
        errs = rel_err_per_seq(out[:t], ref_out, case.meta)
        assert max(errs) < TOLERANCE[dtype], (round_, max(errs))


PADDINGS = [(False, 1, False), (True, 16, True), (False, 8, True)]  # tree, tokens per seq, empty padding seqs


@pytest.mark.parametrize("tree,tokens_per_seq,pad_with_empty_seqs", PADDINGS)
def test_small_padded_batch_with_upper_bound_kv_len_follows_new_metadata(tree, tokens_per_seq, pad_with_empty_seqs):
    replay_padded_batches(use_graph=False, tree=tree, tokens_per_seq=tokens_per_seq,
                          pad_with_empty_seqs=pad_with_empty_seqs, heads=6, kv_heads=2, dim=32, dtype=torch.float32,
                          max_kv_len=300, padded=4, rounds=[4, 2, 1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tree,tokens_per_seq,pad_with_empty_seqs", PADDINGS)
@pytest.mark.parametrize("heads,kv_heads,dim", GPU_HEADS[:2])
def test_cuda_graph_replay_follows_new_metadata(tree, tokens_per_seq, pad_with_empty_seqs, heads, kv_heads, dim):
    """Captured once at a padded batch and an upper-bound max_kv_len; replays see new lengths,
    slots, trees and batch sizes written in place."""
    replay_padded_batches(use_graph=True, tree=tree, tokens_per_seq=tokens_per_seq,
                          pad_with_empty_seqs=pad_with_empty_seqs, heads=heads, kv_heads=kv_heads, dim=dim,
                          dtype=torch.bfloat16, max_kv_len=4096, padded=16, rounds=[16, 5, 1, 11])
