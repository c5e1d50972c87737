"""The sampler: truncation sets, the law of drawn tokens, reproducible keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from rollout.engine.sampler import (
    SamplingTensors,
    processed_logprobs,
    sample,
    sequence_key,
    uniforms,
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


def test_drawn_tokens_follow_the_processed_distribution():
    vocab, draws = 12, 200_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)).expand(draws, vocab)
    st = tensors(draws, temperature=0.9, top_k=8, keys=torch.full((draws,), 77), positions=torch.arange(draws))
    tokens, logprobs = sample(logits, st)
    probs = processed_logprobs(logits[:1], st).exp()[0].double().numpy()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], probs[kept] / probs[kept].sum() * draws).pvalue > 0.001
    assert torch.allclose(logprobs, torch.log(torch.from_numpy(probs).float())[tokens], atol=1e-5)


def test_uniforms_are_reproducible_distinct_and_in_open_unit_interval():
    keys = torch.tensor([sequence_key(s, i) for s in range(20) for i in range(5)], dtype=torch.int64)
    u = uniforms(keys, torch.full_like(keys, 3))
    assert torch.equal(u, uniforms(keys, torch.full_like(keys, 3)))
    assert len(set(u.tolist())) == len(keys)
    assert ((u > 0) & (u < 1)).all()
    assert sequence_key(1, 0) != sequence_key(1, 1) != sequence_key(2, 1)
    big = uniforms(torch.full((100_000,), sequence_key(5, 0)), torch.arange(100_000))
    assert abs(big.mean().item() - 0.5) < 0.005
