"""Where a tensor-parallel decode step's time goes: one sequence of the Llama-3.1-8B shape (random
weights), decode steps' wall, device and host time (Engine.step_log, medians), by setting.

    python bench/tp_profile.py --tp-sizes 1,2 --variants default,no-pdl,no-overlap,no-graphs
"""

from __future__ import annotations

import argparse
import statistics

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
    args = ap.parse_args()
    model = speed_model_dir(args.shape)
    print("| tp | variant | step ms | device ms | host ms | tok/s |\n|---|---|---|---|---|---|", flush=True)
    for tp in map(int, args.tp_sizes.split(",")):
        for variant in args.variants.split(","):
            engine = Engine(model=model, load_format="dummy", spec="off", tp_size=tp, max_running_seqs=8,
                            kv_cache_tokens=20_000, **VARIANTS[variant])
            params = SamplingParams(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
            for _ in range(2):  # the first run warms up
                engine.reset_stats()
                engine.generate([list(range(100, 228))], params)
            steps = [r for r in engine.step_log if not r.prefill]
            med = lambda k: statistics.median(getattr(r, k) for r in steps)  # noqa: E731
            print(f"| {tp} | {variant} | {med('wall_ms'):.2f} | {med('device_ms'):.2f} | {med('host_ms'):.2f} | "
                  f"{1e3 / med('wall_ms'):.1f} |", flush=True)
            engine.close()
            del engine


if __name__ == "__main__":
    main()
