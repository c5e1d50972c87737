"""The sampler: truncation sets, the law of drawn tokens, reproducible keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout.engine.sampler import (
    SamplingTensors,
    exponentials,
    processed_logprobs,
    sample,
    sequence_key,
)


def tensors(rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, keys=None, positions=None) -> SamplingTensors:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)
    return SamplingTensors(
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        keys=keys if keys is not None else torch.arange(rows, dtype=torch.int64),
        positions=positions if positions is not None else torch.zeros(rows, dtype=torch.int64),
        all_greedy=temperature == 0,
        any_truncation=top_k > 0 or top_p < 1 or min_p > 0,
    )


def reference_keep(logits_row: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Row-by-row, the obvious way: temperature, then top-k, then top-p, then min-p."""
    z = logits_row / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, dtype=bool)
    k = top_k if top_k > 0 else len(z)
    kept = list(order[:k])
    p = np.exp(z[kept] - z[kept].max())
    p /= p.sum()
    mass, survivors = 0.0, []
    for token, prob in zip(kept, p):
        if mass >= top_p:
            break
        survivors.append(token)
        mass += prob
    p = np.exp(z[survivors] - z[survivors].max())
    p /= p.sum()
    survivors = [t for t, prob in zip(survivors, p) if prob >= min_p * p.max()]
    keep[survivors] = True
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.1), (20, 0.9, 0.05)])
def test_truncation_keeps_exactly_the_reference_set(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=gen) * 3
    st = tensors(16, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = torch.isfinite(processed_logprobs(logits, st)).numpy()
    for row in range(16):
        expected = reference_keep(logits[row].double().numpy(), 0.7, top_k, top_p, min_p)
        assert (kept[row] == expected).all(), row


def test_processed_logprobs_are_a_normalized_distribution():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    lp = processed_logprobs(logits, tensors(4, temperature=0.5, top_p=0.8))
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4), atol=1e-5)


def test_greedy_takes_argmax_with_raw_logprob():
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample(logits, tensors(8, temperature=0))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("top_k,top_p,min_p", [(-1, 1.0, 0.0), (8, 1.0, 0.0), (10, 0.9, 0.02)])
def test_gumbel_max_draws_the_processed_distribution_over_a_million_draws(top_k, top_p, min_p):
    """Chi-square of 10^6 draws, each its own (key, position), against softmax of the processed logits."""
    vocab, draws = 16, 1_000_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)).expand(draws, vocab)
    keys = torch.randint(0, 2**32, (draws,), generator=torch.Generator().manual_seed(4))
    st = tensors(draws, temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys,
                 positions=torch.arange(draws) % 4096)
    tokens, logprobs = sample(logits, st)
    probs = processed_logprobs(logits[:1], st).exp()[0].double().numpy()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], probs[kept] / probs[kept].sum() * draws).pvalue > 0.001
    assert torch.allclose(logprobs, torch.log(torch.from_numpy(probs).float())[tokens], atol=1e-5)


def test_draws_are_reproducible_and_each_key_and_position_draws_afresh():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5)).expand(4000, 50)
    keys = torch.tensor([sequence_key(s, i) for s in range(40) for i in range(100)], dtype=torch.int64)
    st = tensors(4000, keys=keys, positions=torch.full_like(keys, 3))
    tokens = sample(logits, st)[0]
    assert torch.equal(tokens, sample(logits, st)[0])
    moved = sample(logits, tensors(4000, keys=keys, positions=torch.full_like(keys, 4)))[0]
    assert 0.5 < (tokens != moved).float().mean() < 1  # another position, other noise
    assert sequence_key(1, 0) != sequence_key(1, 1) != sequence_key(2, 1)


def test_exponentials_keep_their_precision_near_zero_and_have_mean_one():
    """In base 2: -log2(u), the exponential draw times log2(e)."""
    h = torch.tensor([0, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    e = exponentials(h).double() / np.log2(np.e)
    exact = torch.tensor([-np.log((x + 0.5) / 2**32) if x < 2**31 else -np.log1p(-((2**32 - 1 - x) + 0.5) / 2**32)
                          for x in h.tolist()], dtype=torch.float64)
    assert torch.allclose(e, exact, rtol=1e-6), (e, exact)
    assert (e > 0).all()
    sample_h = torch.randint(0, 2**32, (1_000_000,), generator=torch.Generator().manual_seed(6))
    assert abs(exponentials(sample_h).double().mean().item() / np.log2(np.e) - 1) < 0.005


def test_whole_samples_follow_the_policy_exactly_when_each_draw_has_its_own_position():
    """The joint law of 5-token samples over a 3-token vocabulary, whose logits depend on the last
    two tokens (contexts recur within a sample), against the policy's, by chi-square over 200k
    keys: a sample's draws never share noise, so every draw is fresh. The control, noise that
    depends on the last token rather than the position, repeats after a recurring token, and fails."""
    vocab, steps, prompt = 3, 5, [0, 1]
    keys = torch.tensor([sequence_key(5, i) for i in range(200_000)], dtype=torch.int64)
    table = torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(11)) * 1.2
    probs = torch.softmax(table, -1).double().numpy()
    expected = np.ones([vocab] * steps)
    for seq in np.ndindex(*expected.shape):
        ctx = prompt + list(seq)
        expected[seq] = np.prod([probs[ctx[i - 2], ctx[i - 1], ctx[i]] for i in range(2, len(ctx))])
    expected = expected.ravel() * len(keys) / expected.sum()
    pvalues = []
    for counter in (lambda seqs, step: torch.full((len(keys),), step), lambda seqs, step: torch.from_numpy(seqs[:, -1])):
        seqs = np.tile(np.array(prompt), (len(keys), 1))
        for step in range(steps):
            logits = table[torch.from_numpy(seqs[:, -2]), torch.from_numpy(seqs[:, -1])]
            tokens = sample(logits, tensors(len(keys), keys=keys, positions=counter(seqs, step)))[0].numpy()
            seqs = np.concatenate([seqs, tokens[:, None]], axis=1)
        observed = np.bincount(np.ravel_multi_index(seqs[:, len(prompt):].T, [vocab] * steps), minlength=vocab**steps)
        pvalues.append(chisquare(observed, expected).pvalue)
    assert pvalues[0] > 0.001 and pvalues[1] < 1e-6, pvalues
