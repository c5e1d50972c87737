"""One Qwen3-30B-A3B MoE layer's kernels timed alone, against the weights they must read at 4.8 TB/s.

    python bench/moe_kernels.py [--rows 1,8,64,512,4096] [--dtype bfloat16]

Per row count (a decode step's rows, or a prefill's tokens): microseconds of the routing (top-k
and placement), of the fused path whole, and of the torch reference (every expert over every
row) where it runs in reasonable time; and the bound: the
distinct experts the rows took times one expert's bytes, over 4.8 TB/s. Each call is replayed
in a CUDA graph (as a decode step runs it), on a layer's own weights (48 layers' worth would not
sit in the L2 cache either: one expert is 9.4 MB).
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,512,4096")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    pdl.set_enabled(pdl.supported(torch.device(dev)))  # as an engine sets it
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=dev) / HIDDEN**0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=dev) / WIDTH**0.5).to(dtype)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    print("| rows | routing us | fused us | reference us | bound us | fused / bound |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        h = torch.randn(rows, HIDDEN, device=dev).to(dtype)
        logits = torch.randn(rows, EXPERTS, device=dev).to(dtype)
        call = (h, logits, gate_up, down, TOP_K, True)
        route = graph_us(lambda: fused_moe.Route(logits, TOP_K, True, dtype))
        fused = graph_us(lambda: fused_moe.experts(*call))
        ref = f"{graph_us(lambda: fused_moe.experts_ref(*call), calls=2):.0f}" if rows <= 64 else "-"
        distinct = len(torch.unique(fused_moe.Route(logits, TOP_K, True, dtype).ids))
        bound = distinct * expert_bytes / BANDWIDTH * 1e6
        print(f"| {rows} | {route:.1f} | {fused:.1f} | {ref} | {bound:.1f} | {fused / bound:.2f} |", flush=True)

if __name__ == "__main__":
    main()
