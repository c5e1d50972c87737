"""Admission batching A/B on one GPU, in one process: 64 prompts x 8 samples at T=1 with
prompts admitted as soon as one row is free (the old scheduler) and with the default
batching (`rollout.scheduler.ADMIT_SHARE`), for spec off and ngram, twice each.

    python bench/admission_ab.py        # bench/gpu_session.sh admission
"""

import gc
import statistics
import time

import torch

from rollout import Engine, SamplingParams
from rollout.datasets import arithmetic_tasks, chat_prompt_ids


def main() -> None:
    for spec in ("off", "ngram"):
        eng = Engine(model="default", spec=spec)
        prompts = [chat_prompt_ids(eng.tokenizer, t.question) for t in arithmetic_tasks(64, seed=0)]
        schedule, prefill_flags = eng.scheduler.schedule, []

        def recording_schedule():
            batch = schedule()
            if batch is not None:
                prefill_flags.append(batch.is_prefill)
            return batch

        eng.scheduler.schedule = recording_schedule
        default_rows = eng.scheduler.admit_rows
        for rep in range(2):
            for label, rows in (("admit when one row is free", 1), (f"admit at {default_rows} free rows", default_rows)):
                eng.scheduler.admit_rows = rows
                for seed in (10_000 + rep, rep):  # warm-up, then the measured run
                    prefill_flags.clear()
                    eng.reset_stats()
                    if spec != "off":
                        eng.clear_speculation_history()
                    params = [SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=seed + i) for i in range(64)]
                    start = time.perf_counter()
                    outs = eng.generate(prompts, params)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for group in outs for o in group)
                steps = eng.step_times_ms
                prefill = [ms for ms, flag in zip(steps, prefill_flags) if flag]
                print(f"spec {spec:5s} {label:28s} wall {wall:.2f}s {tokens / wall:8.0f} tok/s steps {len(steps)} "
                      f"prefill steps {len(prefill)} ({sum(prefill) / 1e3:.2f}s) step median {statistics.median(steps):.2f} ms")
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
