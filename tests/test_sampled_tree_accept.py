"""Drafts sampled from a drafter's distribution, verified by recursive rejection over a tree
(kernels/sampled_tree_accept.py): the emitted tokens are the target's own distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from kernels.sampled_tree_accept import accept_sampled_trees_ref

PARENTS = [-1, 0, 0, 1, 1, 2, 2]  # a root, two children drawn from its q, two from each child's


def _markov(gen: torch.Generator, v: int, sharpness: float) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(v, v, generator=gen, dtype=torch.float64), dim=1)


def _roll_out(target: torch.Tensor, draft: torch.Tensor, seqs: int, length: int, gen: torch.Generator):
    """`seqs` samples of `length` tokens after token 0 of the Markov chain `target`, each verify
    step drafting the tree of PARENTS from the Markov chain `draft`; returns the tokens and the
    drafts accepted per step."""
    parents = torch.tensor(PARENTS).expand(seqs, -1)
    n = len(PARENTS)
    out = torch.zeros(seqs, 0, dtype=torch.long)
    last = torch.zeros(seqs, dtype=torch.long)
    steps = accepted = 0
    while out.shape[1] < length:
        tokens = torch.zeros(seqs, n, dtype=torch.long)
        tokens[:, 0] = last
        for j in range(1, n):  # each child drawn from its parent's q
            tokens[:, j] = torch.multinomial(draft[tokens[:, PARENTS[j]]], 1, generator=gen).squeeze(1)
        p, q = target[tokens], draft[tokens]
        coins, draws = (torch.rand(seqs, n, generator=gen, dtype=torch.float64) for _ in range(2))
        emitted, count, _ = accept_sampled_trees_ref(parents, tokens, p, q, coins, draws)
        k = int(count.min())  # (every sequence takes as many as the shortest: their streams stay aligned)
        out = torch.cat([out, emitted[:, :k]], dim=1)
        last = out[:, -1]
        steps, accepted = steps + 1, accepted + float((count - 1).float().mean())
    return out[:, :length], accepted / steps


@pytest.mark.parametrize("sharpness, noise", [(1.0, 0.5), (3.0, 1.0), (2.0, 0.0)])
def test_sampled_drafts_leave_the_target_distribution_of_three_tokens_unchanged(sharpness, noise):
    gen = torch.Generator().manual_seed(int(10 * sharpness + noise))
    v, seqs, length = 4, 200_000, 3
    target = _markov(gen, v, sharpness)
    draft = torch.softmax(target.log() + noise * torch.randn(v, v, generator=gen, dtype=torch.float64), dim=1)
    tokens, accepted = _roll_out(target, draft, seqs, length, gen)
    observed = torch.bincount(tokens @ torch.tensor([v * v, v, 1]), minlength=v**length).double()
    expected = torch.tensor([float(target[0, a] * target[a, b] * target[b, c])
                             for a, b, c in itertools.product(range(v), repeat=length)], dtype=torch.float64)
    assert chisquare(observed.numpy(), (expected * seqs).numpy()).pvalue > 0.001
    if noise == 0:  # the drafter is the target: every draft is accepted
        assert accepted == pytest.approx(2.0)


def test_a_child_is_accepted_with_min_1_p_over_q_and_siblings_against_the_residual():
    # target p = (0.5, 0.3, 0.2) at the root, drafter q = (0.2, 0.6, 0.2); children carry 1, then 0
    parents = torch.tensor([[-1, 0, 0]])
    tokens = torch.tensor([[2, 1, 0]])
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64).expand(3, -1)[None]
    q = torch.tensor([[0.2, 0.6, 0.2]], dtype=torch.float64).expand(3, -1)[None]

    def walk(coin1: float, coin2: float, draw: float):
        coins = torch.tensor([[0.0, coin1, coin2]], dtype=torch.float64)
        draws = torch.tensor([[draw, 0.0, 0.0]], dtype=torch.float64)
        emitted, count, accepted = accept_sampled_trees_ref(parents, tokens, p, q, coins, draws)
        return emitted[0, : int(count)].tolist(), accepted[0].tolist()

    # child 1 (token 1): accepted below 0.3 / 0.6 = 0.5; it is a leaf, so its p draws the bonus
    assert walk(0.49, 0.99, 0.0) == ([1, 0], [True, True, False])
    # rejected: the residual is max(0, p - q) = (0.3, 0, 0) / 0.3 = (1, 0, 0), so child 2 (token 0)
    # is accepted with min(1, 1 / 0.2): always
    assert walk(0.51, 0.999, 0.0) == ([0, 0], [True, False, True])
