"""Would a few-row product split over K, its float32 partials added up by the next norm, beat cuBLAS?

The narrow products of a decode step run far from the memory bound: at b1 the Qwen3-30B-A3B
shape's o product takes cuBLAS's split-K kernel 6.8 us and its reduce 1.7 us a layer (16.8 MB:
3.5 us at 4.8 TB/s; `session-20261130d/moe-b1-kernels-head.log`), the 8B shape's down 29.3 + 1.7 us
(`session-20261130d/8b-b1-kernels.log`). Both outputs go to the residual add and RMSNorm. Here
each product runs as a step runs it (in a CUDA graph, each layer's weight from memory, under PDL)
with the norm after it, three ways: cuBLAS then the norm; the Triton few-row kernel the engine
times against cuBLAS (kernels/skinny_gemm.py) then the norm; and a kernel whose programs each take
a column block and a slice of K, writing float32 partials that the norm's kernel sums in order
(the product rounded to the dtype once, as the others round it) before it adds the residual. If
the third wins by a launch and more, issue 65's "the split-K reduction into its consumer" pays.

    python bench/probes/split_k_partials.py [--rows 1,8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from kernels import fused, pdl
from kernels.skinny_gemm import cold_copies, graph_ms, skinny_linear

SHAPES = {  # N x K
    "qwen3-30b-a3b o": (2048, 4096),
    "qwen3-30b-a3b qkv": (5120, 2048),
    "8b qkv": (6144, 4096),
    "8b o": (4096, 4096),
    "8b down": (4096, 14336),
}
CONFIGS = [dict(SPLITS=s, BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=4)
           for s, bn, (bk, st) in itertools.product((2, 4, 8), (16, 32, 64), ((128, 4), (256, 3)))]
EPS = 1e-6


@triton.jit
def _split_kernel(x_ptr, w_ptr, part_ptr, m, n, k, stride_xm, stride_wn, k_per_split, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (column block, split): its slice of K's sum for every row, float32, at part[split]."""
    pdl.wait_for_previous(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * k_per_split, tl.minimum(k, (split + 1) * k_per_split), BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < m) & (kk[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < n) & (kk[None, :] < k),
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(part_ptr + (split * m + rows[:, None]) * n + cols[None, :], acc,
             mask=(rows[:, None] < m) & (cols[None, :] < n))


@triton.jit
def _partials_norm_kernel(part_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, m, n, eps, SPLITS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A row's partials summed in split order and rounded to the dtype (the product's output), plus
    the residual, then RMSNorm rounded as kernels/fused.py's: that kernel with the reduce in front."""
    pdl.wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        x += tl.load(part_ptr + (s * m + row) * n + cols, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    x = x.to(dtype).to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=ok, other=0.0).to(tl.float32)
    x = x.to(dtype)
    tl.store(sum_ptr + row * n + cols, x, mask=ok)
    x = x.to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype),
             mask=ok)


def split_then_norm(x, weight, residual, norm_weight, config):
    m, k = x.shape
    n = weight.shape[0]
    splits = config["SPLITS"]
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    per_split = triton.cdiv(triton.cdiv(k, splits), config["BLOCK_K"]) * config["BLOCK_K"]
    launch = dict(config)
    launch.pop("SPLITS")
    _split_kernel[(triton.cdiv(n, config["BLOCK_N"]), splits)](x, weight, parts, m, n, k, x.stride(0), weight.stride(0),
                                                                per_split, BLOCK_M=16, **launch, **pdl.launch_args())
    out, summed = torch.empty_like(residual), torch.empty_like(residual)
    _partials_norm_kernel[(m,)](parts, residual, norm_weight, out, summed, m, n, EPS, SPLITS=splits,
                                BLOCK=triton.next_power_of_2(n), num_warps=4, **pdl.launch_args())
    return out, summed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    pdl.set_enabled(pdl.supported(torch.device("cuda")))  # as an engine sets it
    print("| product (N x K), rows | cuBLAS + norm us | Triton few-row + norm us | split partials + their norm us "
          "(best config) | split / cuBLAS | norm out = cuBLAS path's (max abs diff) |")
    print("|---|---|---|---|---|---|")
    for (name, (n, k)), rows in itertools.product(SHAPES.items(), map(int, args.rows.split(","))):
        g = torch.Generator(device="cuda").manual_seed(n + k + rows)
        weight = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        copies = cold_copies(weight)
        x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
        residual = torch.randn(rows, n, device="cuda", generator=g).to(dtype)
        norm_weight = torch.rand(n, device="cuda", generator=g).to(dtype)

        def timed(then_norm) -> float:
            return graph_ms(lambda: [then_norm(w) for w in copies]) / len(copies) * 1e3

        cublas = timed(lambda w: fused.rms_norm(torch.nn.functional.linear(x, w), norm_weight, EPS, residual))
        few_row = timed(lambda w: fused.rms_norm(skinny_linear(x, w), norm_weight, EPS, residual))
        best = min(((timed(lambda w, c=c: split_then_norm(x, w, residual, norm_weight, c)), c) for c in CONFIGS),
                   key=lambda t: t[0])
        want = fused.rms_norm(torch.nn.functional.linear(x, weight), norm_weight, EPS, residual)[0]
        got = split_then_norm(x, weight, residual, norm_weight, best[1])[0]
        diff = (got.float() - want.float()).abs().max().item()
        config = {key: v for key, v in best[1].items() if key != "num_warps"}
        print(f"| {name} ({n} x {k}), {rows} | {cublas:.1f} | {few_row:.1f} | {best[0]:.1f} ({config}) | "
              f"{cublas / best[0]:.2f}x | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
