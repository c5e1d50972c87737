"""Sampling from logits, with the logprob of each token under the distribution it came from.

Randomness is counter-based: the uniform draw for a token is a hash of (request seed,
sample index, output position). A token therefore depends only on its own logits and
key, not on batch composition, preemption or speculation: with the same seed, spec on and
spec off draw the same tokens, and a draft-tree node at depth d uses the key of output
position p + d. Sampling is inverse-CDF over the vocabulary with that one uniform per row.
On CUDA, rows without truncation are drawn by the fused kernels of `kernels/sampling.py`;
the torch code here is their reference and serves everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import sampling as sampling_kernels

MASK32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (lowbias32); works on Python ints and on int64 tensors of uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def sequence_key(seed: int, sample_index: int) -> int:
    """The RNG key of one sample of a request: a 32-bit hash of the 64-bit seed and the index."""
    h = mix32(seed & MASK32)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    return mix32(h ^ mix32(sample_index & MASK32))


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, float64: keys [L] (uint32 in int64), positions [L] int64."""
    h = mix32(keys ^ mix32(positions & MASK32))
    h = mix32(h ^ 0x9E3779B9)
    return (h.double() + 0.5) / 2.0**32


@dataclass
class SamplingTensors:
    """Per logits row; built by the runner once per step."""

    temperature: torch.Tensor  # [L] float32, 0 = greedy
    top_k: torch.Tensor  # [L] int64, <= 0 = off
    top_p: torch.Tensor  # [L] float32
    min_p: torch.Tensor  # [L] float32
    keys: torch.Tensor  # [L] int64 (uint32 values)
    positions: torch.Tensor  # [L] int64, output position of the token being drawn
    all_greedy: bool  # host flags so the common cases skip work
    any_truncation: bool


def processed_logprobs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """log of the distribution each row samples from: temperature, then top-k, top-p, min-p."""
    greedy = st.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    z = logits / temperature[:, None]
    if st.any_truncation:
        z = _truncate(z, st)
    return torch.log_softmax(z, dim=-1)


def _truncate(z: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    vocab = z.shape[-1]
    sorted_z, order = z.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    ranks = torch.arange(vocab, device=z.device)[None, :]
    top_k = torch.where(st.top_k > 0, st.top_k, vocab)
    keep &= ranks < top_k[:, None]
    # top-p over what top-k kept: drop a token once the mass before it already reaches top_p.
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < st.top_p[:, None]
    probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs >= st.min_p[:, None] * probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    mask = torch.empty_like(keep).scatter_(1, order, keep)
    return z.masked_fill(~mask, float("-inf"))


def sample(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [L, V]; returns (tokens [L] int64, logprobs [L] float32)."""
    if not st.any_truncation and sampling_kernels.available(logits):
        return sampling_kernels.draw(logits, st.temperature, st.keys, st.positions, greedy_only=st.all_greedy)
    return sample_reference(logits, st)


def sample_reference(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` in torch: the definition the kernels are held to, and the path for truncation."""
    logprobs = processed_logprobs(logits, st)
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        cdf = logprobs.exp().cumsum(dim=-1)  # [L, V]
        u = uniforms(st.keys, st.positions).to(cdf.dtype) * cdf[:, -1]
        # side="left" never lands on a zero-mass token: its cdf equals its predecessor's.
        drawn = torch.searchsorted(cdf, u[:, None]).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        tokens = torch.where(st.temperature == 0, greedy_tokens, drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
