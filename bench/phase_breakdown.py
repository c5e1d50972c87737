"""Where the time of a GRPO rollout goes, by step kind: 64 prompts x 8 samples at T=1 on the
default model, spec off and ngram, one warm-up and one measured run each. Prints wall time,
time outside steps, drafter time, and per step kind (admission/prefill, decode by
power-of-two batch size) the number of steps and their summed time.

    python bench/phase_breakdown.py
"""

import collections
import gc
import time

import torch

from rollout import Engine, SamplingParams
from rollout.datasets import arithmetic_tasks, chat_prompt_ids


def main() -> None:
    for spec in ("off", "ngram"):
        eng = Engine(model="default", spec=spec)
        prompts = [chat_prompt_ids(eng.tokenizer, t.question) for t in arithmetic_tasks(64, seed=0)]
        schedule, kinds = eng.scheduler.schedule, []

        def recording_schedule():
            batch = schedule()
            if batch is not None:
                kinds.append("prefill" if batch.is_prefill else f"decode b{1 << (len(batch.items) - 1).bit_length()}")
            return batch

        eng.scheduler.schedule = recording_schedule
        for seed in (10_000, 0):  # warm-up, then the measured run
            kinds.clear()
            eng.reset_stats()
            if spec != "off":
                eng.clear_speculation_history()
            params = [SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=seed + i) for i in range(64)]
            start = time.perf_counter()
            eng.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        by_kind = collections.defaultdict(lambda: [0, 0.0])
        for kind, ms in zip(kinds, eng.step_times_ms):
            by_kind[kind][0] += 1
            by_kind[kind][1] += ms / 1e3
        st = eng.stats()
        steps_s = sum(eng.step_times_ms) / 1e3
        print(f"spec {spec}: wall {wall:.2f}s, steps {steps_s:.2f}s, outside steps {wall - steps_s:.2f}s, "
              f"drafting {st['rollout/draft_s']:.3f}s, upkeep in the shadow {st['rollout/drafter_shadow_s']:.3f}s")
        print("   ", {k: (n, round(s, 3)) for k, (n, s) in sorted(by_kind.items())})
        del eng
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
