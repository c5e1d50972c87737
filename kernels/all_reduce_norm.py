"""One kernel for a tensor-parallel decoder's row-parallel output: the ranks' parts summed, the
residual added, RMSNorm (Triton, over symmetric memory: CUDA P2P, never NVLink multicast); and the
same kernel without the norm, the ranks' parts summed alone, for float16 (torch's one-shot kernel
sums bfloat16 and float32 only: float16 went through float32 copies, three kernels and twice the
bytes where bfloat16 takes one).

A decoder layer's o and down products end in an all-reduce whose result only ever goes into the
next norm with the residual added. Apart, that is two kernels at every one of 2 x layers places in
a step (torch's one-shot all-reduce, then `fused.rms_norm`), and at decode each costs mostly its
launch and its waits. Here a program per row writes this rank's row into every rank's buffer (its
own slot there), raises a flag in every rank's signal pad, waits for every rank's flag in its own,
then sums the slots of its own buffer in rank order in float32 and rounds once (so every rank gets
the same bits, as the ranks must), adds the residual and normalises, rounding where
`fused.rms_norm` rounds: over 2 ranks the result is bitwise that of the all-reduce then
`fused.rms_norm`.

Why not torch's kernel: it writes locally, meets the other ranks (each flag a round trip), reads
their buffers over NVLink (another), and meets them again at its end so that nobody overwrites a
buffer still being read. Here the writes go out before the flags, whose stores wait for no answer,
and every read is local. In a CUDA graph over 2 H200s (bench/allreduce_latency.py), [1, 4096] bf16
took 7.7 us against 10.1 apart, [16, 4096] 9.2 against 11.8. (A version that read the peers'
buffers after one barrier took 7.8 and 10.4; one with torch's two barriers, over 2 H100s, 11.2
against 12.0 apart at 1 row and 26.0 against 18.8 at 64: rows past 16 stay apart.)

Flags and buffers are reused without a reset. A row's flags carry its call count (an epoch, per
row, on the device, so CUDA graphs replay it; the ranks make the same calls, so their epochs agree).
A rank can be at most one call ahead of another (it cannot finish a call without every rank's
part), so a flag reads the epoch before, this one, or the next: anything but the epoch before means
"arrived". The buffer's two halves alternate by epoch: a half is written again only two calls
later, which a rank reaches only after every other has finished the call before.
"""

from __future__ import annotations

import torch

from kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def all_reduce_sum(x: torch.Tensor, buffer_ptrs: torch.Tensor, slot_bytes: int, signal_ptrs: torch.Tensor,
                   epochs: torch.Tensor, rank: int) -> torch.Tensor:
    """`x` [rows, n] (contiguous) summed over the ranks in place, in rank order in float32 and rounded
    once: the same bits on every rank (a program reads its row before it writes it). The buffers,
    flags and epochs of `all_reduce_rms_norm`, whose calls may take turns with these."""
    if x.shape[0]:
        _launch(x, x, x, x, x, buffer_ptrs, slot_bytes, signal_ptrs, epochs, rank, 0.0, norm=False)
    return x


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        buffer_ptrs: torch.Tensor, slot_bytes: int, signal_ptrs: torch.Tensor, epochs: torch.Tensor,
                        rank: int, out_dtype: torch.dtype | None = None,
                        round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum of every rank's `x` + residual), that sum), for x and residual [rows, n]
    contiguous. `buffer_ptrs`, `signal_ptrs`: int64 [world] on the device, each rank's symmetric
    buffer (2 x world slots of `slot_bytes`, each at least rows x n of x's dtype) and signal pad
    (at least rows x world int32 flags, zeros at first); `epochs`: int32, a row's calls so far,
    at least rows (zeros at first). The sum is kept in the residual's dtype, the norm rounded to
    `out_dtype` (default x's), twice or `round_once`, as `fused.rms_norm`."""
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    summed = torch.empty_like(residual)
    if x.shape[0]:
        _launch(x, residual, weight, out, summed, buffer_ptrs, slot_bytes, signal_ptrs, epochs, rank, eps, norm=True,
                round_once=round_once)
    return out, summed


def _launch(x, residual, weight, out, summed, buffer_ptrs, slot_bytes, signal_ptrs, epochs, rank, eps, norm,
            round_once=False) -> None:
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    _all_reduce_rms_norm_kernel[(rows,)](
        x, residual, weight, out, summed, buffer_ptrs, slot_bytes // x.element_size(), signal_ptrs, epochs, rank, n,
        eps, WORLD=buffer_ptrs.numel(), NORM=norm, ROUND_ONCE=round_once, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        **pdl.launch_args(),
    )


if triton is not None:

    @triton.jit
    def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, buffer_ptrs, slot, signal_ptrs, epoch_ptr,
                                    rank, n, eps, WORLD: tl.constexpr, NORM: tl.constexpr, ROUND_ONCE: tl.constexpr,
                                    BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        at = row.to(tl.int64) * n + cols
        x = tl.load(x_ptr + at, mask=ok, other=0.0)
        dtype = x.dtype
        epoch = tl.load(epoch_ptr + row) + 1  # (int32: wrapping changes nothing, flags are only compared for equality)
        half = (epoch & 1).to(tl.int64) * WORLD * slot
        for peer in tl.static_range(WORLD):  # this rank's row into its slot of every rank's buffer
            tl.store(tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype)) + half + rank * slot + at, x, mask=ok)
        tl.debug_barrier()  # (every thread's writes before the flags)
        for peer in tl.static_range(WORLD):
            flag = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32)) + row * WORLD + rank
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
        flags = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32)) + row * WORLD
        for peer in tl.static_range(WORLD):
            seen = tl.atomic_add(flags + peer, 0, sem="acquire", scope="sys")
            while seen == epoch - 1:
                seen = tl.atomic_add(flags + peer, 0, sem="acquire", scope="sys")
        tl.debug_barrier()  # (every thread reads after the acquire)
        mine = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype)) + half + at
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # (rank order on every rank: the same bits)
            total += tl.load(mine + peer * slot, mask=ok, other=0.0, volatile=True).to(tl.float32)
        tl.store(epoch_ptr + row, epoch)
        if NORM:
            # as `fused.rms_norm` after the all-reduce: the sum rounded, the residual added and rounded to its dtype
            x = total.to(dtype).to(tl.float32) + tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)
            x = x.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + at, x, mask=ok)
            x = x.to(tl.float32)
            y = x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            out_dtype = out_ptr.dtype.element_ty
            if not ROUND_ONCE:
                y = y.to(out_dtype).to(tl.float32)
            tl.store(out_ptr + at, (y * w.to(tl.float32)).to(out_dtype), mask=ok)
        else:
            tl.store(out_ptr + at, total.to(dtype), mask=ok)
