"""Whether fp16 products are slower than bf16 ones of the same shape on this GPU, and why: the
Llama-3.1-8B shape's four layer products and its LM head at 512 rows (a b512 decode step), each
timed in turns by dtype (a CUDA graph of 20 calls, random normal inputs), with the SM clock and
the board's power sampled by nvidia-smi while it runs. Issue 62 found every cuBLAS product of
the b512 step 6-8% slower in fp16 with the same kernels chosen (bench/RESULTS.md).

    python bench/probes/half_gemm_clocks.py [--rows 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (N, K)
CALLS = 20


def timed(rows: int, n: int, k: int, dtype: torch.dtype, seconds: float = 1.5) -> tuple[float, float, float]:
    """us per product, and the median SM clock (MHz) and power (W) sampled while it ran for `seconds`."""
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    w = torch.randn(n, k, dtype=dtype, device="cuda") * k**-0.5
    out = torch.empty(rows, n, dtype=dtype, device="cuda")
    torch.mm(x, w.t(), out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            torch.mm(x, w.t(), out=out)
    graph.replay()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, replays = time.perf_counter(), 0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            graph.replay()
        replays += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    clocks = [float(c) for c, _ in samples[2:]] or [0.0]  # (the first samples may precede the load)
    power = [float(p) for _, p in samples[2:]] or [0.0]
    us = begin.elapsed_time(end) * 1e3 / (replays * CALLS)
    return us, statistics.median(clocks), statistics.median(power)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, {args.rows} rows, medians of {args.rounds} rounds in turns")
    print("| product (N x K) | bf16 us | fp16 us | fp16 / bf16 time | bf16 TFLOP/s | SM MHz bf16 / fp16 | W bf16 / fp16 |\n"
          "|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        runs = {torch.bfloat16: [], torch.float16: []}
        for _ in range(args.rounds):
            for dtype in runs:
                runs[dtype].append(timed(args.rows, n, k, dtype))
        med = {d: [statistics.median(r[i] for r in rs) for i in range(3)] for d, rs in runs.items()}
        (b_us, b_mhz, b_w), (h_us, h_mhz, h_w) = med[torch.bfloat16], med[torch.float16]
        tflops = 2 * args.rows * n * k / b_us / 1e6
        print(f"| {name} ({n} x {k}) | {b_us:.1f} | {h_us:.1f} | {h_us / b_us:.3f} | {tflops:.0f} | {b_mhz:.0f} / {h_mhz:.0f} "
              f"| {b_w:.0f} / {h_w:.0f} |", flush=True)


if __name__ == "__main__":
    main()
