"""Where a decode step's time goes: GPU graph replay alone vs the engine's host phases.

    python bench/profile_step.py [--batch 1] [--spec off] [--workload repeat|grpo|sharegpt] [--temperature 0]
                                 [--random-model llama3-8b]
                                 [--sharegpt-file F] [--build-chunk N] [--poll-every N]
                                 [--cprofile] [--no-overlap] [--no-skinny-gemm] [--no-pdl]

`repeat` (default): every sequence a repeating 64-token prompt, 200 tokens, EOS ignored.
`grpo`: `rollout bench`'s grpo workload (mixed prompts, 8 samples each, 256 tokens, EOS ends
a sample), so the batch shrinks as samples finish, as in the benchmark. `sharegpt`: as
`rollout bench --workload sharegpt` (first-turn chat prompts, one sample each, 256 tokens).
The run is timed from admission on, as the benchmark times it; what the steps' costs do not
account for (admission, the loop between steps) is printed apart. `--build-chunk` and
`--poll-every` override spec/upkeep.py's constants of the same names. `--cprofile` adds the
host functions that took the most time over the timed run (cProfile slows the host down, so
its shares matter, not its times). "graph replay alone" replays each graph with the inputs
its last step left, which differ between shapes (see below).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from collections import defaultdict

import numpy as np
import torch

from rollout import Engine, SamplingParams
from rollout.bench import GcTimer, speed_model_dir, workload_prompts
from rollout.engine import freeze_heap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="off")
    ap.add_argument("--model", default="default")
    ap.add_argument("--random-model", default=None, help="random weights of a speed shape (rollout bench's names)")
    ap.add_argument("--workload", choices=["repeat", "grpo", "sharegpt"], default="repeat")
    ap.add_argument("--sharegpt-file", default=None, help="sharegpt: a ShareGPT JSON/JSONL file")
    ap.add_argument("--build-chunk", type=int, default=None, help="prompt tokens built into a trie between polls")
    ap.add_argument("--poll-every", type=int, default=None, help="sequences fed between polls")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cprofile", action="store_true", help="also profile the host's functions (slower steps)")
    ap.add_argument("--no-overlap", action="store_true", help="wait for every step's tokens (no overlap schedule)")
    ap.add_argument("--no-skinny-gemm", action="store_true", help="every product on cuBLAS (kernels/skinny_gemm.py off)")
    ap.add_argument("--no-pdl", action="store_true", help="no programmatic dependent launch (kernels/pdl.py)")
    args = ap.parse_args()
    if args.no_skinny_gemm:
        import torch.nn.functional as F

        from kernels import skinny_gemm

        skinny_gemm.linear = lambda x, weight, bias=None: F.linear(x, weight, bias)
    from spec import upkeep

    upkeep.BUILD_CHUNK = args.build_chunk or upkeep.BUILD_CHUNK
    upkeep.POLL_EVERY = args.poll_every or upkeep.POLL_EVERY
    model, load_format = args.model, "auto"
    if args.random_model:
        model, load_format = speed_model_dir(args.random_model), "dummy"
    eng = Engine(model=model, spec=args.spec, kv_cache_tokens=200_000, overlap_schedule=not args.no_overlap,
                 pdl=not args.no_pdl, load_format=load_format)
    if args.workload in ("grpo", "sharegpt"):
        wl = argparse.Namespace(workload=args.workload, n=8, prompt_set="mixed", seed=0,
                                sharegpt_file=args.sharegpt_file, max_prompt_len=1024)
        prompts, n = workload_prompts(wl, eng.tokenizer, args.batch)
        params = SamplingParams(n=n, temperature=args.temperature, max_new_tokens=256, seed=0)
    else:
        prompts = [[100 + i, 200, 300, 400] * 16 for i in range(args.batch)]
        params = SamplingParams(temperature=args.temperature, max_new_tokens=200, ignore_eos=True, seed=0)
    eng.generate(prompts, params)  # warm up: compile, capture
    if eng.drafter is not None:
        eng.clear_speculation_history()  # as `rollout bench` does: no drafting from the warm-up
    freeze_heap()  # as the server and `rollout bench` do

    # host phases of the engine step, by wrapping the pieces it calls
    spent = defaultdict(float)
    calls = defaultdict(int)
    # step index -> label -> seconds; a phase counts toward the step whose completion comes next,
    # as the step's cost does (under the overlap schedule, a step's cost holds the next one's launch)
    by_step = defaultdict(lambda: defaultdict(float))

    def timed(obj, name, label):
        fn = getattr(obj, name, None)
        if fn is None:  # a phase this version of the engine does not have (see bench/ab_versions.sh)
            return
        spent.setdefault(label, 0.0)  # printed in this order

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            dt = time.perf_counter() - t
            spent[label] += dt
            by_step[len(eng.step_times_ms)][label] += dt
            calls[label] += 1
            return out

        setattr(obj, name, wrapper)

    timed(eng.scheduler, "schedule", "schedule")
    for layout in ("_decode_layout", "_tree_layout", "_prefill_layout"):
        timed(eng.runner, layout, "layout")
    if eng.runner.graphs is not None:
        timed(eng.runner.graphs, "launch", "graph replay (launch)")
    timed(eng.runner, "forward", "eager forward (launch)")
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
        # lifecycle updates run inside the upkeep, shadow or not (a prompt's trie is built at its first feed)
        for update in ("add_group", "add_sequence", "remove_sequence", "remove_group"):
            timed(eng.drafter, update, "  of which lifecycle updates")
    timed(eng, "add_request", "admission (add_request)")

    def gc_by_step(seconds: float) -> None:
        by_step[len(eng.step_times_ms)]["garbage collector"] += seconds
    eng.step_times_ms.clear()
    profiler = cProfile.Profile() if args.cprofile else contextlib.nullcontext()
    with GcTimer(on_pause=gc_by_step) as gc_time, profiler:
        t0 = time.perf_counter()  # from admission on, as `rollout bench` times a run
        reqs = [eng.add_request(p, params) for p in prompts]
        steps = 0
        while not all(r.finished for r in reqs):
            eng.step()
            steps += 1
        total = time.perf_counter() - t0
    print(f"batch {args.batch} spec {args.spec} workload {args.workload} overlap {not args.no_overlap}: "
          f"{steps} steps, {total / steps * 1e3:.3f} ms/step")
    for k, v in spent.items():
        print(f"  {k:28s} {v / steps * 1e3:.3f} ms/step  ({calls[k]} calls, {v * 1e3:.1f} ms)")
    p10, p50, p90 = (float(x) for x in np.percentile(eng.step_times_ms, [10, 50, 90]))
    print(f"  step ms p10 / p50 / p90       {p10:.3f} / {p50:.3f} / {p90:.3f}")
    print(f"  garbage collector            {gc_time.seconds * 1e3:.1f} ms in all")
    print(f"  outside the steps' costs     {total * 1e3 - sum(eng.step_times_ms):.1f} ms in all")
    slowest = sorted(range(len(eng.step_times_ms)), key=eng.step_times_ms.__getitem__, reverse=True)[:8]
    print("  slowest steps (index: ms)    " + ", ".join(f"{i}: {eng.step_times_ms[i]:.2f}" for i in sorted(slowest)))
    for i in sorted(slowest[:4]):  # where the 4 slowest went (step 0's admissions are not in its cost)
        phases = sorted(by_step[i].items(), key=lambda kv: -kv[1])
        print(f"    step {i}: " + ", ".join(f"{label.strip()} {dt * 1e3:.2f}" for label, dt in phases if dt >= 5e-5))
    if args.cprofile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

    if eng.runner.graphs is None:  # on the CPU: the host phases are all there is to show
        return
    # every captured graph alone, replayed back to back: the device time of each step shape.
    # Each replays with the inputs its last step left (sequences, context lengths, temperatures),
    # so a shape that ran with long contexts reads more KV than one that never ran: compare a
    # shape with itself across versions, not shapes with each other.
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
