"""`rollout bench`: offline throughput runs; every speed figure in the README comes from here.

Workloads (all requests submitted at once, timed from submission to the last token):
  decode    B sequences of random prompt tokens, fixed output length (EOS ignored)
  grpo      B sequences = B/n prompts x n samples; arithmetic and/or HumanEval chat prompts
  rl        as grpo, the way RL rolls out: T = 1.0 and up to 2,048 new tokens by default, EOS
            stops, so outputs are long and their lengths vary (the long tail)
  sharegpt  B first-turn ShareGPT prompts
  mismatch  the grpo prompts (arithmetic by default) rolled out once per serving dtype (--dtypes), each
            sample's logprobs against an HF float32 trainer's on its tokens, with tokens/s
            (rollout.tools.bench_mismatch)
With `--url`, the workload goes over HTTP to running servers or a router (rollout.tools.bench_http).
Each row is one (spec mode, batch size), medians over `--repeats` rounds that alternate the
modes; `--baseline-hf` adds HF transformers `generate` on the same prompts in the same run.
Besides tokens/s a row reports the long tail (seconds from the 90th percentile sample's end to
the last one's), acceptance, the share of output tokens found in the drafter's index at the end,
and the time in Python's garbage collector. Results: JSON, a Markdown table, a PNG of tokens/s
by batch size, and for `rl` a PNG of running sequences and tokens/s over time per mode.
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

from rollout.config import EngineConfig
from rollout.tools.bench_args import SPEED_SHAPES
from rollout.tools.mismatch import start_trainer_weights


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
    draft_steps: int = 0  # steps that verified drafts
    preempted: int = 0  # sequences preempted (their KV dropped and recomputed) when the KV pool ran dry
    tail_s: float = 0.0  # from the end of the 90th percentile sample to the end of the last one
    indexed: float = 0.0  # share of the samples' tokens found in the drafter's index at the end (history rows)
    gc_ms: float = 0.0  # time in Python's cyclic garbage collector during the run
    repeats: int = 1  # with --repeats, this row holds medians; tok/s spread in min/max
    tokens_per_s_min: float = 0.0
    tokens_per_s_max: float = 0.0
    accept_rate: float = 0.0
    accept_length: float = 0.0
    coupled_share: float = 0.0  # share of the output tokens that were accepted coupled drafts (--coupled-sampling)
    prefix_share: float = 0.0  # --keep-history: share of the output tokens in the prefix each sample shares with
    prefix_median: float = 0.0  # its sample of the epoch before (same prompt and index), and that prefix's median length


def speed_model_dir(shape: str, config: dict | None = None) -> str:
    """An HF directory with a speed shape's config (or `config`, named `shape`) and the default
    model's tokenizer (weights: random)."""
    from transformers import AutoTokenizer

    from rollout.models.default_model import ensure_default_model

    path = Path(tempfile.mkdtemp(prefix=f"rollout-{shape}-"))
    (path / "config.json").write_text(json.dumps(config or SPEED_SHAPES[shape]))
    AutoTokenizer.from_pretrained(ensure_default_model()).save_pretrained(path)
    return str(path)


@dataclass
class Timeline:
    """Per step of one run: seconds since the start, running sequences, output tokens so far."""

    spec: str
    seconds: list[float]
    running: list[int]
    tokens: list[int]


def workload_prompts(args, tokenizer, batch_size: int) -> tuple[list[list[int]], int]:
    """(prompt token ids, samples per prompt) for one batch size."""
    from rollout.tools.datasets import (
        arithmetic_tasks,
        chat_prompt_ids,
        humaneval_prompts,
        sharegpt_prompts,
    )

    rng = random.Random(args.seed)
    if args.workload == "decode":
        vocab = min(tokenizer.vocab_size, 32000)
        return [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch_size)], 1
    if args.workload in ("grpo", "rl", "mismatch"):
        n = min(args.n, batch_size)
        num_prompts = max(1, batch_size // n)
        prompt_set = args.prompt_set or ("arithmetic" if args.workload == "mismatch" else "mixed")
        arithmetic = {"arithmetic": num_prompts, "humaneval": 0}.get(prompt_set, (num_prompts + 1) // 2)
        texts = [t.question for t in arithmetic_tasks(arithmetic, seed=args.seed)]
        texts += humaneval_prompts(num_prompts - arithmetic) if num_prompts > arithmetic else []
        return [chat_prompt_ids(tokenizer, t) for t in texts], n
    texts = sharegpt_prompts(batch_size, seed=args.seed, path=args.sharegpt_file)
    return [chat_prompt_ids(tokenizer, t)[-args.max_prompt_len :] for t in texts], 1


def run_rollout(engine, args, prompts: list[list[int]], n: int, spec: str, batch_size: int,
                seed: int, keep_history: bool = False) -> tuple[Row, Timeline, list[list[list[int]]]]:
    """One rollout of `prompts`, timed; `keep_history`: the drafter keeps earlier rollouts' samples.
    Returns its row, its timeline and the samples' tokens (per prompt, per sample)."""
    from rollout.config import SamplingParams

    params = [
        SamplingParams(
            n=n, temperature=args.temperature, max_new_tokens=args.output_len,
            ignore_eos=args.workload == "decode" or args.ignore_eos, seed=seed + i,
        )
        for i in range(len(prompts))
    ]
    engine.reset_stats()
    if not keep_history:
        engine.clear_speculation_history()  # no drafting from the warm-up or from other batch sizes
    timeline = Timeline(spec, [], [], [])
    preempted = engine.scheduler.num_preempted
    with GcTimer() as gc_time:
        start = time.perf_counter()
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work:
            engine.step()
            timeline.seconds.append(time.perf_counter() - start)
            timeline.running.append(len(engine.scheduler.running))
            timeline.tokens.append(engine.output_tokens)
        _sync(engine.device)
        wall = time.perf_counter() - start
    samples = [r.detach() for r in reqs]  # (as a caller does once it has read them: Request.detach)
    seqs = [s for group in samples for s in group]
    tokens = sum(s.num_output for s in seqs)
    ends = sorted(s.finished_at - start for s in seqs)
    found, total = engine.table.indexed(seqs)
    st = engine.stats()
    row = Row(
        workload=args.workload, system="rollout", spec=spec, batch_size=batch_size, prompts=len(prompts), n=n,
        temperature=args.temperature, output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        steps=st["rollout/steps"], step_ms_median=statistics.median([r.wall_ms for r in engine.step_log] or [0.0]),
        draft_steps=st["rollout/draft_steps"], preempted=engine.scheduler.num_preempted - preempted,
        tail_s=ends[-1] - ends[int(0.9 * (len(ends) - 1))],
        indexed=found / total if total else 0.0, gc_ms=gc_time.seconds * 1e3,
        accept_rate=st["rollout/spec_accept_rate"], accept_length=st["rollout/spec_accept_length"],
        coupled_share=st.get("rollout/spec_accepted_tokens/coupled", 0) / tokens if tokens else 0.0,
    )
    return row, timeline, [[s.output_ids for s in group] for group in samples]


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
    """One row per (spec, batch size, temperature): the medians of its repeats, with the tok/s spread."""
    groups: dict[tuple[str, int, float], list[Row]] = {}
    for r in runs:
        groups.setdefault((r.spec, r.batch_size, r.temperature), []).append(r)
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
    head = ("| system | spec | batch | prompts x n | temp | out tokens | wall s | tok/s | vs off | tail s | steps | step ms "
            "| draft steps | preempted | indexed | gc ms | accept rate | accept len | coupled | shared prefix |")
    lines = [head, "|" + "---|" * 20]
    off = {(r.batch_size, r.temperature): r for r in rows if r.system == "rollout" and r.spec == "off"}
    for r in rows:
        base = off.get((r.batch_size, r.temperature)) if r.system == "rollout" else None
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        tail = f"{r.tail_s:.2f}" + (f" ({base.tail_s / r.tail_s:.2f}x)" if base and r.tail_s and r is not base else "")
        speed = f"{r.tokens_per_s:.1f}"
        if r.repeats > 1:
            speed += f" ({r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f}, {r.repeats} runs)"
        lines.append(
            f"| {r.system} | {r.spec} | {r.batch_size} | {r.prompts} x {r.n} | {r.temperature} | {r.output_tokens:.0f} | "
            f"{r.wall_s:.2f} | {speed} | {ratio} | {tail} | {r.steps:.0f} | {r.step_ms_median:.2f} | "
            f"{r.draft_steps:.0f} | {r.preempted:.0f} | {r.indexed:.0%} | {r.gc_ms:.1f} | {r.accept_rate:.3f} | {r.accept_length:.2f} | "
            f"{r.coupled_share:.0%} | {r.prefix_share:.0%} (median {r.prefix_median:.0f}) |"
        )
    return "\n".join(lines) + "\n"


def plot_timelines(timelines: list[Timeline], path: Path, title: str) -> None:
    """Running sequences and tokens/s over time, one line per run, per spec mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    colors: dict[str, str] = {}
    for t in timelines:
        label = None if t.spec in colors else t.spec  # one legend entry per mode
        color = colors.setdefault(t.spec, f"C{len(colors)}")
        top.plot(t.seconds, t.running, color=color, alpha=0.7, label=label)
        sec, tok = torch.tensor(t.seconds), torch.tensor(t.tokens, dtype=torch.float64)
        step = max(1, len(sec) // 60)  # tokens/s over windows of about 1/60 of the run
        rate = (tok[step:] - tok[:-step]) / (sec[step:] - sec[:-step]).clamp(min=1e-9)
        bottom.plot(sec[step:].tolist(), rate.tolist(), color=color, alpha=0.7)
    top.set_ylabel("running sequences")
    top.legend(title="spec")
    bottom.set_ylabel("output tokens / s")
    bottom.set_xlabel("seconds since submission")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


GRAPH_SHARE = 0.05  # of the GPU's free memory, left per engine after the first for its CUDA graphs


def first_pool_fraction(fraction: float, engines: int, device: str) -> float | None:
    """For `engines` engines on one GPU: the first engine's kv_cache_memory_fraction (of the
    memory free after its weights, which the others share at TP1), such that the pools of all of
    them, each as large as the first's, take `fraction` of it less GRAPH_SHARE per engine after
    the first. Each engine's graphs and activations (several GB at the Qwen3-30B-A3B shape's b512
    graphs), and at TP > 1 the later engines' own weights, come out of what the pools leave.
    None off the GPU or for one engine (its own config decides)."""
    if engines == 1 or device == "cpu" or not torch.cuda.is_available():
        return None
    return max(fraction - GRAPH_SHARE * (engines - 1), GRAPH_SHARE) / engines


def size_pool(config: EngineConfig, first, pool_fraction: float | None) -> None:
    """An engine's KV pool among the bench's engines on one GPU: the first takes `pool_fraction`
    (first_pool_fraction), the later ones the first's size in tokens (`first`: that engine, or None
    while building it); a configured size stays."""
    if pool_fraction is None or config.kv_cache_tokens:
        return
    if first is None:
        config.kv_cache_memory_fraction = pool_fraction
    else:
        config.kv_cache_tokens = first.pool.num_slots - 1


def bench_grid(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """The temperatures and batch sizes a run covers; fills in the workload's default output length."""
    rl = args.workload == "rl"
    args.output_len = args.output_len or (2048 if rl else 128)
    temperatures = [float(t) for t in (args.temperature or ("1.0" if rl else "0")).split(",")]
    return temperatures, [int(b) for b in args.batch_sizes.split(",")]


def cmd_bench(args: argparse.Namespace) -> None:
    from rollout.engine.engine import Engine, freeze_heap, thaw_heap

    if args.workload == "mismatch":
        if args.random_model:
            raise ValueError("--workload mismatch compares against the model's own checkpoint; drop --random-model")
        from rollout.tools import bench_mismatch

        bench_mismatch.run(args, workload_prompts, write_table)
        return
    if args.random_model:
        if args.baseline_hf:
            raise ValueError("--baseline-hf needs a real checkpoint; drop it with --random-model")
        args.model = speed_model_dir(args.random_model)
        args.load_format = "dummy"
    temperatures, batch_sizes = bench_grid(args)
    rows: list[Row] = []
    runs: list[Row] = []
    timelines: list[Timeline] = []
    modes = args.spec_modes.split(",")
    engines = {}
    draft_model = getattr(args, "spec_draft_model", None)
    pool_fraction = first_pool_fraction(args.kv_cache_memory_fraction, len(modes), args.device)
    for spec in modes:  # one engine per mode, kept across rounds, serving one model: GPU memory split between their pools
        args.spec, args.spec_draft_model = spec, draft_model if spec in ("eagle", "auto") else None  # (a head's modes)
        config = EngineConfig.from_args(args)
        size_pool(config, engines.get(modes[0]), pool_fraction)
        first = engines[modes[0]] if engines and config.tp_size == 1 else None  # (rank processes hold their own)
        engines[spec] = Engine(config=config, share_weights_with=first)
    freeze_heap()  # as the server's engine process does
    trainer = (EpochUpdate(engines[modes[0]], args.epoch_update, args.epoch_update_samples, args.trainer_start or "served")
               if args.epoch_update else None)
    for r in range(args.repeats):  # rounds interleave the spec modes, so drift hits them alike
        # Each round draws its own samples (every mode the same seeds in it): on the GPU the modes'
        # samples part ways (a verify step's bf16 logits are not a decode step's), and a
        # rollout's wall time can hang on its longest sample (rl at T=0.7: spec off's ran to
        # the 2,048-token limit), so rounds of one seed would repeat one draw, not sample them.
        seed = args.seed + 20_000 * r
        # the warm-up (other seeds; coupled: the same) compiles kernels and captures this size's graphs;
        # with --keep-history it is also the previous epoch whose samples the drafter remembers
        warm_seed = seed if args.coupled_sampling else seed + 10_000
        for args.temperature in temperatures:
            for b in batch_sizes:
                prompts, n = workload_prompts(args, engines[modes[0]].tokenizer, b)
                first_epoch = {}
                for spec in modes:
                    if trainer is not None:
                        trainer.restore(engines[spec])
                    first_epoch[spec] = run_rollout(engines[spec], args, prompts, n, spec, b, seed=warm_seed)[2]
                if trainer is not None:  # a trainer's step on the first epoch's samples, pushed to every mode
                    update = trainer.step(prompts, first_epoch[modes[0]])
                    for spec in modes:
                        engines[spec].update_weights(update)
                for spec in modes:
                    args.spec = spec
                    row, timeline, samples = run_rollout(engines[spec], args, prompts, n, spec, b, seed=seed,
                                                         keep_history=args.keep_history)
                    if args.keep_history:  # where each sample parted from its sample of the epoch before
                        shared = [common_prefix(a, b_) for g, h in zip(samples, first_epoch[spec]) for a, b_ in zip(g, h)]
                        row.prefix_share = sum(shared) / max(1, row.output_tokens)
                        row.prefix_median = statistics.median(shared)
                    runs.append(row)
                    timelines.append(timeline)
                    print(markdown(runs[-1:]).splitlines()[-1], flush=True)
                    budget_keys = ("rollout/spec_accept_estimate", "rollout/spec_accept_slowest", "rollout/spec_cost",
                                   "rollout/spec_draft_rows", "rollout/spec_head", "rollout/spec_accept_rate/")
                    spec_stats = {k.removeprefix("rollout/spec_"): round(v, 3) for k, v in engines[spec].stats().items()
                                  if k.startswith(budget_keys)}
                    if spec_stats:
                        print(f"  budget: {spec_stats}", flush=True)
    tokenizer = engines[modes[0]].tokenizer
    for engine in engines.values():
        engine.close()  # (its other tensor-parallel ranks)
    engine = None
    del engine, engines, trainer
    thaw_heap()  # the engines hold reference cycles: free their KV pools before HF's model loads
    rows += median_rows(runs)
    if args.baseline_hf:
        from transformers import AutoModelForCausalLM

        engine_cfg = EngineConfig.from_args(args)
        device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        from rollout.models.default_model import resolve_model_path

        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(engine_cfg.model), dtype=dtype).to(device).eval()
        for args.temperature in temperatures:
            for b in batch_sizes:
                prompts, n = workload_prompts(args, tokenizer, b)
                rows.append(run_hf(hf, tokenizer, args, prompts, n, b))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    write_results(args, rows, timelines, batch_sizes)


def write_results(args, rows: list[Row], timelines: list[Timeline], batch_sizes: list[int]) -> None:
    """The rows as JSON, a Markdown table and a PNG (and for `rl` the timelines' PNG) under --out."""
    path = write_table(args, markdown(rows), {"rows": [asdict(r) for r in rows]})
    device = _device_name()
    plot(rows, path.with_suffix(".png"), f"{args.workload} on {device}")
    if args.workload == "rl" and timelines:
        plot_timelines(timelines, path.parent / f"{path.stem}-timeline.png", f"rl, {batch_sizes[-1]} sequences, on {device}")
    print(f"wrote {path.with_suffix('')}.{{json,md,png}}")


def write_table(args, table: str, payload: dict) -> Path:
    """A run's Markdown table (with its command and device) and JSON (`payload` and the same meta)
    under --out, named by workload, model and time; prints the table, returns the .md's path."""
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{args.workload}-{args.random_model or Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    meta = {"command": args.command_line, "device": _device_name(), "torch": torch.__version__}
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, **payload}, indent=1))
    (out_dir / f"{name}.md").write_text(f"`{meta['command']}` on {meta['device']}\n\n{table}")
    print(f"\n{table}")
    return out_dir / f"{name}.md"


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two samples share from their start."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def match_chances(old_logits: torch.Tensor, new_logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, V] logits of the old and new policy (at T=1) and the old sample's tokens [L] -> at each
    position, given the same prefix, the chance that the new draw is the old token: under shared
    Gumbel noise (the two argmaxes agree), and under exact verification of the old token as a draft
    (min(1, q/p), speculative sampling's)."""
    logp, logq = old_logits.float().log_softmax(-1), new_logits.float().log_softmax(-1)
    lp_x, lq_x = logp.gather(1, tokens[:, None]), logq.gather(1, tokens[:, None])
    gumbel = 1.0 / torch.maximum(logp, logq + lp_x - lq_x).exp().sum(-1)
    exact = (lq_x - lp_x).exp().clamp(max=1.0).squeeze(1)
    return gumbel.clamp(max=1.0), exact


def expected_prefix(chances: torch.Tensor) -> float:
    """Positions' match chances -> the expected number of leading tokens matched."""
    return float(chances.double().cumprod(0).sum())


class EpochUpdate:
    """A trainer between two epochs of `rl --keep-history`: one policy-gradient step (REINFORCE, the
    group-normalised advantage of a reward that prefers shorter samples) with AdamW at `lr` on the
    first epoch's samples, in fp32 on the engine's device; the result goes to the engines in their
    dtype (as a trainer pushes it). Each round starts the trainer's float32 weights from `start`
    (rollout.tools.mismatch.start_trainer_weights)."""

    def __init__(self, engine, lr: float, samples: int, start: str = "served"):
        from transformers import AutoModelForCausalLM

        self.lr, self.samples = lr, samples
        self.dtype = engine.dtype
        self.model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).to(engine.device)
        start_trainer_weights(self.model, start, self.dtype)
        self.base = {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def restore(self, engine) -> None:
        """Both the trainer and `engine` back to the model's own weights."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.base[name])
        engine.update_weights((n, t.to(self.dtype)) for n, t in self.base.items())

    def step(self, prompts: list[list[int]], samples: list[list[list[int]]]) -> list[tuple[str, torch.Tensor]]:
        device = next(self.model.parameters()).device
        pairs = [(p, s) for p, group in zip(prompts, samples) for s in group][: self.samples]
        n = len(samples[0])
        lengths = torch.tensor([len(s) for _, s in pairs], dtype=torch.float32)
        reward = -lengths.view(-1, n) if len(pairs) % n == 0 else -lengths.view(1, -1)
        adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0, fused=True)
        tokens = max(1, int(lengths.sum()))
        for (prompt, sample), a in zip(pairs, adv.tolist()):
            if not sample:
                continue
            ids = torch.tensor([prompt + sample], device=device)
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None]).sum()
            (-a * lp / tokens).backward()
        optimizer.step()
        return [(name, p.detach().to(self.dtype)) for name, p in self.model.named_parameters()]


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({torch.get_num_threads()} threads)"
