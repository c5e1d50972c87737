"""The verify step's tree walk on the device (kernels/tree_accept.py), on fresh random trees laid out
as a padded verify graph lays them out: the torch reference (the CPU path, in CI) and the Triton
kernel, each against the host walk of `spec.verify.accept_paths`.

The kernel runs on the H100 (`pytest -m gpu tests/test_tree_accept.py`) or, without a GPU, under
Triton's interpreter (`TRITON_INTERPRET=1 pytest -o addopts='' tests/test_tree_accept.py`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kernels import fused, tree_accept
from spec.tree import DraftTree
from spec.verify import accept_paths

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.gpu if ON_GPU else []
kernel_runs = pytest.mark.skipif(
    fused.triton is None or not (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the kernel needs a CUDA GPU or TRITON_INTERPRET=1",
)
SHAPES = [(1, 9, 0, 7), (13, 9, 3, 5), (40, 64, 8, 0)]  # trees, their most nodes, padding sequences, padding tokens
MAX_CONTEXT = 200


def random_tree(rng: np.random.Generator, max_nodes: int, whole_chain: bool = False) -> tuple[DraftTree, np.ndarray]:
    """A draft tree and the draws at its nodes, which follow one of a node's children 70% of the time;
    `whole_chain`: a chain of `max_nodes` nodes, all accepted (the deepest path there can be)."""
    n = max_nodes if whole_chain else int(rng.integers(1, max_nodes + 1))
    parents = [-1] + [i - 1 if whole_chain else int(rng.integers(i)) for i in range(1, n)]
    tokens = [int(rng.integers(1000))]
    for i in range(1, n):  # siblings carry distinct tokens
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(next(t for t in rng.permutation(50).tolist() if t not in taken))
    tree = DraftTree(np.array(tokens), np.array(parents))
    drawn = rng.integers(50, size=n)
    for i, kids in enumerate(tree.children()):
        if kids and (whole_chain or rng.random() < 0.7):
            drawn[i] = tokens[kids[int(rng.integers(len(kids)))]]
    return tree, drawn


def verify_step(seed: int, num_trees: int, max_nodes: int, pad_seqs: int, pad_tokens: int):
    """A verify step's device layout for random trees, padded like a CUDA graph's, and a slot table
    holding each node's slot where the layout put it; returns them and the host walk's paths."""
    rng = np.random.default_rng(seed)
    trees, draws = zip(*(random_tree(rng, max_nodes, whole_chain=i == 0) for i in range(num_trees)))
    sizes = [len(t.tokens) for t in trees]
    first = np.concatenate([[0], np.cumsum(sizes)])
    n = int(first[-1])
    padding_row = num_trees + 3
    rows = rng.permutation(padding_row)[:num_trees]
    starts = rng.integers(1, MAX_CONTEXT - max_nodes, size=num_trees)
    slots = rng.permutation(np.arange(1, 10 * n + 2))[:n]
    parents = np.concatenate([np.where(t.parents >= 0, t.parents + f, -1) for t, f in zip(trees, first)])
    positions = np.concatenate([s + t.depths() for s, t in zip(starts, trees)])
    table = rng.integers(1, 10_000, size=(padding_row + 1, MAX_CONTEXT)).astype(np.int32)
    table[padding_row] = 0
    for t, row, start, f in zip(trees, rows, starts, first):
        table[row, start : start + len(t.tokens)] = slots[f : f + len(t.tokens)]
    paths = accept_paths(parents, np.concatenate([t.tokens for t in trees]), np.concatenate(draws), first[:-1].tolist())

    def padded(a, fill, extra=pad_tokens):
        return torch.from_numpy(np.concatenate([a, np.full(extra, fill)]).astype(np.int64)).to(DEVICE)

    step = dict(
        parents=padded(parents, -1),
        ancestors=padded(np.concatenate([t.ancestor_mask() for t in trees]), 1),
        tokens=padded(np.concatenate([t.tokens for t in trees]), 0),
        positions=padded(positions, 0),
        out_slots=padded(slots, 0),
        drawn=padded(np.concatenate(draws), 0).double(),
        qo_indptr=padded(first, n, pad_seqs).int(),
        seq_rows=padded(rows, padding_row, pad_seqs).int(),
    )
    return step, torch.from_numpy(table).to(DEVICE), padding_row, paths, (rows, starts, slots)


def walk(outcome, num_trees: int, max_nodes: int, pad_seqs: int, pad_tokens: int) -> None:
    """Run `outcome` (verify_outcome or its reference) on a fresh random verify step; check it against
    the host walk: path lengths, bonus tokens, and the slot table (accepted drafts right after their root)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh trees every run; the seed names a failing one
    step, table, padding_row, paths, (rows, starts, slots) = verify_step(seed, num_trees, max_nodes, pad_seqs, pad_tokens)
    expected = table.cpu().numpy().copy()
    for path, row, start in zip(paths, rows, starts):
        expected[row, start : start + len(path)] = slots[path]
    bonus, lengths = outcome(**step, slot_table=table, padding_row=padding_row, max_tree_tokens=max_nodes)
    drawn = step["drawn"].long().cpu().numpy()
    assert lengths.tolist() == [len(p) for p in paths] + [0] * pad_seqs, seed
    assert bonus[:num_trees].tolist() == [int(drawn[p[-1]]) for p in paths], seed
    assert np.array_equal(table.cpu().numpy(), expected), seed
    assert len(paths[0]) == max_nodes  # the whole chain was accepted


@pytest.mark.parametrize("num_trees,max_nodes,pad_seqs,pad_tokens", SHAPES)
def test_the_torch_walk_matches_the_host_walk(num_trees, max_nodes, pad_seqs, pad_tokens):
    def reference(ancestors, **step):  # the reference reads parents, not the ancestor masks
        return tree_accept.verify_outcome_ref(**step)

    walk(reference, num_trees, max_nodes, pad_seqs, pad_tokens)


@kernel_runs
@pytest.mark.parametrize("num_trees,max_nodes,pad_seqs,pad_tokens", SHAPES)
def test_the_kernel_matches_the_host_walk(num_trees, max_nodes, pad_seqs, pad_tokens):
    walk(tree_accept.verify_outcome, num_trees, max_nodes, pad_seqs, pad_tokens)
