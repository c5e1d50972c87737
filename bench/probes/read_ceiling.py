"""How fast can any kernel read a decode product's weight from memory on this GPU? The speed targets count
weights at the datasheet's 4.8 TB/s (H200); this measures the ceiling a step can reach instead: for each product
of a shape (the Llama-3.1-8B's by default, one rank of `--tp`), a Triton kernel that only reads and sums the weight
(by programs an SM and tile size, the best kept), torch's sum, and the one-row products a step runs (the Triton
skinny GEMM and cuBLAS), each in a CUDA graph over cold copies of the weight (kernels/skinny_gemm.py cold_copies:
twice the L2 cache, so every call reads memory), and a layer's four weights as one read: what a kernel's start and
end cost at each size. Last, the products of a whole b1 step at each rate.

    python bench/probes/read_ceiling.py [--shape llama3-8b] [--tp 1] [--bandwidth 4.8]

CPU smoke run (the interpreter; no timings): `TRITON_INTERPRET=1 python bench/probes/read_ceiling.py --device cpu`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (gemm_choice's products)

from gemm_choice import products  # noqa: E402

from kernels import sm_count  # noqa: E402
from kernels.skinny_gemm import cold_copies, cublas_linear, graph_ms, skinny_linear  # noqa: E402
from rollout.tools.bench_args import SPEED_SHAPES  # noqa: E402

PROGRAMS_PER_SM = (1, 2, 4, 8)
BLOCKS = (2048, 8192)  # elements a program loads at once


@triton.jit
def _read_kernel(w_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """Sums a strided share of the weight's elements: each program reads BLOCK contiguous elements, then the
    BLOCK after the grid's, to the end (16-byte loads; the sum keeps the loads from being dropped)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, numel, programs * BLOCK):
        acc += tl.load(w_ptr + start + offs, mask=start + offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read(weight: torch.Tensor, programs: int, block: int, out: torch.Tensor) -> torch.Tensor:
    _read_kernel[(programs,)](weight, out, weight.numel(), BLOCK=block)
    return out


def read_ms(copies: list[torch.Tensor], fn) -> float:
    """Milliseconds a call of `fn(weight)`, each of the cold copies in turn, in a CUDA graph."""
    return graph_ms(lambda: [fn(w) for w in copies]) / len(copies)


def best_read(copies: list[torch.Tensor], out: torch.Tensor) -> tuple[float, str]:
    """The read-only kernel's fastest milliseconds over its variants, and that variant."""
    sms = sm_count(copies[0].device)
    variants = {(per_sm, block): read_ms(copies, lambda w, g=per_sm * sms, b=block: read(w, g, b, out))
                for per_sm in PROGRAMS_PER_SM for block in BLOCKS}
    (per_sm, block), best = min(variants.items(), key=lambda kv: kv[1])
    return best, f"{per_sm} an SM, {block}"


def measure(name: str, n: int, k: int, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds to read one (n, k) weight: the best read-only variant, torch's sum, the two products."""
    device = torch.device(args.device)
    weight = torch.randn(n, k, device=device).to(args.dtype)
    x = torch.randn(1, k, device=device).to(args.dtype)
    out = torch.empty(max(PROGRAMS_PER_SM) * sm_count(device), dtype=torch.float32, device=device)
    if device.type != "cuda":  # the interpreter: check the read-only kernel sums what torch sums, time nothing
        got = read(weight, 3, 256, out)[:3].sum()
        want = weight.float().sum()
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-2), (got, want)
        return {}
    copies = cold_copies(weight)
    best, variant = best_read(copies, out)
    return {"read": best, "read_variant": variant, "torch_sum": read_ms(copies, lambda w: w.sum()),
            "skinny": read_ms(copies, lambda w: skinny_linear(x, w)),
            "cublas": read_ms(copies, lambda w: cublas_linear(x, w, None, None))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SPEED_SHAPES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bandwidth", type=float, default=4.8, help="the datasheet's memory bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    config = SPEED_SHAPES[args.shape]
    shapes = products(args.tp, config)
    if args.device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        import triton_kernels  # noqa: F401  (the interpreter's scalars as the tests patch them)
        for name, (n, k) in shapes.items():
            measure(name, min(n, 64), min(k, 256), args)
        print("the read-only kernel sums as torch does (interpreter)")
        return
    size = torch.tensor([], dtype=args.dtype).element_size()
    print(f"\n{args.shape}, TP{args.tp}, {args.dtype}: rate each reader reads a product's weight at, TB/s "
          f"(share of {args.bandwidth} TB/s)\n")
    print("| product | MB | read-only (best: programs an SM, block) | torch sum | skinny GEMM, 1 row | cuBLAS, 1 row |")
    print("|---|---|---|---|---|---|")
    totals = dict.fromkeys(("read", "torch_sum", "skinny", "cublas", "better", "bound"), 0.0)
    layers = config["num_hidden_layers"]
    lm_head_read = 0.0
    for name, (n, k) in shapes.items():
        ms = measure(name, n, k, args)
        nbytes = n * k * size
        rate = {r: nbytes / ms[r] / 1e9 for r in ("read", "torch_sum", "skinny", "cublas")}
        cells = [f"{rate[r]:.2f} ({rate[r] / args.bandwidth:.0%})" for r in ("read", "torch_sum", "skinny", "cublas")]
        cells[0] += f", {ms['read_variant']}"
        print(f"| {name} | {nbytes / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)
        times = 1 if name == "lm_head" else layers
        lm_head_read = ms["read"] if name == "lm_head" else lm_head_read
        for r in ("read", "torch_sum", "skinny", "cublas"):
            totals[r] += times * ms[r]
        totals["better"] += times * min(ms["skinny"], ms["cublas"])
        totals["bound"] += times * nbytes / args.bandwidth / 1e9
    layer_bytes = sum(n * k for name, (n, k) in shapes.items() if name != "lm_head") * size
    whole = torch.empty(layer_bytes // size, dtype=args.dtype, device=args.device)
    out = torch.empty(max(PROGRAMS_PER_SM) * sm_count(whole.device), dtype=torch.float32, device=whole.device)
    layer_ms, _ = best_read(cold_copies(whole), out)
    print(f"| a layer's four weights as one read | {layer_bytes / 1e6:.1f} | "
          f"{layer_bytes / layer_ms / 1e9:.2f} ({layer_bytes / layer_ms / 1e9 / args.bandwidth:.0%}) | | | |")
    at = {"the datasheet's rate": totals["bound"], "the read-only kernel's": totals["read"],
          "torch sum": totals["torch_sum"], "all skinny": totals["skinny"], "all cuBLAS": totals["cublas"],
          "the better of the two each": totals["better"],
          "each layer's weights as one read, and the LM head's": layers * layer_ms + lm_head_read}
    print(f"\na b1 step's products ({layers} layers and the LM head), ms: "
          + "; ".join(f"{what} {ms:.3f}" for what, ms in at.items()))


if __name__ == "__main__":
    main()
