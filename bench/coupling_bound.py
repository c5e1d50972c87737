"""How much of a second rollout any coupling could share with the first after a trainer step, and
how much the engine shares: the ceiling on issue 40's after-a-step speedup.

A coupled engine rolls out the rl workload (T=1.0), a trainer takes one AdamW step on the samples
(`rollout.tools.bench.EpochUpdate`), the engine gets the step in its dtype and rolls out again
with the same noise. Each first-epoch sample is then teacher-forced through the old and the new
policy (HF, the engine's dtype), and at each of its positions, given the same prefix, the chance
that the new policy draws the old token is, with old p and new q and the old token x:

- shared Gumbel noise (what `--coupled-sampling` draws): 1 / sum_j max(p_j, q_j p_x / q_x)
  (the two argmaxes agree on x; tests/test_bench.py checks it against Monte Carlo draws);
- exact token-by-token verification (speculative sampling with the old sample as the draft):
  min(1, q_x / p_x).

A sample's expected shared prefix is the sum over positions of the product of those chances up to
there; the table compares the expected share of the tokens with what the engine shared.

    python bench/coupling_bound.py --prompts 64 --n 8 --max-new-tokens 2048 --lr 1e-6 --dtype float16

The engine's share depends on its own arithmetic (`--enable-fp32-residual --enable-fp32-lm-head`: its float32
islands); the expected shares are transformers' in the dtype.
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch

from rollout import Engine, SamplingParams
from rollout.tools.bench import EpochUpdate, common_prefix, expected_prefix, match_chances, workload_prompts
from rollout.tools.bench_args import TRAINER_STARTS


def teacher_forced_logits(model, prompt: list[int], sample: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + sample], device=model.device)
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--lr", default="1e-6", help="comma-separated; 0: a push of the same weights (the control)")
    ap.add_argument("--trainer-samples", type=int, default=64)
    ap.add_argument("--start", choices=TRAINER_STARTS, default="served",
                    help="the trainer's float32 weights before its step (rollout bench --trainer-start)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto", help="the engine's (and the pushed weights') dtype")
    ap.add_argument("--enable-fp32-residual", action="store_true", help="the engine's float32 residual stream")
    ap.add_argument("--enable-fp32-lm-head", action="store_true", help="the engine's float32 LM head input")
    ap.add_argument("--enable-fp32-activations", action="store_true", help="the engine's float32 between the products")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    engine = Engine(device=args.device, dtype=args.dtype, spec="off", coupled_sampling=True,
                    kv_cache_tokens=1_200_000 if args.device == "cuda" else None,
                    enable_fp32_residual=args.enable_fp32_residual, enable_fp32_lm_head=args.enable_fp32_lm_head,
                    enable_fp32_activations=args.enable_fp32_activations)
    prompts, n = workload_prompts(SimpleNamespace(workload="rl", seed=0, n=args.n, prompt_set="mixed"),
                                  engine.tokenizer, args.prompts * args.n)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    hf = {k: AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.dtype).to(engine.device).eval()
          for k in ("old", "new")}
    print("| lr | tokens | engine: shared | Gumbel noise: expected | exact verification: expected | "
          "per-token match, Gumbel / exact | median prefix: engine / Gumbel |")
    print("|---|---|---|---|---|---|---|")
    for lr in map(float, args.lr.split(",")):
        trainer = EpochUpdate(engine, lr, args.trainer_samples, args.start)  # (lr 0: AdamW moves nothing)
        trainer.restore(engine)
        first = [[o.token_ids for o in g] for g in engine.generate(prompts, params)]
        update = trainer.step(prompts, first)
        engine.update_weights(update)
        second = [[o.token_ids for o in g] for g in engine.generate(prompts, params)]
        hf["old"].load_state_dict({k: v.to(engine.dtype) for k, v in trainer.base.items()}, strict=False)
        hf["new"].load_state_dict(dict(update), strict=False)
        shared, gumbel, exact, tokens, per_gumbel, per_exact = [], [], [], 0, 0.0, 0.0
        for prompt, olds, news in zip(prompts, first, second):
            for old, new in zip(olds, news):
                shared.append(common_prefix(old, new))
                if not old:
                    continue
                x = torch.tensor(old, device=engine.device)
                g, e = match_chances(teacher_forced_logits(hf["old"], prompt, old),
                                     teacher_forced_logits(hf["new"], prompt, old), x)
                gumbel.append(expected_prefix(g))
                exact.append(expected_prefix(e))
                tokens += len(old)
                per_gumbel += float(g.sum())
                per_exact += float(e.sum())
        print(f"| {lr:g} | {tokens} | {sum(shared) / tokens:.1%} | {sum(gumbel) / tokens:.1%} | {sum(exact) / tokens:.1%} | "
              f"{per_gumbel / tokens:.4f} / {per_exact / tokens:.4f} | {statistics.median(shared)} / "
              f"{statistics.median(gumbel):.0f} |", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
