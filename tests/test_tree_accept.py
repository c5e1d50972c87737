"""The accept walk of decode and verify steps (kernels/tree_accept.py), on fresh random trees in the
step's uniform layout, padding nodes and padding sequences included: the torch reference (the CPU
path, in CI) and the Triton kernel, each against a plain walk written from the definition.

The kernel runs on the GPU (`pytest -m gpu tests/test_tree_accept.py`) or, without one, under
Triton's interpreter (`TRITON_INTERPRET=1 pytest -o addopts='' tests/test_tree_accept.py`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kernels import fused, tree_accept
from kernels.ngram_draft import PADDING

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
kernel_runs = pytest.mark.skipif(
    fused.triton is None or not (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the kernel needs a CUDA GPU or TRITON_INTERPRET=1",
)
SHAPES = [(1, 1, 0), (13, 9, 3), (40, 64, 5)]  # sequences, nodes per tree, padding sequences
CAPACITY = 200


def random_step(rng: np.random.Generator, num_seqs: int, nodes: int, pad_seqs: int):
    """Random trees (real nodes, then padding) with draws that follow a child 70% of the time; the
    first tree is a whole chain, all accepted (the deepest path there can be)."""
    s = num_seqs + pad_seqs
    tok = np.zeros((s, nodes), np.int64)
    par = np.full((s, nodes), PADDING, np.int64)
    dep = np.ones((s, nodes), np.int64)
    anc = np.array([1 | (1 << j) for j in range(nodes)], dtype=np.uint64)[None].repeat(s, 0).view(np.int64)
    drawn = rng.integers(50, size=(s, nodes))
    par[:, 0], dep[:, 0], anc[:, 0] = -1, 0, 1
    tok[:, 0] = rng.integers(1000, size=s)
    for i in range(num_seqs):
        real = nodes if i == 0 else int(rng.integers(1, nodes + 1))
        bits = [1]
        for j in range(1, real):
            p = j - 1 if i == 0 else int(rng.integers(j))
            taken = {int(tok[i, k]) for k in range(1, j) if par[i, k] == p}  # siblings carry distinct tokens
            tok[i, j] = next(t for t in rng.permutation(50).tolist() if t not in taken)
            par[i, j], dep[i, j] = p, dep[i, p] + 1
            bits.append(bits[p] | (1 << j))
        anc[i, :real] = np.array(bits, dtype=np.uint64).view(np.int64)
        for j in range(real):
            kids = [k for k in range(1, real) if par[i, k] == j]
            if kids and (i == 0 or rng.random() < 0.7):
                drawn[i, j] = tok[i, kids[int(rng.integers(len(kids)))]]
    return tok, par, dep, anc, drawn


def plain_walk(tok, par, drawn, i) -> list[int]:
    path = [0]
    while (nxt := next((k for k in range(len(par[i])) if par[i, k] == path[-1] and tok[i, k] == drawn[i, path[-1]]), None)) is not None:
        path.append(nxt)
    return path


def check(accept, num_seqs: int, nodes: int, pad_seqs: int) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh trees every run; the seed names a failing one
    rng = np.random.default_rng(seed)
    tok, par, dep, anc, drawn = random_step(rng, num_seqs, nodes, pad_seqs)
    s = num_seqs + pad_seqs
    padding_row = num_seqs + 2
    rows = np.concatenate([rng.permutation(padding_row)[:num_seqs], np.full(pad_seqs, padding_row)])
    lengths = np.zeros(padding_row + 1, np.int32)
    lengths[rows[:num_seqs]] = rng.integers(2, CAPACITY - 2 * nodes, size=num_seqs)
    slots = rng.permutation(np.arange(1, 10 * s * nodes + 2))[: s * nodes].reshape(s, nodes)
    slots[num_seqs:] = 0
    slot_table = rng.integers(1, 10_000, size=(padding_row + 1, CAPACITY)).astype(np.int32)
    slot_table[padding_row] = 0
    token_table = rng.integers(0, 1000, size=(padding_row + 1, CAPACITY)).astype(np.int32)
    lps = rng.standard_normal((s, nodes)).astype(np.float32)
    want_slots, want_tokens, want_lengths = slot_table.copy(), token_table.copy(), lengths.copy()
    paths = [plain_walk(tok, par, drawn, i) for i in range(s)]
    for i in range(num_seqs):
        r, kv = rows[i], lengths[rows[i]] - 1
        want_slots[r, kv : kv + len(paths[i])] = slots[i, paths[i]]
        want_tokens[r, kv + 1 : kv + 1 + len(paths[i])] = drawn[i, paths[i]]
        want_lengths[r] += len(paths[i])
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)  # noqa: E731
    st, tt, tl = t(slot_table), t(token_table), t(lengths)
    out_tok, out_lp, length, bits = accept(t(par), t(anc), t(dep), t(tok), t(drawn), t(lps), t(rows.astype(np.int32)),
                                           t(slots), st, tt, tl, padding_row)
    assert length.tolist() == [len(p) for p in paths], seed
    assert [b % 2**64 for b in bits.tolist()] == [sum(1 << j for j in p) for p in paths], seed  # (bit 63: the sign)
    for i, p in enumerate(paths):
        assert out_tok[i, : len(p)].tolist() == drawn[i, p].tolist(), seed
        assert out_lp[i, : len(p)].tolist() == lps[i, p].tolist(), seed
    assert np.array_equal(st.cpu().numpy(), want_slots), seed
    assert np.array_equal(tt.cpu().numpy(), want_tokens), seed
    assert np.array_equal(tl.cpu().numpy(), want_lengths), seed
    assert len(paths[0]) == nodes  # the whole chain was accepted


@pytest.mark.parametrize("num_seqs,nodes,pad_seqs", SHAPES)
def test_the_torch_walk_matches_a_plain_walk(num_seqs, nodes, pad_seqs):
    check(tree_accept.accept_trees_ref, num_seqs, nodes, pad_seqs)


@kernel_runs
@pytest.mark.parametrize("num_seqs,nodes,pad_seqs", SHAPES)
def test_the_kernel_matches_a_plain_walk(num_seqs, nodes, pad_seqs):
    check(tree_accept._accept_triton, num_seqs, nodes, pad_seqs)
