"""Few-row matrix products of the Llama-3.1-8B shapes: cuBLAS against the skinny Triton kernel.

    python bench/gemm_sweep.py [--rows 1]

Prints, per layer shape, the median time of each and the weight bytes streamed per second
(at decode the bound is the weight read), and which one `kernels.skinny_gemm.linear` picks.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from kernels import skinny_gemm

SHAPES = {  # (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    print("| layer | N x K | cuBLAS ms | Triton ms | best TB/s | picked |\n|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        cublas = triton.testing.do_bench(lambda: F.linear(x, w), return_mode="median")
        ours = triton.testing.do_bench(lambda: skinny_gemm.skinny_linear(x, w), return_mode="median")
        skinny_gemm.linear(x, w)
        picked = "Triton" if skinny_gemm._use_triton[(n, k, torch.bfloat16, False)] else "cuBLAS"
        print(f"| {name} | {n} x {k} | {cublas:.4f} | {ours:.4f} | {n * k * 2 / min(cublas, ours) / 1e9:.2f} | {picked} |",
              flush=True)


if __name__ == "__main__":
    main()
