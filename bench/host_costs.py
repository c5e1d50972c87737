"""Host-side costs that need no GPU to measure, on the CPU.

    python bench/host_costs.py trie-gc [--freeze]   # feed 512 streams into the tries: time and GC
    python bench/host_costs.py verify-host          # where a verify step's host time goes (tiny model)
    python bench/host_costs.py decode-host          # the same for a decode step of 256 sequences
    python bench/host_costs.py engine-gc            # one full GC with the default engine built
    python bench/host_costs.py budget-plan [--budget-file F]   # the draft budget's planning time per step
    python bench/host_costs.py trie-feed [--trie-file F]       # building prompt tries, feeding new text
    python bench/host_costs.py upkeep-poll      # the upkeep's feed of one sequence against a poll of the device

trie-gc: 64 prompts (60 tokens) x 8 samples, 256 tokens each, fed one token per call as the
engine's upkeep does; prints the wall time (and that of admitting the prompts, and of the
first token's feed, which builds their tries) and, per GC generation, the collections and
time spent
(`--freeze` first moves every object alive, torch's included, out of the collector's sight).
verify-host: a random-weight 2-layer model at 64 sequences, drafting every step (fixed
budget), under cProfile; prints ms per step of the runner's and drafter's host functions.
decode-host: the same at 256 sequences (32 prompts x 8), speculation off.
budget-plan: `DraftBudget.for_batch` at 8, 64 and 128 sequences (3, 3 and 1 draft tokens each
at most) with every step shape measured and each sequence's chance ~0.3, so that every token
is ranked and the prefixes are searched; median of 15 rounds of 100 calls. It runs before
each launch. `--budget-file` times another version of spec/budget.py in the same rounds
(e.g. `git show REV:spec/budget.py > /tmp/old_budget.py`).
trie-feed: 16 prompt tries (60 random tokens each), then 8 streams each fed 256 tokens of
little repetition one at a time (T=1-like text: nearly every token makes max_depth new
nodes); medians of 7 rounds. `--trie-file` times another spec/ngram_trie.py in alternating
rounds.
upkeep-poll: 32 prompt tries (90 random tokens) x 8 streams, each fed one token per step as
`DrafterUpkeep` does, 100 steps: the median time to feed one sequence; on CUDA also the time
of one `torch.cuda.Event.query()` (the upkeep's poll), median of 1,000. Their ratio sets
`spec.upkeep.POLL_EVERY`.
engine-gc: builds the default engine on the default device and times full collections
before and after `freeze_heap()` (the time any step may lose to one).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def trie_gc(freeze: bool) -> None:
    from spec.ngram import NgramConfig, NgramDrafter

    spent: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[info["generation"]] += time.perf_counter() - started[0]
            count[info["generation"]] += 1

    if freeze:
        gc.collect()
        gc.freeze()
    gc.callbacks.append(on_gc)
    drafter = NgramDrafter(NgramConfig())
    rng = random.Random(0)
    start = time.perf_counter()
    seq_ids = []
    for group in range(64):
        drafter.add_group(group, [rng.randrange(49152) for _ in range(60)])
        for _ in range(8):
            seq_ids.append(len(seq_ids))
            drafter.add_sequence(group, seq_ids[-1])
    admitted = time.perf_counter()
    for i in range(256):
        for seq_id in seq_ids:
            drafter.extend(seq_id, [rng.randrange(2000)])
        if i == 0:
            first_feed = time.perf_counter()  # builds the prompts' tries (spec/ngram.py)
    wall = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    per_generation = ", ".join(f"gen {g}: {count[g]} in {spent[g]:.3f} s" for g in sorted(count))
    print(f"trie-gc{' --freeze' if freeze else ''}: {drafter.memory_nodes()} nodes, feed {wall:.2f} s "
          f"(admitting the 64 prompts {(admitted - start) * 1e3:.1f} ms, the first token's feed, which builds "
          f"their tries, {(first_feed - admitted) * 1e3:.1f} ms); {per_generation}")
    start = time.perf_counter()
    gc.collect()
    print(f"  one full collection now: {time.perf_counter() - start:.3f} s")


def step_host(what: str) -> None:
    """verify-host: 64 sequences drafting every step; decode-host: 256 sequences, spec off."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_tiny_model

    from rollout.config import EngineConfig, SamplingParams, SpecConfig
    from rollout.engine import Engine

    model_dir = Path(tempfile.mkdtemp())
    make_tiny_model("llama", model_dir)
    verify = what == "verify-host"
    spec = SpecConfig(method="ngram", adaptive=False) if verify else SpecConfig(method="off")
    eng = Engine(config=EngineConfig(model=str(model_dir), device="cpu", spec=spec))
    num_prompts = 8 if verify else 32
    prompts = [[p + i for p in [5, 6, 7, 8, 9, 10, 11, 12] * 4] for i in range(num_prompts)]
    params = SamplingParams(n=8, temperature=0.0, max_new_tokens=100, ignore_eos=True)
    eng.generate(prompts, params)  # warm-up
    eng.reset_stats()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    eng.generate(prompts, params)
    profile.disable()
    wall = time.perf_counter() - start
    steps = eng.stats()["rollout/steps"]
    print(f"{what}: {8 * num_prompts} sequences, {steps} steps, {wall / steps * 1e3:.2f} ms per step (model included)")
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, prim calls, tottime, cumtime, callers)
    wanted = ("schedule", "_decode_layout", "_tree_layout", "_emit", "_emit_trees", "_draft", "propose", "apply",
              "_append", "_complete")
    for (path, _, name), (_, _, _, cumtime, _) in sorted(stats.items(), key=lambda kv: -kv[1][3]):
        if name in wanted and ("rollout" in path or "spec" in path):
            print(f"  {Path(path).name}:{name:14s} {cumtime / steps * 1e3:.3f} ms per step")


def engine_gc() -> None:
    from rollout.config import SamplingParams
    from rollout.engine import Engine, freeze_heap

    eng = Engine()
    eng.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=8))  # compiled kernels and graphs exist too
    for label in ("engine built", "after freeze_heap()"):
        if label != "engine built":
            freeze_heap()
        gc.collect()  # garbage from start-up first: the next one is what a step pays
        start = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - start
        print(f"engine-gc on {eng.device}, {label}: full collection {took * 1e3:.1f} ms, "
              f"{len(gc.get_objects())} objects tracked, {gc.get_freeze_count()} frozen")
    gc.unfreeze()


def budget_plan(other: str | None) -> None:
    from types import SimpleNamespace

    from budget_replay import load_budget_class

    from spec.budget import COST_WINDOW

    versions = {"this checkout": load_budget_class(None)}
    if other:
        versions[other] = load_budget_class(other)
    for n in (8, 64, 128):
        seqs = [SimpleNamespace(seq_id=i) for i in range(n)]
        budgets = {}
        for name, cls in versions.items():
            budget = budgets[name] = cls(8, 256)
            for drafts in range(0, n * budget.per_sequence_cap(n) + 1):
                for _ in range(COST_WINDOW):
                    budget.observe_step(n, drafts, 1e-3 + drafts * 1e-6)
            for s in range(n):
                budget.observe(s, 0, True)
        rounds: dict[str, list[float]] = defaultdict(list)
        for _ in range(15):  # the versions alternate, so drift hits them alike
            for name, budget in budgets.items():
                start = time.perf_counter()
                for _ in range(100):
                    budget.for_batch(seqs)
                rounds[name].append((time.perf_counter() - start) / 100)
        times = ", ".join(f"{name} {statistics.median(r) * 1e6:.1f} us" for name, r in rounds.items())
        print(f"budget-plan: {n} sequences, per step: {times}")


def trie_feed(other: str | None) -> None:

    from budget_replay import module_from_file

    from spec import ngram_trie

    versions = {"this checkout": ngram_trie}
    if other:
        versions[other] = module_from_file(other, "other_trie")
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(60)] for _ in range(16)]
    outputs = [[rng.randrange(2000) for _ in range(256)] for _ in range(16 * 8)]

    def run(module) -> tuple[float, float]:
        start = time.perf_counter()
        budget = module.NodeBudget(10**7)
        tries = []
        for prompt in prompts:
            trie = module.NgramTrie(14, budget)
            stream = trie.open_stream()
            trie.extend(stream, prompt)
            tries.append((trie, stream))
        built = time.perf_counter()
        streams = [(trie, trie.open_stream(fork_of=stream)) for trie, stream in tries for _ in range(8)]
        for i in range(256):
            for (trie, stream), out in zip(streams, outputs):
                trie.extend(stream, (out[i],))
        return built - start, time.perf_counter() - built

    gc.collect()
    gc.freeze()  # the collector's share is trie-gc's subject, not this one's
    rounds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in range(7):  # alternating, each version first in turn
        for name, module in sorted(versions.items(), reverse=r % 2 == 1):
            rounds[name].append(run(module))
            gc.collect()
    for name, times in rounds.items():
        build = statistics.median(b for b, _ in times)
        feed = statistics.median(f for _, f in times)
        print(f"trie-feed, {name}: 16 prompt tries {build * 1e3:.1f} ms, 128 streams x 256 tokens {feed:.3f} s")
    gc.unfreeze()


def upkeep_poll() -> None:
    from types import SimpleNamespace

    import torch

    from spec.ngram import NgramDrafter
    from spec.upkeep import DrafterUpkeep

    rng = random.Random(0)
    drafter = NgramDrafter()
    upkeep = DrafterUpkeep(drafter, max_step_tokens=9)
    seqs = []
    for g in range(32):
        prompt = [rng.randrange(49152) for _ in range(90)]
        drafter.add_group(g, prompt)
        for j in range(8):
            drafter.add_sequence(g, 8 * g + j)
            seqs.append(SimpleNamespace(seq_id=8 * g + j, tokens=list(prompt)))
    per_seq = []
    for step in range(101):
        for seq in seqs:
            seq.tokens.append(rng.randrange(500))  # a small alphabet: n-grams repeat, as in real text
        t0 = time.perf_counter()
        upkeep.step(seqs)
        upkeep.apply()
        if step:  # the first step builds the prompt tries
            per_seq.append((time.perf_counter() - t0) / len(seqs))
    print(f"upkeep-poll: feeding one sequence {statistics.median(per_seq) * 1e6:.2f} us (median of 100 steps)")
    if torch.cuda.is_available():
        event = torch.cuda.Event()
        event.record()
        torch.cuda.synchronize()
        polls = []
        for _ in range(1000):
            t0 = time.perf_counter()
            event.query()
            polls.append(time.perf_counter() - t0)
        print(f"upkeep-poll: one Event.query() {statistics.median(polls) * 1e6:.2f} us (median of 1,000)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["trie-gc", "verify-host", "decode-host", "engine-gc", "budget-plan", "trie-feed",
                                     "upkeep-poll"])
    ap.add_argument("--freeze", action="store_true")
    ap.add_argument("--budget-file", default=None, help="budget-plan: also time this spec/budget.py, alternating")
    ap.add_argument("--trie-file", default=None, help="trie-feed: also time this spec/ngram_trie.py, alternating")
    args = ap.parse_args()
    if args.what == "trie-gc":
        trie_gc(args.freeze)
    elif args.what == "engine-gc":
        engine_gc()
    elif args.what == "budget-plan":
        budget_plan(args.budget_file)
    elif args.what == "trie-feed":
        trie_feed(args.trie_file)
    elif args.what == "upkeep-poll":
        upkeep_poll()
    else:
        step_host(args.what)


if __name__ == "__main__":
    main()
