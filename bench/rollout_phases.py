"""Where a GRPO rollout's time goes: 64 prompts x 8 samples at T=1 on the default model,
spec off and ngram, each measured run after a warm-up with other seeds.

    python bench/rollout_phases.py breakdown   # time by step kind: admissions, decode by batch size
    python bench/rollout_phases.py admission   # admission batching A/B, alternating, twice

(`bench/gpu_session.sh phases` runs both.)
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

import torch

from rollout import Engine, SamplingParams
from rollout.datasets import arithmetic_tasks, chat_prompt_ids

PROMPTS, N, TOKENS = 64, 8, 256


class RecordedEngine:
    """An engine whose steps are labelled by kind (admission or decode at a batch-size bucket)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.engine = Engine(model="default", spec=spec)
        self.prompts = [chat_prompt_ids(self.engine.tokenizer, t.question) for t in arithmetic_tasks(PROMPTS, seed=0)]
        self.kinds: list[str] = []
        schedule = self.engine.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            if batch is not None:
                self.kinds.append("prefill" if batch.is_prefill else f"decode b{1 << (len(batch.items) - 1).bit_length()}")
            return batch

        self.engine.scheduler.schedule = recording_schedule

    def rollout(self, seed: int) -> tuple[float, int]:
        """A warm-up with other seeds, then the measured run: (wall seconds, output tokens)."""
        for s in (seed + 10_000, seed):
            self.kinds.clear()
            self.engine.reset_stats()
            if self.spec != "off":
                self.engine.clear_speculation_history()
            params = [SamplingParams(n=N, temperature=1.0, max_new_tokens=TOKENS, seed=s + i) for i in range(PROMPTS)]
            start = time.perf_counter()
            outs = self.engine.generate(self.prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        return wall, sum(len(o.token_ids) for group in outs for o in group)

    def close(self) -> None:
        del self.engine
        gc.collect()
        torch.cuda.empty_cache()


def breakdown(run: RecordedEngine) -> None:
    wall, _ = run.rollout(seed=0)
    steps = run.engine.step_times_ms
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for kind, ms in zip(run.kinds, steps):
        by_kind[kind][0] += 1
        by_kind[kind][1] += ms / 1e3
    st, steps_s = run.engine.stats(), sum(steps) / 1e3
    print(f"spec {run.spec}: wall {wall:.2f}s, steps {steps_s:.2f}s, outside steps {wall - steps_s:.2f}s, "
          f"drafting {st['rollout/draft_s']:.3f}s, upkeep in the shadow {st['rollout/drafter_shadow_s']:.3f}s")
    print("   ", {k: (n, round(s, 3)) for k, (n, s) in sorted(by_kind.items())})


def admission(run: RecordedEngine) -> None:
    scheduler = run.engine.scheduler
    batched = scheduler.admit_rows
    for rep in range(2):
        for label, rows in (("admit when one row is free", 1), (f"admit at {batched} free rows", batched)):
            scheduler.admit_rows = rows
            wall, tokens = run.rollout(seed=rep)
            steps = run.engine.step_times_ms
            prefill = [ms for ms, kind in zip(steps, run.kinds) if kind == "prefill"]
            print(f"spec {run.spec:5s} {label:28s} wall {wall:.2f}s {tokens / wall:8.0f} tok/s steps {len(steps)} "
                  f"prefill steps {len(prefill)} ({sum(prefill) / 1e3:.2f}s) step median {statistics.median(steps):.2f} ms")
    scheduler.admit_rows = batched


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["breakdown", "admission"])
    args = ap.parse_args()
    for spec in ("off", "ngram"):
        run = RecordedEngine(spec)
        (breakdown if args.what == "breakdown" else admission)(run)
        run.close()


if __name__ == "__main__":
    main()
