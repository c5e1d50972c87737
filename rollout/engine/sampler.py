"""Sampling from logits, with the logprob of each token under the distribution it came from.

Sampling is Gumbel-max over counter-based noise: a row's token is the argmax over the vocabulary
of z_v + G_v, with z the processed logits / T (truncated tokens at -inf) and G_v a Gumbel draw
that is a hash of (sequence key, output position, token id). That draws exactly from softmax(z),
and a token depends only on its own logits and key, not on batch composition, preemption or
speculation: with the same seed, spec on and spec off draw the same tokens, and a draft-tree
node at depth d uses the key of output position p + d. Because every token has its own noise,
two rollouts of a prompt drawn with the same key under slightly different weights pick the same
token wherever the weights moved no token's z past another's noisy score, whereas one shared
uniform through the inverse CDF shifts every token's boundary when any probability moves: a
later rollout's earlier sample is a draft it can accept (`EngineConfig.coupled_sampling`; how
long two samples stay aligned on the GPU: bench/RESULTS.md).
On CUDA, rows without truncation are drawn by the fused kernels of `kernels/sampling.py`; the
torch code here is their reference and serves everything else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
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


def prompt_seed(prompt_ids: list[int], seed: int) -> int:
    """A request's seed under coupled sampling: a 63-bit hash of its prompt's token ids and the
    engine's seed (the same in every process and every run, unlike Python's hash)."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") >> 1


def sequence_key(seed: int, sample_index: int) -> int:
    """The RNG key of one sample of a request: a 32-bit hash of the 64-bit seed and the index."""
    h = mix32(seed & MASK32)
    h = mix32(h ^ ((seed >> 32) & MASK32))
    return mix32(h ^ mix32(sample_index & MASK32))


def row_hashes(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit hash per row (in int64) of (key, output position): keys [L] uint32 values, positions [L]."""
    return mix32(mix32(keys ^ mix32(positions & MASK32)) ^ 0x9E3779B9)


def token_hashes(rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """[L, V] 32-bit hashes (in int64) of each row's hash and each token id (a Weyl step apart)."""
    tokens = torch.arange(vocab, dtype=torch.int64, device=rows.device)
    return mix32(rows[:, None] ^ (tokens * 0x9E3779B1 & MASK32))


SMALL = 2.0**-8  # below this, -log(1 - v) is its series v + v^2/2 + v^3/3 (error under v^4 / 4)
LOG2E = 1.4426950408889634


def exponentials(h: torch.Tensor) -> torch.Tensor:
    """-log2(u) for u = (h + 0.5) / 2^32 (an exponential draw, in base 2), float32 and accurate at
    both ends: for u near 1 through v = 1 - u (from the integer, so exact in float), as
    -log2(1 - v) or, for small v, its series. The smallest values decide the argmaxes; a float u
    rounded to 1 would make them 0. One log a value, as the kernel computes it."""
    low = h < 2**31
    u = (h.float() + 0.5) * 2.0**-32
    v = ((MASK32 - h).float() + 0.5) * 2.0**-32  # 1 - u
    e = -torch.log2(torch.where(low, u, 1.0 - v))
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0))) * LOG2E
    return torch.where(low | (v >= SMALL), e, series)


def gumbel_scores(z: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(z + Gumbel noise) * log2(e), up to a constant, [L, V] float32 for z [L, V] float32 (processed
    logits / T, -inf where truncated): z log2(e) - log2(E) for E the exponential draws, in base 2
    throughout (one fast hardware log2 each in the kernel)."""
    return z * LOG2E - torch.log2(exponentials(token_hashes(row_hashes(keys, positions), z.shape[-1])))


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


def processed_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """z = logits / T (greedy rows: T = 1), then -inf outside top-k, top-p, min-p: float32 [L, V]."""
    greedy = st.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    z = logits.float() / temperature[:, None]
    return _truncate(z, st) if st.any_truncation else z


def processed_logprobs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """log of the distribution each row samples from: temperature, then top-k, top-p, min-p."""
    return torch.log_softmax(processed_logits(logits, st), dim=-1)


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
    z = processed_logits(logits, st)
    logprobs = torch.log_softmax(z, dim=-1)
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        drawn = gumbel_scores(z, st.keys, st.positions).argmax(dim=-1)  # (the first of equal scores)
        tokens = torch.where(st.temperature == 0, greedy_tokens, drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
