"""Replays recorded greedy samples through the n-gram drafter and the draft budget, on the host.

    python bench/budget_replay.py [--prompts 24] [--humaneval 8] [--restart 0] [--budget-file F]

Generates greedy samples with spec off (CPU, default model; cached in --cache), then walks
each one as a batch-1 rollout would: every step the budget plans, the drafter proposes from
the sample's context, and greedy verification accepts the longest drafted path that the
sample continues with. Steps are charged a modelled cost in decode-step units: 1 for a
pipelined decode step, `1 + --verify-extra` for a verify step, and `--restart` more for the
step after a verify step (0 by default: since the engine chains a decode step after a verify
step on the device, nothing restarts; an older engine's costs had ~0.3-0.5), so the budget
learns the costs it would measure. Prints the speed-up over plain decoding per sample (median and means) for
the budget and for fixed policies. `--budget-file` replays another version of spec/budget.py
(e.g. `git show REV:spec/budget.py > old.py`; an `observe` without `rejected`, and an
`observe_step` that takes `restart`, are supported).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import pickle
import statistics
from pathlib import Path
from types import SimpleNamespace

from spec.ngram import NgramConfig, NgramDrafter


def greedy_samples(num_arith: int, num_humaneval: int, cache: Path) -> list[tuple[list[int], list[int]]]:
    key = cache / f"greedy-{num_arith}-{num_humaneval}.pkl"
    if key.exists():
        return pickle.loads(key.read_bytes())
    from rollout import Engine, SamplingParams
    from rollout.datasets import arithmetic_tasks, chat_prompt_ids, humaneval_prompts

    eng = Engine(spec="off", device="cpu")
    texts = [t.question for t in arithmetic_tasks(num_arith)] + humaneval_prompts(num_humaneval)
    prompts = [chat_prompt_ids(eng.tokenizer, t) for t in texts]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=256))
    samples = [(p, list(group[0].token_ids)) for p, group in zip(prompts, outs)]
    cache.mkdir(parents=True, exist_ok=True)
    key.write_bytes(pickle.dumps(samples))
    return samples


def accepted_length(tree, continuation: list[int]) -> tuple[int, bool]:
    """Greedy verification: how far the tree follows the sample, and whether a draft was turned down."""
    kids, node, accepted = tree.children(), 0, 0
    while accepted < len(continuation):
        nxt = [k for k in kids[node] if int(tree.tokens[k]) == continuation[accepted]]
        if not nxt:
            break
        node, accepted = nxt[0], accepted + 1
    return accepted, bool(kids[node])


def replay(seq_id: int, sample, plan_fn, observe_fn, observe_step_fn, args) -> float:
    """Speed-up over plain decoding (decode steps of the same cost) for one sample at batch 1."""
    prompt, out = sample
    drafter = NgramDrafter(NgramConfig())
    drafter.add_group(0, prompt)
    drafter.add_sequence(0, 0)
    context, i, cost, after_verify = list(prompt), 0, 0.0, False
    seq = SimpleNamespace(seq_id=seq_id)
    while i < len(out):
        budget = plan_fn(seq).get(seq_id, 0)
        tree = drafter.propose(0, context, budget) if budget else None
        accepted = 0
        if tree is not None and tree.num_drafts:
            accepted, rejected = accepted_length(tree, out[i:])
            observe_fn(seq_id, accepted, rejected)
            step = 1 + args.verify_extra
            observe_step_fn(tree.num_drafts, step, False)
        else:
            if tree is not None:
                observe_fn(seq_id, 0, True)  # planned, nothing to draft: the pipeline was drained for nothing
            step = 1 + (args.restart if after_verify or tree is not None else 0)
            observe_step_fn(0, step, after_verify)
        after_verify = tree is not None and tree.num_drafts > 0
        cost += step
        n = min(accepted + 1, len(out) - i)
        drafter.extend(0, out[i : i + n])
        context += out[i : i + n]
        i += n
    return len(out) / cost


def module_from_file(path: str, name: str):
    """Another version of one of this repository's modules, loaded from `path` under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_budget_class(path: str | None):
    if path is None:
        from spec.budget import DraftBudget

        return DraftBudget
    return module_from_file(path, "replayed_budget").DraftBudget


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24, help="arithmetic prompts")
    ap.add_argument("--humaneval", type=int, default=8, help="HumanEval prompts")
    ap.add_argument("--restart", type=float, default=0.0, help="extra cost of the step after a verify step")
    ap.add_argument("--verify-extra", type=float, default=0.05, help="extra cost of a verify step over a decode step")
    ap.add_argument("--budget-file", default=None, help="a spec/budget.py to replay instead of this checkout's")
    ap.add_argument("--shared-budget", action="store_true",
                    help="one budget for all samples, as in an engine (default: a fresh budget per sample)")
    ap.add_argument("--cache", default="/tmp/rollout-budget-replay")
    args = ap.parse_args()
    samples = greedy_samples(args.prompts, args.humaneval, Path(args.cache))
    budget_cls = load_budget_class(args.budget_file)
    takes_rejected = "rejected" in inspect.signature(budget_cls.observe).parameters
    restart_kw = "restart" in inspect.signature(budget_cls.observe_step).parameters

    shared = budget_cls(8, 256)  # one engine serving the samples one after another learns across them

    def with_budget(seq_id, sample):
        b = shared if args.shared_budget else budget_cls(8, 256)
        speedup = replay(
            seq_id, sample,
            lambda seq: b.for_batch([seq]),
            lambda i, acc, rej: b.observe(i, acc, rej) if takes_rejected else b.observe(i, acc),
            lambda drafts, step, restart: b.observe_step(
                1, drafts, step * 1e-3, **({"restart": restart} if restart_kw else {})),
            args,
        )
        b.forget(seq_id)
        return speedup

    def fixed(cap):
        return lambda seq_id, sample: replay(
            seq_id, sample, lambda seq: {seq.seq_id: cap} if cap else {}, lambda *a: None, lambda *a: None, args)

    policies = {"budget": with_budget, "always 8": fixed(8), "always 3": fixed(3), "never": fixed(0)}
    print(f"{len(samples)} greedy samples ({args.prompts} arithmetic, {args.humaneval} HumanEval); restart "
          f"{args.restart}, verify +{args.verify_extra} decode steps, shared budget {args.shared_budget}; "
          "speed-up over plain decoding:")
    for name, policy in policies.items():
        r = [policy(i, s) for i, s in enumerate(samples)]
        arith, code = r[: args.prompts], r[args.prompts :]
        print(f"  {name:9s} median {statistics.median(r):.2f}  arithmetic mean {statistics.mean(arith or [0]):.2f}  "
              f"HumanEval mean {statistics.mean(code or [0]):.2f}  min {min(r):.2f}  first {r[0]:.2f}")


if __name__ == "__main__":
    main()
