"""Where a tensor-parallel decode step's time goes: one sequence of the Llama-3.1-8B shape (random
weights), decode steps' wall, device and host time (Engine.step_log, medians), by setting; and where
one request's time went: its prefill, its decode steps, their slowest, and the time outside steps.

    python bench/tp_profile.py --tp-sizes 1,2 --variants default,no-pdl,no-overlap,no-graphs
    python bench/tp_profile.py --tp-sizes 1,2 --kernels 14   # rank 0's kernels per decode step (eager)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout import Engine, SamplingParams
from rollout.tools.bench import speed_model_dir

VARIANTS = {"default": {}, "no-pdl": {"pdl": False}, "no-overlap": {"overlap_schedule": False},
            "no-graphs": {"cuda_graphs": False}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kernels", type=int, default=0, metavar="K", help="instead: rank 0's K costliest kernels per step")
    args = ap.parse_args()
    model = speed_model_dir(args.shape)
    if args.kernels:
        return kernel_tables(model, args)
    print("| tp | variant | step ms | device ms | host ms | tok/s | run ms | prefill ms | decode steps ms | slowest step ms "
          "| outside steps ms |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for tp in map(int, args.tp_sizes.split(",")):
        for variant in args.variants.split(","):
            engine = Engine(model=model, load_format="dummy", spec="off", tp_size=tp, max_running_seqs=8,
                            kv_cache_tokens=20_000, **VARIANTS[variant])
            params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
            for _ in range(2):  # the first run warms up
                engine.reset_stats()
                start = time.perf_counter()
                engine.generate([list(range(100, 228))], params)
                run_ms = (time.perf_counter() - start) * 1e3
            steps = [r for r in engine.step_log if not r.prefill]
            prefill = sum(r.wall_ms for r in engine.step_log if r.prefill)
            med = lambda k: statistics.median(getattr(r, k) for r in steps)  # noqa: E731
            walls = sum(r.wall_ms for r in steps)
            print(f"| {tp} | {variant} | {med('wall_ms'):.2f} | {med('device_ms'):.2f} | {med('host_ms'):.2f} | "
                  f"{1e3 / med('wall_ms'):.1f} | {run_ms:.1f} | {prefill:.1f} | {walls:.1f} | "
                  f"{max(r.wall_ms for r in steps):.1f} | {run_ms - prefill - walls:.1f} |", flush=True)
            engine.close()
            del engine


def kernel_tables(model: str, args: argparse.Namespace) -> None:
    """Eager decode steps under torch.profiler: rank 0's kernels, us per step, costliest first (in
    a CUDA graph the same kernels run, without the launch gaps). Without PDL: a kernel launched
    early would count its wait for the one before. A collective counts its wait for the other ranks."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
    print("| tp | kernel | per step | us per step |\n|---|---|---|---|", flush=True)
    for tp in map(int, args.tp_sizes.split(",")):
        engine = Engine(model=model, load_format="dummy", spec="off", tp_size=tp, max_running_seqs=8,
                        kv_cache_tokens=20_000, cuda_graphs=False, pdl=False)
        engine.generate([list(range(100, 228))], params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate([list(range(100, 228))], params)
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
                          if e.self_device_time_total > 0), key=lambda k: -k[2])
        total = sum(k[2] for k in kernels) / args.tokens
        for name, count, us in kernels[: args.kernels]:
            print(f"| {tp} | {name[:70]} | {count / args.tokens:.0f} | {us / args.tokens:.1f} |", flush=True)
        print(f"| {tp} | all {len(kernels)} kernels | | {total:.1f} |", flush=True)
        engine.close()
        del engine


if __name__ == "__main__":
    main()
