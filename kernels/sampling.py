"""Drawing one token per logits row on the GPU in two Triton kernels, for the plain modes.

`rollout.engine.sampler.sample` is the reference: temperature, log-softmax, then for a sampled row
the argmax of z + Gumbel noise hashed from (key, position, token id), for a greedy row the argmax
of z. In torch that is some ten passes over the [rows, vocab] float32 logits. Here:

1. `_chunk_kernel`, one program per (row, chunk of `CHUNK` columns): the chunk's maximum of
   z = logits / temperature, the first column holding it, sum(exp(z - max)), and for a sampled
   row the chunk's best score (z + G, in base 2) and the first column holding it (the noise
   hashed in registers, as the reference's `gumbel_scores`).
2. `_pick_kernel`, one program per row: combines the chunks into the row's maximum and
   normalizer; a greedy row takes the first maximal column, a sampled row the first column of
   the best score. The logprob is z[token] - max - log(total), as log-softmax gives it.

So the logits are read once, and a row's work is spread over its chunks, which keeps a batch of
one from being one program's serial loop. The noise is the reference's to the last bit but for
`log2`, which here is the hardware's approximation (2^-22 relative): two tokens whose scores
meet within that can swap, a chance of about 1e-6 per draw. Truncation (top-k, top-p, min-p)
needs a sort and stays in torch, and a step with any truncated row draws all its rows there.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.fused import triton, use_triton

if triton is not None:
    import triton.language as tl

CHUNK = 2048


def draw(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
         greedy_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [L] int64 and their logprobs [L] float32 for logits [L, V] float32 (columns contiguous):
    temperature [L] float32 (0: greedy), keys and positions [L] int64 (the RNG counter of
    `rollout.engine.sampler.row_hashes`). `greedy_only`: every row is greedy, skip the hashing."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    chunks = triton.cdiv(vocab, CHUNK)
    partial = torch.empty(5, rows, chunks, dtype=torch.float32, device=logits.device)
    _chunk_kernel[(rows, chunks)](
        logits, temperature, keys, positions, partial, logits.stride(0), vocab, rows * chunks,
        SAMPLE=not greedy_only, CHUNK=CHUNK, num_warps=4, **pdl.launch_args(),
    )
    _pick_kernel[(rows,)](
        logits, temperature, partial, tokens, logprobs, logits.stride(0), vocab, rows * chunks,
        chunks, SAMPLE=not greedy_only, CHUNKS=triton.next_power_of_2(chunks), num_warps=4, **pdl.launch_args(),
    )
    return tokens, logprobs


def available(logits: torch.Tensor) -> bool:
    return use_triton(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1


if triton is not None:

    @triton.jit
    def _mix32(x):
        """lowbias32 on uint32, as `rollout.engine.sampler.mix32`."""
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        return x ^ (x >> 15)

    @triton.jit
    def _scaled(logits_ptr, row, stride, cols, vocab, t):
        """z = logits / t on the columns `cols` of `row`, -inf past the vocabulary."""
        ok = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf"))
        return tl.where(ok, tl.math.div_rn(x, t), float("-inf"))

    @triton.jit
    def _row_temperature(temp_ptr, row):
        temp = tl.load(temp_ptr + row)
        return temp, tl.where(temp > 0, temp, 1.0)

    @triton.jit
    def _log2(x):
        """log2 by the hardware's approximation (MUFU.LG2, ~2^-22 relative): one instruction, where
        libdevice's accurate logf costs about twenty and the noise needs two a vocabulary entry."""
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _exponential(h):
        """-log2(u), u = (h + 0.5) / 2^32, for h uint32: `rollout.engine.sampler.exponentials`."""
        low = h < tl.full([], 0x80000000, tl.uint32)
        u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        v = ((tl.full([], 0xFFFFFFFF, tl.uint32) - h).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - u
        e = -_log2(tl.where(low, u, 1.0 - v))
        series = v * (1.0 + v * (0.5 + v * 0.3333333432674408)) * 1.4426950408889634  # (float32 constants, as the reference's)
        return tl.where(low | (v >= 0.00390625), e, series)

    @triton.jit
    def _chunk_kernel(logits_ptr, temp_ptr, key_ptr, pos_ptr, partial_ptr, stride, vocab, plane,
                      SAMPLE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        temp, t = _row_temperature(temp_ptr, row)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        z = _scaled(logits_ptr, row, stride, cols, vocab, t)
        top = tl.max(z, 0)
        first = tl.min(tl.where(z == top, cols, vocab), 0)  # first column holding the maximum
        mass = tl.sum(tl.exp(z - top), 0)
        out = partial_ptr + row * tl.num_programs(1) + chunk
        tl.store(out, top)
        tl.store(out + plane, first.to(tl.float32))  # exact: columns stay below 2**24
        tl.store(out + 2 * plane, mass)
        if SAMPLE:
            if temp > 0:
                position = tl.load(pos_ptr + row).to(tl.uint32)  # the low 32 bits, as `& MASK32`
                h = _mix32(_mix32(tl.load(key_ptr + row).to(tl.uint32) ^ _mix32(position)) ^ tl.full([], 0x9E3779B9, tl.uint32))
                noise = _exponential(_mix32(h ^ (cols.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32))))
                score = tl.where(cols < vocab, z * 1.4426950408889634 - _log2(noise), float("-inf"))
                best = tl.max(score, 0)
                tl.store(out + 3 * plane, best)
                tl.store(out + 4 * plane, tl.min(tl.where(score == best, cols, vocab), 0).to(tl.float32))

    @triton.jit
    def _pick_kernel(logits_ptr, temp_ptr, partial_ptr, tok_ptr, lp_ptr, stride, vocab, plane,
                     chunks, SAMPLE: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        temp, t = _row_temperature(temp_ptr, row)
        c = tl.arange(0, CHUNKS)
        ok = c < chunks
        part = partial_ptr + row * chunks + c
        tops = tl.load(part, mask=ok, other=float("-inf"))
        top = tl.max(tops, 0)
        masses = tl.where(ok, tl.load(part + 2 * plane, mask=ok, other=0.0) * tl.exp(tops - top), 0.0)
        total = tl.sum(masses, 0)
        best = tl.argmax(tops, 0, tie_break_left=True)  # the first chunk holding the maximum
        token = tl.sum(tl.where(c == best, tl.load(part + plane, mask=ok, other=0.0), 0.0), 0).to(tl.int64)
        if SAMPLE:
            if temp > 0:
                scores = tl.load(part + 3 * plane, mask=ok, other=float("-inf"))
                won = tl.argmax(scores, 0, tie_break_left=True)  # the first chunk holding the best score
                token = tl.sum(tl.where(c == won, tl.load(part + 4 * plane, mask=ok, other=0.0), 0.0), 0).to(tl.int64)
        z_token = tl.math.div_rn(tl.load(logits_ptr + row * stride + token), t)
        tl.store(tok_ptr + row, token)
        tl.store(lp_ptr + row, z_token - top - tl.log(total))
