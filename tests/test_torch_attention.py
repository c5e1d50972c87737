"""The reference attention against a per-query loop, on random paged layouts and trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.torch_attention import TorchAttention


def random_tree_masks(q_len: int, rng: np.random.Generator) -> np.ndarray:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, q_len)]
    masks = np.zeros(q_len, dtype=np.int64)
    for i in range(q_len):
        node, bits = i, 0
        while node >= 0:
            bits |= 1 << node
            node = parents[node]
        masks[i] = np.array(bits, dtype=np.uint64).astype(np.int64)
    return masks


def build_case(seed: int, tree: bool):
    rng = np.random.default_rng(seed)
    num_seqs, heads, kv_heads, dim, num_slots = 5, 4, 2, 16, 4096
    q_lens = rng.integers(1, 64 if tree else 30, num_seqs)
    cached = rng.integers(0, 50, num_seqs)
    slot_table = np.zeros((num_seqs, 200), dtype=np.int32)
    free = rng.permutation(np.arange(1, num_slots))
    out_slots, masks, used = [], [], 0
    for b in range(num_seqs):
        n = cached[b] + q_lens[b]
        slot_table[b, :n] = free[used : used + n]
        if b > 0 and cached[b] and cached[0]:  # share a prefix with sequence 0, as n samples do
            share = min(cached[b], cached[0])
            slot_table[b, :share] = slot_table[0, :share]
        used += n
        out_slots.append(slot_table[b, cached[b] : n])
        masks.append(random_tree_masks(q_lens[b], rng) if tree else None)
    total = int(q_lens.sum())
    meta = AttentionMetadata(
        seq_rows=torch.arange(num_seqs, dtype=torch.int32),
        kv_lens=torch.tensor(cached + q_lens, dtype=torch.int32),
        qo_indptr=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32),
        slot_table=torch.from_numpy(slot_table),
        out_slots=torch.from_numpy(np.concatenate(out_slots).astype(np.int64)),
        tree_mask=torch.from_numpy(np.concatenate(masks)) if tree else None,
        max_q_len=int(q_lens.max()),
        max_kv_len=int((cached + q_lens).max()),
    )
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    return meta, q, k, v, k_cache, v_cache, cached, q_lens


def loop_attention(meta, q, k_cache, v_cache, cached, q_lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(meta.num_seqs):
        start = int(meta.qo_indptr[b])
        slots = meta.slot_table[b, : int(meta.kv_lens[b])].long()
        keys = k_cache[slots].repeat_interleave(group, dim=1)
        values = v_cache[slots].repeat_interleave(group, dim=1)
        for i in range(q_lens[b]):
            t = start + i
            if meta.tree_mask is None:
                visible_new = [j <= i for j in range(q_lens[b])]
            else:
                bits = int(meta.tree_mask[t]) & (2**64 - 1)
                visible_new = [(bits >> j) & 1 == 1 for j in range(q_lens[b])]
            visible = torch.tensor([True] * int(cached[b]) + visible_new)
            scores = torch.einsum("hd,khd->hk", q[t], keys) * scale
            scores[:, ~visible] = float("-inf")
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out


def test_reference_attention_matches_per_query_loop_causal_and_tree():
    for seed, tree in [(0, False), (1, True), (2, True), (3, False)]:
        meta, q, k, v, k_cache, v_cache, cached, q_lens = build_case(seed, tree)
        backend = TorchAttention()
        backend.plan(meta)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=0.25)
        assert torch.equal(k_cache[meta.out_slots], k) and torch.equal(v_cache[meta.out_slots], v)
        expected = loop_attention(meta, q, k_cache, v_cache, cached, q_lens, 0.25)
        assert torch.allclose(out, expected, atol=1e-5), (seed, tree)


def test_a_bound_below_a_sequences_keys_is_an_error():
    """The reference pads every row to `max_kv_len`; a bound too low would drop keys silently."""
    meta, *_ = build_case(4, tree=True)
    meta.max_kv_len -= 1
    with pytest.raises(ValueError, match="exceed the step's bound"):
        TorchAttention().plan(meta)
