"""Verifying drafts that a drafter *sampled* from its own distribution q (EAGLE/MTP heads), losslessly.

The n-gram drafter's drafts are fixed tokens, and `kernels/tree_accept.py` verifies them by
drawing the target's token at every node (counter-based, as spec off would) and descending
to the child that carries it: a child is accepted with probability p(x), siblings together
with the sum of theirs. A head proposes from a distribution q close to the target's p; drawn
from q, a draft x is accepted with probability min(1, p(x) / q(x)), and a chain of them with
1 - TV(p, q) per step, far more than p(x) at T = 1.

Multi-draft speculative sampling over a tree (SpecInfer's recursive rejection): the children
of a node were drawn independently from that node's q, and are tried in order. With r the
node's target distribution p, a child carrying x is accepted with probability min(1, r(x) /
q(x)); when it is rejected, r becomes the normalised residual max(0, r - q) and the next
sibling is tried against it. An accepted child becomes the current node (r its own p); when
every child of the current node is rejected, or it has none, the bonus token is drawn from r.
The emitted tokens are then distributed exactly as the target's own samples
(tests/test_sampled_tree_accept.py holds it by chi-square on a Markov chain target).

This is the torch reference, the definition any kernel is held to.
"""

from __future__ import annotations

import torch

RESIDUAL_FLOOR = 1e-12  # below this mass the residual is taken as empty: r itself is kept (it only happens by rounding)


def accept_sampled_trees_ref(
    parents: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
    coins: torch.Tensor, draws: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [S, N] (node 0 the root, -1; a node after its parent, siblings in the order they
    were drawn; -2 for padding), tokens [S, N] (the root's is not read), p [S, N, V] the target's
    probabilities of the token after each node, q [S, N, V] the distribution each node's
    children were drawn from, coins [S, N] and draws [S, N] uniforms in [0, 1): node j's
    acceptance coin as a candidate, and the draw of the bonus token if the walk ends at j.

    Returns the emitted tokens [S, N] int64 (the accepted drafts in order, then the bonus token;
    -1 after), how many [S] int64, and the accepted nodes [S, N] bool (the root included)."""
    s, n = tokens.shape
    rows = torch.arange(s, device=tokens.device)
    cur = torch.zeros(s, dtype=torch.long, device=tokens.device)
    r = p[:, 0].clone()
    accepted = torch.zeros(s, n, dtype=torch.bool, device=tokens.device)
    accepted[:, 0] = True
    emitted = torch.full((s, n), -1, dtype=torch.long, device=tokens.device)
    count = torch.zeros(s, dtype=torch.long, device=tokens.device)
    for j in range(1, n):
        tried = parents[:, j] == cur  # a child of the current node, in its siblings' order
        x = tokens[:, j].long()
        q_cur = q[rows, cur]
        q_x = q_cur[rows, x]
        ratio = torch.where(q_x > 0, r[rows, x] / q_x.clamp(min=1e-30), torch.ones_like(q_x))
        take = tried & (coins[:, j] < ratio.clamp(max=1.0))
        drop = tried & ~take
        residual = (r - q_cur).clamp(min=0)
        mass = residual.sum(dim=1, keepdim=True)
        residual = torch.where(mass > RESIDUAL_FLOOR, residual / mass.clamp(min=RESIDUAL_FLOOR), r)
        r = torch.where(drop[:, None], residual, torch.where(take[:, None], p[:, j], r))
        emitted[rows[take], count[take]] = x[take]
        count += take.long()
        accepted[:, j] = take
        cur = torch.where(take, j, cur)
    # the bonus token: r's inverse CDF at the current node's draw
    cdf = r.cumsum(dim=1)
    u = draws[rows, cur] * cdf[:, -1]
    bonus = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=r.shape[1] - 1)
    emitted[rows, count] = bonus
    return emitted, count + 1, accepted
