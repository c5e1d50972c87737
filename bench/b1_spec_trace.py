"""What n-gram speculation does at batch 1, prompt by prompt: the trace behind the b1 figures.

    python bench/b1_spec_trace.py

For two arithmetic prompts and one HumanEval prompt of the grpo workload, greedy, spec
ngram, each run twice (the first run is the warm-up, as in `rollout bench`), under four
engine settings (CUDA graphs and the overlap schedule on and off), prints per prompt: how
many of the engine's steps the budget planned a draft for and how many got a tree (both
runs), the budget's step-cost table (median ms by (batch-size bucket, verified-token bucket;
0 = decode)) and its all-sequence
(accepted, rejected) counts, then the second run's output tokens, steps, drafted and
accepted tokens, and the start of the text.
"""

from __future__ import annotations

import gc
import statistics

import torch

from rollout.config import EngineConfig, SamplingParams
from rollout.datasets import arithmetic_tasks, chat_prompt_ids, humaneval_prompts
from rollout.engine import Engine


def main() -> None:
    settings = (dict(), dict(cuda_graphs=False), dict(overlap_schedule=False), dict(cuda_graphs=False, overlap_schedule=False))
    for kw in settings:
        eng = Engine(config=EngineConfig(spec="ngram", **kw))
        plans, trees = [], []
        plan, draft = eng.budget.for_batch, eng._draft
        eng.budget.for_batch = lambda seqs: plans.append(plan(seqs)) or plans[-1]
        eng._draft = lambda seqs, wanted: trees.append(draft(seqs, wanted)) or trees[-1]
        texts = [arithmetic_tasks(1, seed=s)[0].question for s in range(2)] + humaneval_prompts(1)
        print(kw)
        for text in texts:
            prompt = chat_prompt_ids(eng.tokenizer, text)
            for _ in range(2):
                eng.reset_stats()
                eng.clear_speculation_history()
                out = eng.generate([prompt], [SamplingParams(n=1, temperature=0, max_new_tokens=256)])[0][0]
            st = eng.stats()
            costs = {k: round(statistics.median(v) * 1e3, 3) for k, v in eng.budget._step_s.items()}
            print(f"  plans {sum(map(bool, plans))} of {len(plans)} trees {sum(map(bool, trees))} costs {costs} "
                  f"prior {eng.budget._prior}")
            plans.clear()
            trees.clear()
            print(len(out.token_ids), st["rollout/steps"], st["rollout/spec_draft_tokens"],
                  st["rollout/spec_accepted_tokens"], repr(eng.tokenizer.decode(out.token_ids))[:150])
        del eng
        gc.collect()  # the engine holds reference cycles; free its KV pool before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
