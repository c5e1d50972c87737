"""The decode products of the Llama-3.1-8B shape at tensor-parallel widths: the Triton skinny
GEMM (kernels/skinny_gemm.py) against cuBLAS, one row and 16, each call on the next of copies of
the weight that together outgrow the L2 cache, as a step streams its layers (`cold_copies`), and
after a norm kernel as the engine's choice times them.

    python bench/gemm_choice.py --tp-sizes 1,2,4
"""

from __future__ import annotations

import argparse

import torch

import torch.nn.functional as F

from kernels import pdl
from kernels.skinny_gemm import MAX_ROWS, after_norm_ms, cold_copies, cublas_linear, graph_ms, skinny_linear
from rollout.tools.bench import SPEED_SHAPES

def products(tp: int = 1, shape: str = "llama3-8b") -> dict[str, tuple[int, int]]:
    """A decode step's products of a speed shape, by name: (N, K) of one rank at tensor-parallel width tp."""
    c = SPEED_SHAPES[shape]
    hidden, heads_dim = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv_dim, inter = c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    return {"qkv": ((heads_dim + 2 * kv_dim) // tp, hidden), "o": (hidden, heads_dim // tp),
            "gate_up": (2 * inter // tp, hidden), "down": (hidden, inter // tp), "lm_head": (-(-c["vocab_size"] // tp), hidden)}


def cold_times(weight: torch.Tensor) -> dict[str, tuple[float, ...]]:
    """Milliseconds per product of one row and of MAX_ROWS rows, by kernel, and of one row after a
    norm kernel (what the engine's choice times)."""
    copies = cold_copies(weight)
    times = {}
    for name, fn in (("triton", skinny_linear), ("cublas", F.linear)):
        per_rows = []
        for rows in (1, MAX_ROWS):
            probe = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            per_rows.append(graph_ms(lambda: [fn(probe, w) for w in copies]) / len(copies))  # noqa: B023
        times[name] = tuple(per_rows)
    for name, fn in (("norm+triton", skinny_linear), ("norm+cublas", cublas_linear)):
        times[name] = (after_norm_ms(fn, weight.shape[1], copies, rows=1),)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp-sizes", default="1,2,4")
    args = ap.parse_args()
    pdl.set_enabled(pdl.supported(torch.device("cuda")))
    print("| tp | product | N x K | MB | cuBLAS 1 row us (TB/s) | Triton 1 row | cuBLAS 16 rows | Triton 16 rows "
          "| 1 row after RMSNorm: Triton | cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tp in map(int, args.tp_sizes.split(",")):
        for name, (n, k) in products(tp).items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            t = cold_times(w)
            mb = n * k * 2 / 1e6
            cell = lambda ms: f"{ms * 1e3:.1f} ({mb / ms / 1e3:.2f})"  # noqa: E731
            print(f"| {tp} | {name} | {n} x {k} | {mb:.0f} | {cell(t['cublas'][0])} | {cell(t['triton'][0])} | "
                  f"{cell(t['cublas'][1])} | {cell(t['triton'][1])} | "
                  f"{t['norm+triton'][0] * 1e3:.1f} | {t['norm+cublas'][0] * 1e3:.1f} |", flush=True)
            del w
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
