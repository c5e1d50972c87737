"""One Qwen3-30B-A3B MoE layer's kernels timed alone, against the weights they must read at 4.8 TB/s.

    python bench/moe_kernels.py [--rows 1,8,32,64,256,512,4096] [--dtype bfloat16] [--blocks 16,32,64,128]
    python bench/moe_kernels.py --route-warps 1,2,4   # the routing alone, by its programs' warps
    python bench/moe_kernels.py --parts               # the fused path's kernels one by one, each against its bound
    python bench/moe_kernels.py --parts --retune      # the same, the products' tiles chosen anew at each row count

Per row count (a decode step's rows, or a prefill's tokens): microseconds of the routing (top-k
and placement; where a step is small enough to route in one program, also in the two kernels a
larger step takes), of the fused path whole (at the block of rows `block_rows` picks, and at each
block of `--blocks`), and of the torch reference (every expert over every
row) where it runs in reasonable time; and the bound: the
distinct experts the rows took times one expert's bytes, over 4.8 TB/s. Each call is replayed
in a CUDA graph (as a decode step runs it), on a layer's own weights (48 layers' worth would not
sit in the L2 cache either: one expert is 9.4 MB).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import triton.testing

from kernels import fused_moe, pdl

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
BANDWIDTH = 4.8e12


def graph_us(fn, calls: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median") * 1e3 / calls


@contextlib.contextmanager
def patched(name: str, value):
    """fused_moe's `name` set to `value` while graphs are captured: the choices it makes per call."""
    old = getattr(fused_moe, name)
    setattr(fused_moe, name, value)
    try:
        yield
    finally:
        setattr(fused_moe, name, old)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,256,512,4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks", default="16,32,64,128", help="rows per block to time the fused path at, besides the rule's")
    ap.add_argument("--route-warps", default="", help="instead: the routing's us by warps a program (fused_moe.ROUTE_WARPS)")
    ap.add_argument("--parts", action="store_true", help="instead: each kernel of the fused path alone, against its bound")
    ap.add_argument("--retune", action="store_true",
                    help="with --parts: the products' autotuner forgets its tiles before each row count")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    pdl.set_enabled(pdl.supported(torch.device(dev)))  # as an engine sets it
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=dev) / HIDDEN**0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=dev) / WIDTH**0.5).to(dtype)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    blocks = [int(b) for b in args.blocks.split(",") if b]
    if args.route_warps:
        return routing_by_warps(args, dtype, [int(w) for w in args.route_warps.split(",")])
    if args.parts:
        return parts(args, dtype, gate_up, down)
    print("| rows | routing us | routing us, two kernels | block | fused us | " + " | ".join(f"fused us, block {b}" for b in blocks)
          + " | reference us | bound us | fused / bound |")
    print("|---" * (8 + len(blocks)) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        h = torch.randn(rows, HIDDEN, device=dev).to(dtype)
        logits = torch.randn(rows, EXPERTS, device=dev).to(dtype)
        call = (h, logits, gate_up, down, TOP_K, True)
        route = graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype))
        two = "-"
        if rows <= fused_moe.ONE_PROGRAM_ROUTE_ROWS:
            with patched("ONE_PROGRAM_ROUTE_ROWS", 0):
                two = f"{graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype)):.1f}"
        fused = graph_us(lambda: fused_moe.experts(*call))
        by_block = []
        for b in blocks:
            with patched("block_rows", lambda assignments, experts, b=b: b):
                by_block.append(f"{graph_us(lambda: fused_moe.experts(*call)):.1f}")
        ref = f"{graph_us(lambda: fused_moe.experts_ref(*call), calls=2):.0f}" if rows <= 64 else "-"
        distinct = len(torch.unique(fused_moe.route(logits, TOP_K, True, dtype).ids))
        bound = distinct * expert_bytes / BANDWIDTH * 1e6
        block = fused_moe.block_rows(rows * TOP_K, EXPERTS)
        print(f"| {rows} | {route:.1f} | {two} | {block} | {fused:.1f} | " + " | ".join(by_block)
              + f" | {ref} | {bound:.1f} | {fused / bound:.2f} |", flush=True)


def parts(args: argparse.Namespace, dtype: torch.dtype, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """The fused path's kernels one at a time in a CUDA graph (the routing, the gate/up product with
    SiLU, the down product, the combine), us, each beside the bytes it must move at 4.8 TB/s: the
    distinct experts' gate/up or down weights (the products' outputs and gathered rows besides),
    the picks read and the rows written (the combine). The products' tiles are the autotuner's, keyed
    by the block of rows, not the row count: a step of 64 rows takes the blocks of 16 that 1 row
    took, and the tile timed there (in an engine at its first graph's warm-up), unless `--retune`
    has them chosen again at each row count; the last column names the tiles used."""
    print("| rows | routing us | gate/up us (bound) | down us (bound) | combine us (bound) | sum | fused whole | tiles: "
          "gate/up; down |")
    print("|---|---|---|---|---|---|---|---|")
    size = gate_up.element_size()
    tuner = fused_moe._expert_gemm_tuned
    for rows in (int(r) for r in args.rows.split(",")):
        if args.retune:
            tuner.cache.clear()
        h = torch.randn(rows, HIDDEN, device="cuda").to(dtype)
        logits = torch.randn(rows, EXPERTS, device="cuda").to(dtype)
        route = fused_moe.route(logits, TOP_K, True, dtype)
        mid = torch.empty(rows * TOP_K, WIDTH, dtype=dtype, device="cuda")
        picks = torch.empty(rows * TOP_K, HIDDEN, dtype=dtype, device="cuda")
        out = torch.empty_like(h)
        distinct = len(torch.unique(route.ids))
        timed = {
            "route": graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype)),
            "gate_up": graph_us(lambda: fused_moe._expert_gemm(route, h, gate_up, mid, gated=True, invariant=False)),
            "down": graph_us(lambda: fused_moe._expert_gemm(route, mid, down, picks, gated=False, invariant=False)),
            "combine": graph_us(lambda: fused_moe.combine(picks, out, TOP_K)),
        }
        bound = {"gate_up": distinct * gate_up[0].numel() * size, "down": distinct * down[0].numel() * size,
                 "combine": (picks.numel() + out.numel()) * size}
        bound = {name: b / BANDWIDTH * 1e6 for name, b in bound.items()}
        whole = graph_us(lambda: fused_moe.experts(h, logits, gate_up, down, TOP_K, True))
        cells = " | ".join(f"{timed[n]:.1f} ({bound[n]:.1f})" for n in ("gate_up", "down", "combine"))
        tiles = "; ".join(tile_name(config) for n, k, gated in ((WIDTH, HIDDEN, True), (HIDDEN, WIDTH, False))
                          for key, config in tuner.cache.items()  # (its key: n, k, BLOCK_M, GATED, then dtypes)
                          if tuple(key[:4]) == (n, k, route.block, gated))
        print(f"| {rows} | {timed['route']:.1f} | {cells} | {sum(timed.values()):.1f} | {whole:.1f} | {tiles} |",
              flush=True)


def tile_name(config) -> str:
    tma = "/TMA" if config.kwargs.get("W_TMA") else ""
    return f"{config.kwargs['BLOCK_N']}x{config.kwargs['BLOCK_K']}/{config.num_warps}w/{config.num_stages}s{tma}"


def routing_by_warps(args: argparse.Namespace, dtype: torch.dtype, warps: list[int]) -> None:
    """The routing's microseconds at each row count, by warps a program (ROUTE_WARPS and
    FEW_ROUTE_WARPS alike): in one program where the step is small enough, its tile of as many
    rows as the step's (up to FEW_ROUTE_ROWS) and of ROUTE_ROWS, and in the two kernels a larger
    step takes."""
    print("| rows | " + " | ".join(f"{w} warps: one program, rows' tile / 16-row tile / two kernels us" for w in warps)
          + " |")
    print("|---" * (1 + len(warps)) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, EXPERTS, device="cuda").to(dtype)
        cells = []
        for w in warps:
            with patched("ROUTE_WARPS", w), patched("FEW_ROUTE_WARPS", w):
                one = graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype))
                with patched("FEW_ROUTE_ROWS", 0):
                    wide = graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype))
                with patched("ONE_PROGRAM_ROUTE_ROWS", 0), patched("FEW_ROUTE_ROWS", 0):
                    two = graph_us(lambda: fused_moe.route(logits, TOP_K, True, dtype))
            small = rows <= fused_moe.ONE_PROGRAM_ROUTE_ROWS
            cells.append(f"{one:.1f} / {wide:.1f} / {two:.1f}" if small else f"- / - / {two:.1f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
