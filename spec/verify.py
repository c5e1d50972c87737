"""Lossless verification of a draft tree against the target model's draws.

The runner draws one target token at every tree node (greedy: argmax; sampling: the
node's processed distribution, keyed by the output position the node would fill). The
walk descends from the root while the drawn token is one of the node's draft children
and stops at the first node whose draw matches no child; that draw is the bonus token.

For an n-gram draft (a deterministic proposal, q = 1 on the drafted token), this is the
multi-draft rejection scheme: accepting child c_1 with probability p(c_1), else c_2 with
probability p'(c_2) under the residual p' = p without c_1 renormalized, and so on, then
sampling the residual, emits each token with exactly p; drawing x ~ p once and
descending if x is a child has the same law. Each emitted token is thus drawn from the
same distribution, with the same random key, as without speculation.
"""

from __future__ import annotations

import numpy as np
import torch


def accept_paths(parents: np.ndarray, tokens: np.ndarray, drawn: np.ndarray, roots: list[int]) -> list[list[int]]:
    """The walk for trees laid out one after another: node i carries `tokens[i]`, has parent
    `parents[i]` (-1 for a root) and drew `drawn[i]`. Returns each root's accepted nodes, root
    first; the bonus token is the draw of the path's last node."""
    # a node is accepted iff its parent is and it carries its parent's draw; siblings carry
    # distinct tokens, so each node has at most one such child
    children = np.flatnonzero(parents >= 0)
    matching = children[tokens[children] == drawn[parents[children]]]
    next_node = np.full(len(parents), -1, dtype=np.int64)
    next_node[parents[matching]] = matching
    follow = next_node.tolist()
    paths = []
    for root in roots:
        path = [root]
        while follow[path[-1]] >= 0:
            path.append(follow[path[-1]])
        paths.append(path)
    return paths



def accept_on_device(
    parents: torch.Tensor, depths: torch.Tensor, trees: torch.Tensor, first: torch.Tensor,
    max_depth: int, tokens: torch.Tensor, drawn: torch.Tensor, real: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walk of `accept_paths` as tensor operations, so that a step launched before the host
    has this one's tokens can read its outcome on the device (and a CUDA graph can hold it).
    parents [T] (-1: a root), depths [T], trees [T] (each node's tree) and first [B + 1] (tree
    b's nodes are first[b]:first[b + 1]) describe the trees; `max_depth` bounds their depth;
    `real` [T] bool marks the nodes of some tree (the rest are padding). Returns the accepted
    nodes [T] bool, each tree's path length [B] (its root included) and its path's last node [B],
    whose draw is the bonus token."""
    node = torch.arange(len(parents), device=parents.device)
    up = torch.where(parents >= 0, parents, node)  # a root is its own parent
    accepted = (parents < 0) | (tokens == drawn.long()[up])
    if real is not None:
        accepted &= real
    for _ in range(max_depth.bit_length()):  # pointer doubling: after k rounds, 2**k - 1 ancestors are in
        accepted = accepted & accepted[up]
        up = up[up]
    counted = torch.zeros(len(parents) + 1, dtype=torch.int64, device=parents.device)
    torch.cumsum(accepted, 0, out=counted[1:])
    lengths = counted[first[1:]] - counted[first[:-1]]
    # the accepted nodes of a tree form a chain from its root, one per depth: the last is the deepest
    last = torch.where(accepted & (depths == lengths[trees] - 1), node, 0)
    return accepted, lengths, torch.zeros_like(lengths).index_add_(0, trees, last)
