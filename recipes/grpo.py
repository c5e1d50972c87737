"""GRPO on a verifiable arithmetic task, with the rollout server doing generation.

Each step: sample groups of `n` completions per prompt through `RolloutClient`, score them,
normalise rewards within each group (the advantages), recompute the completions' logprobs
in the trainer (float32 master weights) and report how far they are from the rollout's (the
mismatch: mean, p99, max and KL's k3 estimate), take one policy-gradient step (with `--tis C`,
each token weighted by truncated importance sampling), and push the new weights to the server
in its dtype (`--dtype`) with `WeightPusher`. Every step is logged to W&B (offline unless
configured) with the rollout's acceptance statistics, and a PNG of reward, mismatch and accept
rate per step is written beside the run.

    python recipes/grpo.py --steps 2 --prompts 2 --n 4 --max-new-tokens 32     # seconds on a CPU (CI)
    python recipes/grpo.py --steps 30 --prompts 64 --n 8 --max-new-tokens 256  # an H100 run
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from rollout.client import RolloutClient  # noqa: E402
from rollout.models.default_model import resolve_model_path  # noqa: E402
from rollout.server.replicas import summed_stats  # noqa: E402
from rollout.tools.datasets import arithmetic_tasks, chat_prompt_ids  # noqa: E402
from rollout.tools.launch import launched_server  # noqa: E402
from rollout.tools.mismatch import mismatch_stats, teacher_forced_logprobs, tis_weights  # noqa: E402
from rollout.tools.wandb_log import WandbLogger  # noqa: E402
from weight_sync import WeightPusher  # noqa: E402
from weight_sync.pusher import router_workers  # noqa: E402

MICRO_BATCH = 16  # sequences per trainer forward/backward
SERVER_START_S = 900.0  # a server started for the run answers /health within this (CUDA graphs of a large model)


@dataclass
class StepRecord:
    step: int
    reward: float
    mismatch: dict  # the rollout's logprobs against the trainer's (rollout.tools.mismatch.mismatch_stats)
    rollout_s: float
    tokens_per_s: float
    weight_version: int
    weight_sync_s: float
    spec: dict  # rollout/spec_* for this step's rollout only
    off_tokens_per_s: float = 0.0  # the same rollout on the spec-off server (--compare-spec-off), else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--server", default=None, help="URL of a running rollout server (default: start one)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--dataset-size", type=int, default=0,
                    help="draw each step's prompts in turn from this many fixed tasks, so later epochs re-sample "
                         "earlier prompts (0: fresh tasks every step)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="the server's dtype, and the dtype weights are pushed in (the trainer keeps float32 master "
                         "weights); auto: bfloat16 on a GPU, float32 on the CPU. float16 matches the trainer ~7x "
                         "closer than bfloat16 at the same speed (README)")
    ap.add_argument("--tis", type=float, default=0.0, metavar="C",
                    help="truncated importance sampling: weight each token's loss by min(C, p_trainer / p_rollout), "
                         "correcting for the rollout's mismatch (0: off)")
    ap.add_argument("--push", default="auto", choices=["auto", "distributed", "disk", "ipc"],
                    help="auto: ipc when trainer and server share a GPU, else distributed (gloo)")
    ap.add_argument("--spec", default="auto", choices=["off", "ngram", "eagle", "auto"], help="the server's speculation")
    ap.add_argument("--spec-draft-model", default=None,
                    help="a draft head for the server (--spec eagle, or auto: hybrid; auto on the default model takes "
                         "its own head); it goes stale as the policy trains")
    ap.add_argument("--coupled-sampling", action="store_true",
                    help="the server derives each request's seed from its prompt, so every epoch draws a prompt's samples "
                         "with the same noise and drafts from the earlier epoch's (needs --dataset-size to meet prompts again)")
    ap.add_argument("--compare-spec-off", action="store_true",
                    help="also run every rollout on a second server with speculation off (same seeds, same weights "
                         "pushed to both) and report its tokens/s beside")
    ap.add_argument("--spec-no-adaptive", action="store_true",
                    help="the server verifies as many drafts as fit rather than what its measured costs say pays (the "
                         "adaptive budget trusts drafts only after tens of steps: longer than a CPU demo's rollouts)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--final-rollout", action="store_true", help="one more rollout after the last push")
    ap.add_argument("--wandb-project", default=None, help="W&B project (default: $WANDB_PROJECT, else rollout-grpo)")
    ap.add_argument("--out", default="recipes/runs", help="where the W&B run and its plot go, unless $WANDB_DIR is set")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


@contextlib.contextmanager
def rollout_servers(args: argparse.Namespace, specs: list[str], share: float = 0.5):
    """[the given server's URL], or those of a server started for this run with each of `specs`,
    side by side (each loads while the others do), stopped at the end. `share`: of the GPU's free
    memory each KV pool takes (the trainer shares the GPU)."""
    if args.server:
        yield [args.server]
        return
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(launched_server(*serve_args(args, spec, share), wait=False)) for spec in specs]
        for server in servers:
            server.wait_healthy(SERVER_START_S)
        yield [server.url for server in servers]


def serve_args(args: argparse.Namespace, spec: str, share: float) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--spec", spec, "--dtype", args.dtype]
    if args.spec_draft_model and spec in ("eagle", "auto"):
        out += ["--spec-draft-model", args.spec_draft_model]
    if args.coupled_sampling:
        out += ["--coupled-sampling"]
    if args.spec_no_adaptive:
        out += ["--spec-no-adaptive"]
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        out += ["--kv-cache-tokens", "32768"]
    else:
        out += ["--kv-cache-memory-fraction", str(share)]
    return out


def group_advantages(rewards: list[float], n: int) -> list[float]:
    """(r - group mean) / (group std + eps), each group being the n samples of one prompt."""
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out += [(r - mean) / (std + 1e-4) for r in group]
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """This rollout's speculation statistics from two snapshots of the server's counters."""
    d = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
    drafted, accepted = d("rollout/spec_draft_tokens"), d("rollout/spec_accepted_tokens")
    steps, emitted = d("rollout/spec_verify_steps"), d("rollout/spec_emitted_tokens")
    out = {
        "rollout/spec_draft_tokens": drafted,
        "rollout/spec_accept_rate": accepted / drafted if drafted else 0.0,
        "rollout/spec_accept_length": emitted / steps if steps else 0.0,
    }
    for key in after:
        if key.startswith("rollout/spec_draft_tokens/"):
            source = key.rsplit("/", 1)[1]
            src_drafted, src_accepted = d(key), d(f"rollout/spec_accepted_tokens/{source}")
            out[f"rollout/spec_draft_tokens/{source}"] = src_drafted
            out[f"rollout/spec_accept_rate/{source}"] = src_accepted / src_drafted if src_drafted else 0.0
    return out


def step_tasks(args: argparse.Namespace, step: int) -> list:
    if not args.dataset_size:
        return arithmetic_tasks(args.prompts, seed=args.seed * 1000 + step)
    pool = arithmetic_tasks(args.dataset_size, seed=args.seed)
    start = (step - 1) * args.prompts
    return [pool[i % len(pool)] for i in range(start, start + args.prompts)]


@dataclass
class GrpoRun:
    records: list[StepRecord]
    policy: torch.nn.Module  # the trainer's model after the last step
    run_dir: Path  # the W&B run (offline-run-* unless W&B is set up), with grpo.png


def run(args: argparse.Namespace) -> GrpoRun:
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    torch.manual_seed(args.seed)
    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    # fused: one pass over every tensor, not a loop over them
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    push = args.push if args.push != "auto" else ("ipc" if device == "cuda" and not args.compare_spec_off else "distributed")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logger = WandbLogger(args.wandb_project, config=vars(args), directory=args.out, default_project="rollout-grpo")
    records: list[StepRecord] = []
    if args.compare_spec_off and args.server:
        raise SystemExit("--compare-spec-off starts its own servers: drop --server")

    with contextlib.ExitStack() as stack:
        share = 0.25 if args.compare_spec_off else 0.5
        url, *off_url = stack.enter_context(rollout_servers(args, [args.spec] + (["off"] if args.compare_spec_off else []), share))
        client = stack.enter_context(RolloutClient(url))
        off_client = stack.enter_context(RolloutClient(off_url[0])) if off_url else None
        if args.coupled_sampling and not client.server_info()["engine_config"]["coupled_sampling"]:
            raise SystemExit(f"--coupled-sampling: the server at {url} does not sample coupled (serve it with --coupled-sampling)")
        urls = [url] + ([off_client.url] if off_client is not None else [])
        pusher = WeightPusher(urls, method=push, dtype=push_dtype(args.dtype, device))
        # (a router's URL stands for its workers: the push reaches each, and their counters add up)
        workers = [stack.enter_context(RolloutClient(u)) for u in router_workers([url])]

        def server_stats() -> dict:
            return summed_stats([w.server_info()["stats"] for w in workers])

        rollouts = args.steps + (1 if args.final_rollout else 0)
        for step in range(1, rollouts + 1):
            tasks = step_tasks(args, step)
            prompts = [chat_prompt_ids(tokenizer, t.question) for t in tasks]
            sampling = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
            if not args.coupled_sampling:  # (coupled: the server seeds each prompt's samples from the prompt)
                sampling["seed"] = args.seed * 1000 + step
            before = server_stats()
            t0 = time.perf_counter()
            groups = client.generate(prompts, sampling, n=args.n, return_logprob=True)
            rollout_s = time.perf_counter() - t0
            after = server_stats()
            off_tokens_per_s = 0.0
            if off_client is not None:  # (the first rollout too: both servers then time warm rollouts alike)
                t1 = time.perf_counter()
                off_groups = off_client.generate(prompts, sampling, n=args.n)
                off_tokens_per_s = sum(len(s.token_ids) for g in off_groups for s in g) / (time.perf_counter() - t1)
            samples = [s for g in groups for s in g]
            versions = {v for s in samples for v in s.weight_versions}
            expected = str(step - 1)
            assert versions <= {expected}, f"step {step} sampled with weight versions {versions}, expected {expected}"
            rewards = [task.reward(s.text) for task, g in zip(tasks, groups) for s in g]
            tokens = sum(len(s.token_ids) for s in samples)

            # the trainer's view of the same tokens, and one policy-gradient step on them
            sample_prompts = [p for p, g in zip(prompts, groups) for _ in g]
            completions = [s.token_ids for s in samples]
            advantages = group_advantages(rewards, args.n)
            num_tokens = max(1, sum(len(c) for c in completions))
            train = step <= args.steps
            policy.train(train)
            trainer_lp, rollout_lp = [], []
            for i in range(0, len(samples), MICRO_BATCH):  # micro-batches keep the logits in memory
                chunk = slice(i, i + MICRO_BATCH)
                with torch.set_grad_enabled(train):
                    new_lp = teacher_forced_logprobs(policy, sample_prompts[chunk], completions[chunk], args.temperature)
                old_lp = [torch.tensor(s.logprobs, device=device) for s in samples[chunk]]
                trainer_lp += [lp.detach().cpu() for lp in new_lp]
                rollout_lp += [lp.cpu() for lp in old_lp]
                if train:
                    # on-policy, so the PPO ratio exp(lp - lp_old) is 1; its gradient is grad lp (with --tis,
                    # weighted by how much likelier the trainer finds each token than the rollout did)
                    weights = [tis_weights(lp, old, args.tis) if args.tis else 1.0 for lp, old in zip(new_lp, old_lp)]
                    loss = -sum(a * (w * (lp - lp.detach()).exp()).sum()
                                for a, w, lp in zip(advantages[chunk], weights, new_lp))
                    (loss / num_tokens).backward()
            mismatch = mismatch_stats(torch.cat(trainer_lp), torch.cat(rollout_lp)) if samples else mismatch_stats(
                torch.zeros(0), torch.zeros(0))

            sync_s, version = 0.0, step - 1
            if train:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                policy.eval()
                t1 = time.perf_counter()
                pusher.push(policy.named_parameters(), version=step)
                sync_s = time.perf_counter() - t1
                version = step
            rec = StepRecord(
                step=step, reward=sum(rewards) / len(rewards), mismatch=mismatch,
                rollout_s=rollout_s, tokens_per_s=tokens / rollout_s, weight_version=version, weight_sync_s=sync_s,
                spec=spec_delta(before, after), off_tokens_per_s=off_tokens_per_s,
            )
            records.append(rec)
            logger.log(
                {"grpo/reward": rec.reward, **{f"grpo/{k}": v for k, v in mismatch.items()}, "grpo/rollout_s": rollout_s,
                 "rollout/tokens_per_s": rec.tokens_per_s, "rollout/weight_version": version,
                 "rollout/weight_sync_s": sync_s, "rollout/tokens_per_s_spec_off": off_tokens_per_s, **rec.spec},
                step=step,
            )
            print_row(rec, header=step == 1, compare=off_client is not None)
        pusher.close()
    plot(records, logger.run_dir / "grpo.png")
    logger.finish()
    print(f"W&B run: {logger.run_dir}  plot: {logger.run_dir / 'grpo.png'}")
    if args.spec == "auto" and not args.spec_draft_model and args.model != "default":
        print("drafts came from the n-gram index alone; a draft head beside it (the hybrid, as the default model has): "
              "python recipes/train_eagle.py --out DIR --model M --sharegpt FILE --prompts 3000 --max-minutes 7 on one "
              "GPU, then --spec-draft-model DIR")
    return GrpoRun(records, policy, logger.run_dir)


def push_dtype(dtype: str, device: str) -> torch.dtype | None:
    """What the trainer pushes its float32 weights as: the server's dtype (auto: bf16 on a GPU,
    as it serves; unchanged on the CPU)."""
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else None
    return getattr(torch, dtype)


def print_row(r: StepRecord, header: bool, compare: bool = False) -> None:
    """A step's row: its rollout's speed, acceptance (coupled: drafts from the earlier epoch's sample),
    and with `compare` the same rollout's tokens/s with speculation off."""
    s = r.spec
    coupled = s.get("rollout/spec_accept_rate/coupled")
    cells = [str(r.step), f"{r.reward:.3f}", f"{r.rollout_s:.2f}", f"{r.tokens_per_s:.1f}"]
    heads = ["step", "reward", "rollout s", "tok/s"]
    if compare:
        heads += ["tok/s spec off", "speedup"]
        cells += [f"{r.off_tokens_per_s:.1f}", f"{r.tokens_per_s / r.off_tokens_per_s:.2f}x" if r.off_tokens_per_s else "-"]
    heads += ["accept rate", "coupled accept", "accept len", "drafted", "mismatch", "version", "sync s"]
    cells += [f"{s['rollout/spec_accept_rate']:.3f}", "-" if coupled is None else f"{coupled:.3f}",
              f"{s['rollout/spec_accept_length']:.2f}", str(s["rollout/spec_draft_tokens"]),
              f"{r.mismatch['logprob_mismatch_mean']:.2e}",
              str(r.weight_version), f"{r.weight_sync_s:.2f}"]
    if header:
        print("| " + " | ".join(heads) + " |")
        print("|" + "---|" * len(heads))
    print("| " + " | ".join(cells) + " |", flush=True)


def figure(records: list[StepRecord]):
    """Reward, the logprob mismatch (mean and p99), rollout seconds and each drafter's accept rate by
    step (integer ticks; the legends sit below the axes, clear of their labels). Returns the
    matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in records]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(6.5, 7.5), sharex=True)
    top.plot(steps, [r.reward for r in records], marker="o", label="mean reward")
    top.set_ylabel("mean reward")
    for key, label in (("logprob_mismatch_mean", "mean"), ("logprob_mismatch_p99", "p99")):
        middle.plot(steps, [r.mismatch[key] for r in records], marker="^", label=f"|logprob mismatch|, {label}")
    middle.set_ylabel("trainer - rollout")
    bottom.plot(steps, [r.rollout_s for r in records], marker="o", color="black", label="rollout seconds")
    bottom.set_ylabel("rollout seconds")
    rates = bottom.twinx()
    sources = sorted({k.rsplit("/", 1)[1] for r in records for k in r.spec if k.startswith("rollout/spec_accept_rate/")})
    for i, source in enumerate(sources):
        rates.plot(steps, [r.spec.get(f"rollout/spec_accept_rate/{source}", 0.0) for r in records], marker="s",
                   linestyle="--", color=f"C{i + 1}", label=f"accept rate, {source} drafts")
    rates.set_ylabel("accept rate")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles = [h for ax in (top, middle, bottom, rates) for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * (1 + len(handles) // 2), 1, 1))
    return fig


def plot(records: list[StepRecord], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(records)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(parse_args())
