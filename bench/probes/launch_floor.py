"""What a kernel costs a decode step before it does any work: a chain of tiny kernels in one CUDA graph, each
reading what the one before wrote (as a step's kernels do), with programmatic dependent launch off and on, at one
program and at one program an SM. A b1 decode step of the Qwen3-30B-A3B shape launches some 550 kernels (11-12 a
layer x 48, then the LM head and sampling), the Llama-3.1-8B shape's some 300: the chain's time at that many kernels
is the part of a b1 step that no faster product removes, only fewer kernels.

    python bench/probes/launch_floor.py [--kernels 100,300,550] [--programs 1,132]

`--programs` 0 stands for one program an SM. CPU smoke run (the interpreter; no timings, no PDL):
`TRITON_INTERPRET=1 python bench/probes/launch_floor.py --device cpu`.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kernels import pdl, sm_count


@triton.jit
def _link_kernel(x_ptr, PDL: tl.constexpr):
    """One link of the chain: each program adds one to its element, which the link before wrote."""
    pdl.wait_for_previous(PDL)
    at = x_ptr + tl.program_id(0)
    tl.store(at, tl.load(at) + 1.0)


def chain(x: torch.Tensor, kernels: int, use_pdl: bool) -> None:
    launch = {"PDL": True, "launch_pdl": True} if use_pdl else {"PDL": False}
    for _ in range(kernels):
        _link_kernel[(x.numel(),)](x, **launch)


def chain_ms(x: torch.Tensor, kernels: int, use_pdl: bool) -> float:
    """Milliseconds a replay of the chain takes in one CUDA graph (the median of do_bench's replays)."""
    chain(x, kernels, use_pdl)  # (compiled outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(x, kernels, use_pdl)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="100,300,550")
    ap.add_argument("--programs", default="1,0", help="programs a kernel; 0: one an SM")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    counts = [int(k) for k in args.kernels.split(",")]
    grids = [int(p) or sm_count(device) for p in args.programs.split(",")]
    if device.type != "cuda":  # the interpreter: each chain once, checked, untimed
        for programs in grids:
            x = torch.zeros(programs, device=device)
            chain(x, counts[0], use_pdl=False)
            assert torch.equal(x, torch.full_like(x, counts[0])), x
        print(f"chains of {counts[0]} links at {grids} programs: every element counted every link")
        return
    modes = [False, True] if pdl.supported(device) else [False]
    print("| kernels | programs a kernel | PDL | ms the chain | us a kernel |\n|---|---|---|---|---|")
    for programs in grids:
        for use_pdl in modes:
            for kernels in counts:
                x = torch.zeros(programs, device=device)
                ms = chain_ms(x, kernels, use_pdl)
                print(f"| {kernels} | {programs} | {'on' if use_pdl else 'off'} | {ms:.3f} | {1e3 * ms / kernels:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
