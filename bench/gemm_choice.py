"""The decode products of the Llama-3.1-8B shape at tensor-parallel widths: the Triton skinny
GEMM (kernels/skinny_gemm.py) against cuBLAS, one row and 16, each call on the next of copies of
the weight that together outgrow the L2 cache, as a step streams its layers (`cold_copies`); then
one row after a kernel, as a step runs them: after a norm (what the engine's choice times) and
after a kernel that only waits (as the all-reduce + norm and a short attention do), with the
Triton kernel's weight prefetch at several sizes (`--prefetch-mib`; 0: none).

    python bench/gemm_choice.py --tp-sizes 1,2,4
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl, skinny_gemm
from kernels.skinny_gemm import MIN_BLOCK_ROWS, after_kernel_ms, cold_copies, cublas_linear, graph_ms, skinny_linear
from rollout.tools.bench_args import SPEED_SHAPES


def products(tp: int = 1, config: dict | None = None) -> dict[str, tuple[int, int]]:
    """A decode step's products of an HF config (the Llama-3.1-8B speed shape's by default), by
    name: (N, K) of one rank at tensor-parallel width tp."""
    c = config or SPEED_SHAPES["llama3-8b"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    hidden, heads_dim = c["hidden_size"], c["num_attention_heads"] * head_dim
    kv_dim, inter = c["num_key_value_heads"] * head_dim, c["intermediate_size"]
    return {"qkv": ((heads_dim + 2 * kv_dim) // tp, hidden), "o": (hidden, heads_dim // tp),
            "gate_up": (2 * inter // tp, hidden), "down": (hidden, inter // tp), "lm_head": (-(-c["vocab_size"] // tp), hidden)}


@triton.jit
def _wait_kernel(cycles, PDL: tl.constexpr):
    """One program that spins `cycles` SM clocks, touching no memory."""
    pdl.wait_for_previous(PDL)
    start = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = start
    while now - start < cycles:
        now = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


def waiting(cycles: int) -> None:
    _wait_kernel[(1,)](cycles, num_warps=1, **pdl.launch_args())


def cold_times(copies: list[torch.Tensor]) -> dict[str, tuple[float, ...]]:
    """Milliseconds per product of one row and of MIN_BLOCK_ROWS (16) rows, by kernel, on each of `copies` in turn."""
    weight, times = copies[0], {}
    for name, fn in (("triton", skinny_linear), ("cublas", F.linear)):
        per_rows = []
        for rows in (1, MIN_BLOCK_ROWS):
            probe = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            per_rows.append(graph_ms(lambda: [fn(probe, w) for w in copies]) / len(copies))  # noqa: B023
        times[name] = tuple(per_rows)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp-sizes", default="1,2,4")
    ap.add_argument("--prefetch-mib", default="0,8,16,32")
    ap.add_argument("--wait-cycles", type=int, default=12000, help="the waiting kernel's length (its us are printed)")
    args = ap.parse_args()
    pdl.set_enabled(pdl.supported(torch.device("cuda")))
    budgets = [int(b) for b in args.prefetch_mib.split(",")]
    default_prefetch = skinny_gemm.PREFETCH_BYTES
    wait_us = graph_ms(lambda: waiting(args.wait_cycles)) * 1e3
    print(f"waiting kernel alone: {wait_us:.1f} us; prefetch MiB {budgets}; pairs in us (the kernel before included)")
    print("| tp | product | N x K | MB | cuBLAS 1 row us (TB/s) | Triton 1 row | cuBLAS 16 rows | Triton 16 rows "
          "| after RMSNorm: cuBLAS | Triton by prefetch | after waiting: cuBLAS | Triton by prefetch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tp in map(int, args.tp_sizes.split(",")):
        for name, (n, k) in products(tp).items():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            copies = cold_copies(w)
            t = cold_times(copies)
            cells = []
            for before in (None, lambda: waiting(args.wait_cycles)):  # (None: an RMSNorm)
                cells.append(f"{after_kernel_ms(cublas_linear, k, copies, rows=1, before=before) * 1e3:.1f}")
                triton_us = []
                for budget in budgets:
                    skinny_gemm.PREFETCH_BYTES = budget << 20
                    triton_us.append(f"{after_kernel_ms(skinny_linear, k, copies, rows=1, before=before) * 1e3:.1f}")
                skinny_gemm.PREFETCH_BYTES = default_prefetch
                cells.append(" / ".join(triton_us))
            mb = n * k * 2 / 1e6
            cell = lambda ms: f"{ms * 1e3:.1f} ({mb / ms / 1e3:.2f})"  # noqa: E731
            print(f"| {tp} | {name} | {n} x {k} | {mb:.0f} | {cell(t['cublas'][0])} | {cell(t['triton'][0])} | "
                  f"{cell(t['cublas'][1])} | {cell(t['triton'][1])} | " + " | ".join(cells) + " |", flush=True)
            del w, copies
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
