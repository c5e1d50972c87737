"""Does a decode product read its weight faster by TMA than by the skinny kernel's pointer loads?

Issue 65: the 8B shape's b1 step runs its products at 3.4-3.9 TB/s of the H200's 4.8 (TP1 216.5 tok/s
against a 299 bound). The skinny kernel (kernels/skinny_gemm.py) streams each weight tile by masked
pointer loads, after a bulk L2 prefetch of the weight's head issued before its PDL wait. Here the
same kernel loads its weight tiles through a tensor descriptor (TMA), the prefetch kept, every
config of the skinny kernel's autotune list; each product is timed as the engine's choice times it
(after an RMSNorm, in a CUDA graph, on copies of the weight that outgrow L2, PDL on) against cuBLAS
and today's tuned kernel, with its output compared bitwise with today's.

    python bench/probes/skinny_tma.py [--rows 1,16] [--tp 1,2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import pdl, skinny_gemm
from kernels.skinny_gemm import MAX_ROWS, after_kernel_ms, cold_copies, cublas_linear, prefetch_row_bytes, skinny_linear

SHAPES = {"qkv": (6144, 4096, "n"), "o": (4096, 4096, "k"), "gate_up": (28672, 4096, "n"), "down": (4096, 14336, "k")}
CONFIGS = [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3),
           (16, 128, 4, 4), (32, 64, 4, 6)]  # BLOCK_N, BLOCK_K, warps, stages (today's list within TMA's 256-wide box)


@triton.jit
def _skinny_tma_kernel(x_ptr, w_desc, w_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym, prefetch_bytes,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       PREFETCH: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        skinny_gemm._prefetch_rows(w_ptr, cols, n, stride_wn, prefetch_bytes, BLOCK_N)
    pdl.wait_for_previous(PDL)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < m) & (kk[None, :] < k),
                    other=0.0)
        acc = tl.dot(x, w_desc.load([tl.program_id(0) * BLOCK_N, k0]).T, acc)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (cols[None, :] < n))


def tma_linear(config):
    bn, bk, warps, stages = config

    def product(x, weight, bias, out_dtype):
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        prefetch = prefetch_row_bytes(weight) if bn <= 128 else 0
        _skinny_tma_kernel[(triton.cdiv(n, bn),)](x, TensorDescriptor.from_tensor(weight, [bn, bk]), weight, y, m, n, k,
                                                  x.stride(0), weight.stride(0), y.stride(0), prefetch,
                                                  BLOCK_M=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=prefetch > 0,
                                                  num_warps=warps, num_stages=stages, **pdl.launch_args())
        return y
    return product


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--tp", default="1,2")
    args = ap.parse_args()
    pdl.set_enabled(pdl.supported(torch.device("cuda")))  # as an engine sets it
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| TP | rows | product (N x K) | cuBLAS us | today us (TB/s) | TMA best us (TB/s), config | today / TMA | bits |")
    print("|---|---|---|---|---|---|---|---|")
    for tp in map(int, args.tp.split(",")):
        for rows in map(int, args.rows.split(",")):
            totals = [0.0, 0.0]  # the engine's choice (the faster of cuBLAS and today's kernel), TMA's best
            for name, (n, k, split) in SHAPES.items():
                n, k = (n // tp, k) if split == "n" else (n, k // tp)
                w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
                copies = cold_copies(w)
                x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
                cublas = after_kernel_ms(cublas_linear, k, copies, rows=rows) * 1e3
                today = after_kernel_ms(skinny_linear, k, copies, rows=rows) * 1e3
                expected = skinny_linear(x, w)
                timed = []
                for config in CONFIGS:
                    try:
                        same = torch.equal(tma_linear(config)(x, w, None, None), expected)
                        timed.append((after_kernel_ms(tma_linear(config), k, copies, rows=rows) * 1e3, config, same))
                    except Exception as e:  # noqa: BLE001 (a config Triton cannot build here is reported)
                        print(f"| {tp} | {rows} | {name} {config} | failed: {type(e).__name__}: {str(e)[:100]} |")
                best = min(timed)
                gbs = w.nbytes / 1e6
                print(f"| {tp} | {rows} | {name} ({n} x {k}) | {cublas:.1f} | {today:.1f} ({gbs / today:.2f}) | "
                      f"{best[0]:.1f} ({gbs / best[0]:.2f}), {best[1]} | {today / best[0]:.2f}x | "
                      f"{all(t[2] for t in timed)} |", flush=True)
                totals = [totals[0] + min(cublas, today), totals[1] + best[0]]
                del copies
            print(f"| {tp} | {rows} | a layer's four: the engine's choice {totals[0]:.1f} us, TMA {totals[1]:.1f} | | | | "
                  f"{totals[0] / totals[1]:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
