"""One kernel for a tensor-parallel decoder's row-parallel output: the ranks' parts summed, the
residual added, RMSNorm (Triton, over symmetric memory: CUDA P2P, never NVLink multicast).

A decoder layer's o and down products end in an all-reduce whose result only ever goes into the
next norm with the residual added. Apart, that is two kernels at every one of 2 x layers places in
a step (the one-shot all-reduce, then `fused.rms_norm`), and at decode each costs mostly its
launch and its waits. Here a program per row copies this rank's row into its buffer, meets the
other ranks (a barrier over the signal pads), sums every rank's row in rank order in float32 and
rounds once (so every rank gets the same bits, as the ranks must), adds the residual and
normalises, rounding where `fused.rms_norm` rounds: over 2 ranks the result is bitwise that of
the all-reduce then `fused.rms_norm`.

One barrier, not torch's two. A rank must not overwrite its row before every peer has read it;
torch's one-shot kernel meets the peers again at its end for that. Here the buffer has two halves
and each row's calls alternate between them (a phase per row, on the device, so CUDA graphs replay
it): a row's half is written again only two calls later, after the barrier of the call between,
which every peer reaches only once it has finished the call before. The ranks make the same calls
in the same order, so their phases agree.

The barrier is the signal pads' handshake that torch's symmetric-memory kernels use: program b of
rank r sets slot [b * world + r] of each peer's pad from 0 to 1 (release, system scope), then
waits for each peer's slot in its own pad to go from 1 back to 0 (acquire). A slot returns to 0
every time, so there is nothing to reset between calls or graphs.
"""

from __future__ import annotations

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        buffer_ptrs: torch.Tensor, half_bytes: int, signal_ptrs: torch.Tensor, phases: torch.Tensor,
                        rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum of every rank's `x` + residual), that sum), for x and residual [rows, n]
    contiguous. `buffer_ptrs`, `signal_ptrs`: int64 [world] on the device, each rank's symmetric
    buffer (two halves of `half_bytes`, each at least rows x n of x's dtype) and signal pad (at
    least rows x world slots); `phases`: int32, a row's half, at least rows (zeros at first)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _all_reduce_rms_norm_kernel[(rows,)](
            x, residual, weight, out, summed, buffer_ptrs, half_bytes // x.element_size(), signal_ptrs, phases, rank, n, eps,
            WORLD=buffer_ptrs.numel(), BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl.launch_args(),
        )
    return out, summed


if triton is not None:

    @triton.jit
    def _meet(signal_ptrs, block, rank, WORLD: tl.constexpr):
        """Program `block` of every rank has come here; the writes each made before are visible after."""
        tl.debug_barrier()  # (this program's writes happen before its signals)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                slot = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32)) + block * WORLD + rank
                seen = tl.atomic_cas(slot, 0, 1, sem="release", scope="sys")
                while seen != 0:  # (the peer has not yet taken this slot's last signal)
                    seen = tl.atomic_cas(slot, 0, 1, sem="release", scope="sys")
        mine = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32)) + block * WORLD
        for peer in tl.static_range(WORLD):
            if peer != rank:
                seen = tl.atomic_cas(mine + peer, 1, 0, sem="acquire", scope="sys")
                while seen != 1:
                    seen = tl.atomic_cas(mine + peer, 1, 0, sem="acquire", scope="sys")
        tl.debug_barrier()  # (every thread reads after the acquire)

    @triton.jit
    def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, buffer_ptrs, half, signal_ptrs, phase_ptr,
                                    rank, n, eps, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        at = row.to(tl.int64) * n + cols
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
        dtype = x.dtype
        phase = tl.load(phase_ptr + row)
        staged = phase.to(tl.int64) * half + at  # (this row's place in this call's half)
        tl.store(tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)) + staged, x, mask=ok)
        _meet(signal_ptrs, row, rank, WORLD)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # (rank order on every rank: the same bits)
            part = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
            total += tl.load(part + staged, mask=ok, other=0.0, volatile=True).to(tl.float32)
        tl.store(phase_ptr + row, 1 - phase)
        # as `fused.rms_norm` after the all-reduce: the sum rounded, the residual added and rounded
        x = (total.to(dtype).to(tl.float32) + tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + at, x, mask=ok)
        x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + at, ((x * inv).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype), mask=ok)
