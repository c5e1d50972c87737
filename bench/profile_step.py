"""Where a decode step's time goes: GPU graph replay alone vs the engine's host phases.

    python bench/profile_step.py [--batch 1] [--spec off] [--no-overlap] [--no-skinny-gemm] [--no-pdl]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from rollout import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="off")
    ap.add_argument("--model", default="default")
    ap.add_argument("--no-overlap", action="store_true", help="wait for every step's tokens (no overlap schedule)")
    ap.add_argument("--no-skinny-gemm", action="store_true", help="every product on cuBLAS (kernels/skinny_gemm.py off)")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch (kernels/pdl.py)")
    args = ap.parse_args()
    if args.no_skinny_gemm:
        import torch.nn.functional as F

        from kernels import skinny_gemm

        skinny_gemm.linear = lambda x, weight, bias=None: F.linear(x, weight, bias)
    eng = Engine(model=args.model, spec=args.spec, kv_cache_tokens=200_000, overlap_schedule=not args.no_overlap,
                 pdl=not args.no_pdl)
    prompts = [[100 + i, 200, 300, 400] * 16 for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    eng.generate(prompts, params)  # warm up: compile, capture

    # host phases of the engine step, by wrapping the pieces it calls
    spent = defaultdict(float)

    def timed(obj, name, label):
        fn = getattr(obj, name, None)
        if fn is None:  # a phase this version of the engine does not have (see bench/ab_versions.sh)
            return
        spent.setdefault(label, 0.0)  # printed in this order

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[label] += time.perf_counter() - t
            return out

        setattr(obj, name, wrapper)

    timed(eng.scheduler, "schedule", "schedule")
    for layout in ("_decode_layout", "_tree_layout", "_prefill_layout"):
        timed(eng.runner, layout, "layout")
    if eng.runner.graphs is not None:
        timed(eng.runner.graphs, "launch", "graph replay (launch)")
    timed(eng.runner, "_sample", "eager sample")
    timed(eng.runner, "_chain", "chain (inputs after a step in flight)")
    timed(eng.runner, "collect", "collect (wait + emit)")
    timed(eng.runner, "_emit", "emit")
    timed(eng.runner, "_emit_trees", "emit")
    timed(eng, "_append", "append (stops, drafter)")
    if eng.drafter is not None:
        timed(eng.budget, "for_batch", "draft budget (plan)")
        timed(eng, "_draft", "draft")
        timed(eng.upkeep, "apply", "drafter upkeep (shadow)")
        # lifecycle updates run inside the upkeep, shadow or not: a new prompt's trie is built there
        for update in ("add_group", "add_sequence", "remove_sequence", "remove_group"):
            timed(eng.drafter, update, "  of which lifecycle updates")
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.step_times_ms.clear()
    t0 = time.perf_counter()
    steps = 0
    while not all(r.finished for r in reqs):
        eng.step()
        steps += 1
    total = time.perf_counter() - t0
    print(f"batch {args.batch} spec {args.spec} overlap {not args.no_overlap}: {steps} steps, {total / steps * 1e3:.3f} ms/step")
    for k, v in spent.items():
        print(f"  {k:28s} {v / steps * 1e3:.3f} ms/step")
    p10, p50, p90 = (float(x) for x in np.percentile(eng.step_times_ms, [10, 50, 90]))
    print(f"  step ms p10 / p50 / p90       {p10:.3f} / {p50:.3f} / {p90:.3f}")

    if eng.runner.graphs is None:  # on the CPU: the host phases are all there is to show
        return
    # every captured graph alone, replayed back to back: the device time of each step shape
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for shape, graph in sorted(eng.runner.graphs._graphs.items()):
        start.record()
        for _ in range(50):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"  graph replay alone {str(shape):28s} {start.elapsed_time(end) / 50:.3f} ms")
    g = eng.runner.graphs._graphs[min(eng.runner.graphs._graphs)]

    # kernels inside that graph, by total GPU time
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.graph.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
