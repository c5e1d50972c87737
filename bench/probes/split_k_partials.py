"""Would a few-row product split over K, its float32 partials added up by the next norm, beat cuBLAS?

The narrow products of a decode step run far from the memory bound: at b1 the Qwen3-30B-A3B
shape's o product takes cuBLAS's split-K kernel 6.8 us and its reduce 1.7 us a layer (16.8 MB:
3.5 us at 4.8 TB/s; `session-20261130d/moe-b1-kernels-head.log`), the 8B shape's down 29.3 + 1.7 us
(`session-20261130d/8b-b1-kernels.log`). Both outputs go to the residual add and RMSNorm. Here
each product runs as a step runs it (in a CUDA graph, each layer's weight from memory, under PDL)
with the norm after it, three ways: cuBLAS then the norm; the Triton few-row kernel the engine
times against cuBLAS (kernels/skinny_gemm.py) then the norm; and the engine's split kernel
(`split_k_partials`: its programs each take a column block and a slice of K, writing float32
partials) over its configurations, the norm summing the partials in order (the product rounded to
the dtype once, as the others round it) before it adds the residual: the third is what
`linear_into_sum` chooses where it wins (on the H200 by 1.04-1.26x: session-20261201c).

    python bench/probes/split_k_partials.py [--rows 1,8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from kernels import fused, pdl, skinny_gemm
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


def split_then_norm(x, weight, residual, norm_weight, config):
    """The engine's split kernel (kernels/skinny_gemm.py `split_k_partials`) at `config`, then the norm that adds up
    its partial sums (`fused.rms_norm`)."""
    m, k = x.shape
    n = weight.shape[0]
    launch = dict(config)
    slices = launch.pop("SPLITS")
    parts = torch.empty(m, slices, n, dtype=torch.float32, device=x.device)
    skinny_gemm._split_k_kernel[(triton.cdiv(n, config["BLOCK_N"]), slices)](
        x, weight, parts, m, n, k, x.stride(0), weight.stride(0), SLICES=slices, BLOCK_M=16, **launch,
        **pdl.launch_args())
    return fused.rms_norm(parts, norm_weight, EPS, residual)


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
