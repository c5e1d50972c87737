"""Where coupled rollouts part on the GPU: a coupled engine with speculation against one without,
on the same prompts (bf16), under variants of the engine. Prints, per variant, how many samples
are equal token for token and where the others first differ.

    python bench/coupled_divergence.py --variants graphs,eager,torch-attention,no-overlap
"""

from __future__ import annotations

import argparse
import statistics

from rollout import Engine, SamplingParams
from rollout.tools.bench import common_prefix
from rollout.tools.datasets import arithmetic_tasks, chat_prompt_ids

VARIANTS = {
    "graphs": {},
    "eager": {"cuda_graphs": False},
    "torch-attention": {"attention_backend": "torch", "cuda_graphs": False},
    "no-overlap": {"overlap_schedule": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for name in args.variants.split(","):
        outs = {}
        for spec in ("off", "ngram"):
            engine = Engine(device=args.device, kv_cache_tokens=200_000 if args.device == "cuda" else None, spec=spec,
                            coupled_sampling=True, spec_adaptive=False, **VARIANTS[name])
            prompts = [chat_prompt_ids(engine.tokenizer, t.question) for t in arithmetic_tasks(args.prompts, seed=3)]
            outs[spec] = [o.token_ids for g in engine.generate(prompts, params) for o in g]
            if spec == "ngram":
                stats = engine.stats()
                drafted = {k.split("/")[-1]: v for k, v in stats.items() if k.startswith("rollout/spec_draft_tokens/")}
            del engine
        pairs = list(zip(outs["off"], outs["ngram"]))
        parted = sorted(common_prefix(a, b) for a, b in pairs if a != b)
        median = statistics.median(parted) if parted else "-"
        print(f"{name:16s} equal {len(pairs) - len(parted)}/{len(pairs)}  first difference: median {median}, "
              f"earliest {parted[:5]}  drafted {drafted}", flush=True)


if __name__ == "__main__":
    main()
