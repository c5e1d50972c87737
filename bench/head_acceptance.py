"""What a draft head's drafts would be accepted at temperature T, drafted by argmax against
drafted by sampling from the head, and a first level of its top k (offline, teacher-forced on
the target's own samples).

A draft x drafted by argmax is accepted with the target's p(x) (at T=0: when x is the target's
argmax); one sampled from the head's q with sum_x min(p(x), q(x)) (kernels/sampled_tree_accept.py);
one of k siblings, the head's top k, with their p summed (EAGLE-2's tree, its first level). For
each of the target's samples of the rl workload's prompts, the head runs over the sample as
recipes/train_eagle.py trains it (spec.draft_head.unrolled, 3 steps), and this prints, on the
responses, step 0's acceptance each way and a 3-draft chain's expected accepted drafts (the
product of each step's, summed).

    python bench/head_acceptance.py --head DIR [--temperature 1.0] [--prompts 12] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.tools.bench import workload_prompts  # noqa: E402
from spec.draft_head import HeadConfig, load_head, read_vocab_map, unrolled  # noqa: E402
from train_eagle import Target  # noqa: E402

CHAIN = 3
TOP = (2, 4, 8)  # first levels of this many siblings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    t = args.temperature
    engine = Engine(model="default", device=args.device)
    cfg = HeadConfig.from_dir(args.head, engine.model.config)
    head = load_head(args.head, engine.model.config, layer=engine.model.config.num_layers).to(engine.device)
    d2t = read_vocab_map(args.head, cfg).to(engine.device)
    target = Target(engine, cfg.aux_layers)
    opts = SimpleNamespace(workload="rl", n=1, prompt_set="mixed", seed=0)
    prompts, _ = workload_prompts(opts, engine.tokenizer, args.prompts)
    outs = engine.generate(prompts, SamplingParams(temperature=t, max_new_tokens=args.max_new_tokens, seed=1))
    first = {"argmax": [], "sampled": [], **{f"top {k}": [] for k in TOP}}
    chain = {"argmax": [], "sampled": []}
    for prompt, out in zip(prompts, outs):
        ids = list(prompt) + out[0].token_ids
        aux, logp = target(ids)
        tokens = torch.tensor(ids[1:], device=engine.device)
        with torch.no_grad():
            steps = unrolled(head, engine.model.model.embed_tokens, tokens, aux[: len(ids) - 1],
                             engine.runner.cos, engine.runner.sin, steps=CHAIN)
        if t > 0:
            p_all = torch.softmax(logp / t, dim=-1)
        else:  # greedy: the target's argmax alone
            p_all = torch.nn.functional.one_hot(logp.argmax(-1), logp.shape[-1]).to(logp.dtype)
        by_step = []
        for j, (logits, _) in enumerate(steps):
            n = logits.shape[0]
            p = p_all[j + 1 : j + 1 + n]  # step j at position i drafts the token the target gives at i + j + 1
            q = torch.zeros_like(p)
            q[:, d2t] = torch.softmax(logits.float() / max(t, 1e-6), dim=-1)
            response = torch.arange(n, device=p.device) + j + 2 >= len(prompt)
            by_argmax = p.gather(1, d2t[logits.argmax(-1)][:, None])[:, 0]
            by_sampling = torch.minimum(p, q).sum(dim=-1)
            by_step.append((by_argmax[response], by_sampling[response]))
        first["argmax"].append(by_step[0][0].mean().item())
        first["sampled"].append(by_step[0][1].mean().item())
        logits0 = steps[0][0]
        response = torch.arange(logits0.shape[0], device=logits0.device) + 2 >= len(prompt)
        for k in TOP:
            siblings = d2t[logits0.topk(k, dim=-1).indices]  # [n, k] target ids
            first[f"top {k}"].append(p_all[1 : 1 + logits0.shape[0]].gather(1, siblings).sum(-1)[response].mean().item())
        m = min(len(a) for a, _ in by_step)
        for k, kind in enumerate(("argmax", "sampled")):
            alive, total = torch.ones(m, device=engine.device), torch.zeros(m, device=engine.device)
            for step in by_step:
                alive = alive * step[k][:m]
                total += alive
            chain[kind].append(total.mean().item())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"{len(prompts)} samples at T={t}, head {args.head}")
    print(f"| drafted by | first draft accepted | {CHAIN}-draft chain: drafts accepted |\n|---|---|---|")
    for kind in first:
        print(f"| {kind} | {mean(first[kind]):.3f} | {mean(chain[kind]):.3f} |" if kind in chain else
              f"| the head's {kind}, as siblings | {mean(first[kind]):.3f} | |")


if __name__ == "__main__":
    main()
