"""What a drafting step costs against a decode step, as the draft budget sees it.

    python bench/step_costs.py

Runs the grpo workload (greedy, spec ngram) at batch 1, 8 and 64, twice each, and prints
the step counts and median wall times of decode and verify steps, then the budget's cost
table: median ms by (batch-size bucket, verified-token bucket; 0 = decode).
"""

from __future__ import annotations

import statistics
import time

from rollout.config import EngineConfig, SamplingParams, SpecConfig
from rollout.datasets import arithmetic_tasks, chat_prompt_ids, humaneval_prompts
from rollout.engine import Engine


def main() -> None:
    eng = Engine(config=EngineConfig(spec=SpecConfig(method="ngram")))
    for batch, n in [(1, 1), (8, 8), (64, 8)]:
        num_prompts = max(1, batch // n)
        arithmetic = (num_prompts + 1) // 2
        texts = [t.question for t in arithmetic_tasks(arithmetic)] + humaneval_prompts(num_prompts - arithmetic)
        prompts = [chat_prompt_ids(eng.tokenizer, t) for t in texts]
        params = [SamplingParams(n=n, temperature=0, max_new_tokens=256, seed=i) for i in range(len(prompts))]
        for run in range(2):
            eng.clear_speculation_history()
            eng.reset_stats()
            steps: list[tuple[int, float]] = []
            observe = eng.budget.observe_step
            eng.budget.observe_step = lambda s, d, t: (steps.append((d, t)), observe(s, d, t))
            start = time.perf_counter()
            eng.generate(prompts, params)
            wall = time.perf_counter() - start
            eng.budget.observe_step = observe
            decode = [t for d, t in steps if d == 0]
            verify = [t for d, t in steps if d > 0]
            st = eng.stats()
            print(f"b{batch} run {run}: {wall * 1e3:.0f} ms; decode steps {len(decode)} "
                  f"(median {statistics.median(decode or [0]) * 1e3:.3f} ms), verify steps {len(verify)} "
                  f"(median {statistics.median(verify or [0]) * 1e3:.3f} ms); accept length "
                  f"{st['rollout/spec_accept_length']:.2f}", flush=True)
        table = {k: round(statistics.median(v) * 1e3, 3) for k, v in sorted(eng.budget._step_s.items())}
        print(f"  cost table (ms): {table}")


if __name__ == "__main__":
    main()
