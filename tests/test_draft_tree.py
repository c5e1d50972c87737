import numpy as np
import pytest

from spec.tree import DraftTree


def random_tree(rng: np.random.Generator, n: int) -> DraftTree:
    """n nodes, random shape; sibling tokens drawn from a small vocabulary but kept distinct."""
    parents, tokens = [-1], [int(rng.integers(100))]
    for i in range(1, n):
        p = int(rng.integers(i))
        taken = {t for t, q in zip(tokens, parents) if q == p}
        tok = int(rng.integers(100))
        while tok in taken:
            tok = int(rng.integers(100))
        parents.append(p)
        tokens.append(tok)
    return DraftTree(np.array(tokens), np.array(parents))


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 33, 63, 64])
def test_tree_ancestor_mask_matches_parent_walk(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        tree = random_tree(rng, n)
        mask = tree.ancestor_mask()
        assert mask.dtype == np.int64 and mask.shape == (n,)
        parents = tree.parents.tolist()
        for i, row in enumerate(mask.view(np.uint64).tolist()):
            assert {j for j in range(n) if row >> j & 1} == ancestors_or_self(parents, i)


def test_node_63_uses_the_sign_bit():
    tree = DraftTree.chain(list(range(64)))
    mask = tree.ancestor_mask()
    assert mask[63] == -1  # all 64 bits set
    assert mask[62] == (1 << 63) - 1


def test_depths_and_children_match_parents():
    rng = np.random.default_rng(0)
    for n in [1, 5, 64]:
        tree = random_tree(rng, n)
        depths, kids = tree.depths(), tree.children()
        assert depths.dtype == np.int32
        parents = tree.parents.tolist()
        assert depths.tolist() == [len(ancestors_or_self(parents, i)) - 1 for i in range(n)]
        assert kids == [[j for j in range(n) if parents[j] == i] for i in range(n)]


def test_chain_and_root_only_shapes():
    chain = DraftTree.chain([5, 6, 7], source="eagle")
    assert chain.parents.tolist() == [-1, 0, 1] and chain.num_drafts == 2 and chain.source == "eagle"
    assert chain.depths().tolist() == [0, 1, 2]
    root = DraftTree.root_only(9)
    assert root.tokens.tolist() == [9] and root.num_drafts == 0 and root.ancestor_mask().tolist() == [1]
    assert root.tokens.dtype == np.int64 and root.parents.dtype == np.int32


@pytest.mark.parametrize(
    "tokens, parents, why",
    [
        ([], [], "1..64 nodes"),
        (list(range(65)), list(range(-1, 64)), "1..64 nodes"),
        ([1, 2], [-1], "one parent each"),
        ([1, 2], [0, 0], "must be -1"),
        ([1, 2, 3], [-1, 2, 0], "precede"),
        ([1, 2, 3], [-1, 0, 2], "precede"),
        ([1, 2, 2], [-1, 0, 0], "same token"),
    ],
)
def test_malformed_trees_are_rejected(tokens, parents, why):
    with pytest.raises(ValueError, match=why):
        DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int32))


def test_same_token_under_different_parents_is_allowed():
    tree = DraftTree(np.array([1, 2, 3, 2, 2]), np.array([-1, 0, 0, 1, 2]))
    assert tree.children() == [[1, 2], [3], [4], [], []]


def test_every_verify_shape_is_captured_up_front():
    # a verify step whose padded shape was not captured at start would capture mid-run (~35 ms)
    from rollout.cuda_graphs import BATCH_BUCKETS, tree_step_tokens, verify_token_counts

    max_tokens, max_tree_tokens = 256, 9
    prev = 0
    for b in BATCH_BUCKETS:
        captured = set(verify_token_counts(b, max_tokens, max_tree_tokens))
        for seqs in range(prev + 1, b + 1):
            for drafts in range(1, seqs * (max_tree_tokens - 1) + 1):
                t = tree_step_tokens(b, seqs + drafts)
                assert t > max_tokens or t in captured, (b, seqs, drafts, t)
        prev = b
