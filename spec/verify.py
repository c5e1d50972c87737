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

from spec.tree import DraftTree


def accept_path(tree: DraftTree, targets: np.ndarray) -> tuple[np.ndarray, int]:
    """targets[i]: the token drawn after node i. Returns (accepted nodes, root first; bonus token)."""
    children, tokens, drawn = tree.children(), tree.tokens.tolist(), targets.tolist()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in children[node] if tokens[c] == drawn[node]), None)
        if nxt is None:
            return np.asarray(path, dtype=np.int64), int(drawn[node])
        path.append(nxt)
