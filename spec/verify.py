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
