"""`rollout bench --workload mismatch`: the engine's logprobs against a float32 trainer's, by dtype.

For each serving dtype (`--dtypes`), an engine rolls out the same arithmetic prompts (`--batch-sizes`
samples as prompts x `--n`, at `--temperature`, up to `--output-len` tokens), timed after a warm-up
rollout; then transformers' model in float32 (a trainer's master weights) teacher-forces the sampled
tokens, and the table gives how far the two sets of logprobs are (rollout.tools.mismatch) beside
the rollout's tokens/s. The trainer's weights are the checkpoint's own unless `--trainer-start`
says otherwise (`served`: the weights each row's engine serves, so that only the engine's
arithmetic differs; `spread`: where float32 master weights lie after many steps). Medians over `--repeats` rounds, each drawing its own samples. With
`--enable-fp32-residual`, `--enable-fp32-lm-head` or `--enable-fp32-activations` every row keeps those float32 islands (its
`fp32` column says which).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from rollout.config import EngineConfig, SamplingParams
from rollout.tools.mismatch import MISMATCH_KEYS, mismatch_stats, start_trainer_weights, teacher_forced_logprobs

MICRO_BATCH = 16  # samples per trainer forward


@dataclass
class MismatchRow:
    dtype: str
    fp32: str  # the float32 islands: residual, lm head input, or '-'
    trainer: str  # where the trainer's float32 weights start (rollout.tools.mismatch.TRAINER_STARTS)
    samples: int
    tokens: int
    tokens_per_s: float
    logprob_mismatch_mean: float
    logprob_mismatch_p99: float
    logprob_mismatch_max: float
    kl_k3: float
    repeats: int = 1


def run(args: argparse.Namespace, workload_prompts: Callable, write_table: Callable) -> list[MismatchRow]:
    """The table by dtype; `workload_prompts` and `write_table` are rollout.tools.bench's (which calls this)."""
    from transformers import AutoModelForCausalLM

    from rollout.engine.engine import Engine
    from rollout.models.default_model import resolve_model_path

    args.output_len = args.output_len or 256
    temperature = float((args.temperature or "1.0").split(",")[0])
    batch = int(args.batch_sizes.split(",")[0])
    args.spec = args.spec_modes.split(",")[0]
    start = args.trainer_start or "checkpoint"
    rows = []
    for dtype in (args.dtypes or default_dtypes(args.device)).split(","):
        args.dtype = dtype
        engine = Engine(config=EngineConfig.from_args(args))
        prompts, n = workload_prompts(args, engine.tokenizer, batch)
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(engine.config.model), dtype=torch.float32)
        hf = hf.to(engine.device).eval()
        start_trainer_weights(hf, start, engine.dtype)
        rounds = []
        for r in range(args.repeats):
            seed = args.seed + 20_000 * r
            rollout(engine, prompts, SamplingParams(n=n, temperature=temperature, max_new_tokens=args.output_len,
                                                    seed=seed + 10_000))  # warm-up: kernels, graphs
            params = SamplingParams(n=n, temperature=temperature, max_new_tokens=args.output_len, seed=seed)
            samples, seconds = rollout(engine, prompts, params)
            rounds.append(measure(hf, samples, seconds, (dtype, islands(engine.config), start), temperature))
            print(table([rounds[-1]]).splitlines()[-1], flush=True)
        rows.append(median(rounds))
        engine.close()
        del engine, hf
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_table(args, table(rows), {"rows": [asdict(r) for r in rows]})
    return rows


def rollout(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[tuple[list[int], object]], float]:
    """(prompt, output) of every sample, and the rollout's seconds."""
    engine.clear_speculation_history()
    start = time.perf_counter()
    groups = engine.generate(prompts, params, return_logprob=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return [(p, o) for p, g in zip(prompts, groups) for o in g], time.perf_counter() - start


def islands(config: EngineConfig) -> str:
    if config.enable_fp32_activations:
        return "activations (residual, lm head input and between the products)"
    named = [name for name, on in (("residual", config.enable_fp32_residual), ("lm head input", config.enable_fp32_lm_head))
             if on]
    return ", ".join(named) or "-"


def measure(hf, samples, seconds: float, labels: tuple[str, str, str], temperature: float) -> MismatchRow:
    """The row of one rollout; `labels` are its dtype, fp32 and trainer columns."""
    trainer = []
    with torch.no_grad():
        for i in range(0, len(samples), MICRO_BATCH):
            chunk = [(p, o) for p, o in samples[i : i + MICRO_BATCH] if o.token_ids]
            if chunk:
                trainer += teacher_forced_logprobs(hf, [p for p, _ in chunk], [o.token_ids for _, o in chunk], temperature)
    rollout_lp = torch.tensor([lp for _, o in samples for lp in o.logprobs])
    stats = mismatch_stats(torch.cat(trainer).cpu(), rollout_lp)
    tokens = len(rollout_lp)
    return MismatchRow(*labels, len(samples), tokens, tokens / seconds, **stats)


def median(rounds: list[MismatchRow]) -> MismatchRow:
    keys = ("tokens_per_s",) + MISMATCH_KEYS
    return replace(rounds[0], **{k: statistics.median(getattr(r, k) for r in rounds) for k in keys}, repeats=len(rounds))


def table(rows: list[MismatchRow]) -> str:
    base = next((r for r in rows if r.dtype == "bfloat16"), None)
    lines = ["| dtype | fp32 | trainer | samples | tokens | mean abs logprob diff vs fp32 trainer | vs bf16 | p99 | max | "
             "KL k3 | tok/s |", "|" + "---|" * 11]
    for r in rows:
        ratio = "-"
        if base is not None and r is not base:
            lower = base.logprob_mismatch_mean / max(r.logprob_mismatch_mean, 1e-12)
            ratio = f"{lower:.1f}x lower" if lower < 1000 else "over 1000x lower"
        lines.append(f"| {r.dtype} | {r.fp32} | {r.trainer} | {r.samples} | {r.tokens} | {r.logprob_mismatch_mean:.5f} | {ratio} | "
                     f"{r.logprob_mismatch_p99:.4f} | {r.logprob_mismatch_max:.3f} | {r.kl_k3:.2e} | {r.tokens_per_s:,.1f} |")
    return "\n".join(lines) + "\n"


def default_dtypes(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "bfloat16,float16,float32" if cuda else "float32,float16,bfloat16"

