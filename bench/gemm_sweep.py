"""Few-row matrix products of the Llama-3.1-8B shapes: cuBLAS against the skinny Triton kernel.

    python bench/gemm_sweep.py [--rows 1] [--pdl]

Prints, per layer shape, the median time of each (back to back inside a CUDA graph, as the
choice is timed) and the weight bytes streamed per second (at decode the bound is the weight
read), and which one `kernels.skinny_gemm.linear` picks.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels import pdl, skinny_gemm

SHAPES = {  # (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--pdl", action="store_true", help="programmatic dependent launch (kernels/pdl.py)")
    args = ap.parse_args()
    pdl.set_enabled(args.pdl)
    print("| layer | N x K | cuBLAS ms | Triton ms | best TB/s | picked |\n|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        cublas = skinny_gemm._graph_ms(lambda: F.linear(x, w))
        ours = skinny_gemm._graph_ms(lambda: skinny_gemm.skinny_linear(x, w))
        skinny_gemm.linear(x, w)
        picked = "Triton" if skinny_gemm._use_triton[(n, k, torch.bfloat16, False, args.pdl)] else "cuBLAS"
        print(f"| {name} | {n} x {k} | {cublas:.4f} | {ours:.4f} | {n * k * 2 / min(cublas, ours) / 1e9:.2f} | {picked} |",
              flush=True)


if __name__ == "__main__":
    main()
