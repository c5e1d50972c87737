"""A draft tree: the tokens a drafter proposes after a sequence's last token, as a tree.

Node 0 is the root: the sequence's last emitted token, known but not yet in the KV cache.
Every other node is a draft token whose parent precedes it (topological order), and two
children of one node never carry the same token, so a verified token selects at most one
child. The target model verifies all nodes in one forward pass; each node attends to the
cached prefix and to its own ancestors (`ancestor_mask`).

Trees are small (at most 64 nodes, one bit each in the mask), so the per-node work here
is plain Python over lists, which beats numpy's per-call overhead at these sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels.attention import MAX_TREE_TOKENS


@dataclass
class DraftTree:
    tokens: np.ndarray  # [N] int64
    parents: np.ndarray  # [N] int32, parents[0] = -1, 0 <= parents[i] < i
    source: str = "ngram"  # the drafter that made it; statistics are split by source

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.parents = np.asarray(self.parents, dtype=np.int32)
        n = len(self.tokens)
        if not 1 <= n <= MAX_TREE_TOKENS or self.tokens.ndim != 1 or self.parents.shape != (n,):
            raise ValueError(
                f"a draft tree has 1..{MAX_TREE_TOKENS} nodes with one parent each, "
                f"got tokens {self.tokens.shape} and parents {self.parents.shape}"
            )
        parents = self.parents.tolist()
        if parents[0] != -1:
            raise ValueError("draft tree node 0 is the root: parents[0] must be -1")
        if not all(0 <= p < i for i, p in enumerate(parents[1:], 1)):
            raise ValueError(f"draft tree parents must precede their children, got {parents}")
        if len(set(zip(parents, self.tokens.tolist()))) != n:
            raise ValueError("two children of one draft tree node carry the same token")

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def depths(self) -> np.ndarray:
        """[N] int32: the root is at depth 0; node i sits depths[i] positions after it."""
        parents = self.parents.tolist()
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        return np.array(depth, dtype=np.int32)

    def ancestor_mask(self) -> np.ndarray:
        """[N] int64: bit j of row i is set iff node j is node i or one of its ancestors.

        Node 63's bit is the sign bit: rows are built as unsigned and reinterpreted.
        """
        parents = self.parents.tolist()
        bits = [1] * len(parents)
        for i in range(1, len(parents)):
            bits[i] = bits[parents[i]] | (1 << i)
        return np.array(bits, dtype=np.uint64).view(np.int64)

    def children(self) -> list[list[int]]:
        """children()[i]: the nodes whose parent is i, in index order."""
        kids: list[list[int]] = [[] for _ in range(len(self.parents))]
        for i, p in enumerate(self.parents.tolist()[1:], 1):
            kids[p].append(i)
        return kids

    @staticmethod
    def root_only(token: int, source: str = "ngram") -> DraftTree:
        """No drafts: verification degenerates to a plain decode step."""
        return DraftTree(np.array([token], dtype=np.int64), np.array([-1], dtype=np.int32), source)

    @staticmethod
    def chain(tokens: Sequence[int], source: str = "ngram") -> DraftTree:
        """The root `tokens[0]` followed by a single path of drafts `tokens[1:]`."""
        return DraftTree(np.asarray(tokens, dtype=np.int64), np.arange(-1, len(tokens) - 1, dtype=np.int32), source)
