"""Step profiles that `rollout bench` does not cover: one kernel against the step it lives in (GPU).

    python bench/step_profile.py draft [--seqs 512] [--output-len 1000] [--history 8] [--width 8]
    python bench/step_profile.py sampling
    python bench/step_profile.py steps [--prompts 64] [--n 8] [--temperature 1.0] [--output-len 2048] [--device cuda]
    python bench/step_profile.py steps --modes off,deterministic   # deterministic inference's rollout by bucket
    python bench/step_profile.py host [--prompts 64] [--n 8] [--temperature 1.0] [--output-len 256] [--fixed]
    python bench/step_profile.py host --random-model host-probe --device cpu   # the host's work alone, on any machine
    python bench/step_profile.py collect [--prompts 64] [--n 8] [--temperature 1.0] [--output-len 64] [--device cuda]
    python bench/step_profile.py verify [--seqs 128] [--context 2000] [--draft-rows 0,16,...]
    python bench/step_profile.py budget [--seqs 512]
    python bench/step_profile.py head --head DIR [--spec eagle] [--head-trees 1,2,3,5,8,3x2,4x4] [--sharegpt-file F]
    python bench/step_profile.py head --random-model llama3-8b [--prompts 2] [--output-len 128]
    python bench/step_profile.py headcost --head DIR [--seqs 1,64] [--context 600] [--head-steps 3] [--head-topk 1]
    python bench/step_profile.py accept --head DIR [--temperature 1.0] [--prompts 12] [--device cpu]

- draft: the n-gram drafting kernel's device time against a replay of the default model's
  decode graph at the same batch size. Token rows as an RL rollout leaves them: `--seqs` live
  samples in groups of 8 (prompts of 100 tokens, `--output-len` output tokens drawn from a
  short motif per prompt, so that matches are found) and `--history` finished samples per prompt.
- sampling: drawing one token per logits row, the fused kernels against the torch reference,
  each alone in a CUDA graph, over the default model's vocabulary.
- steps: where a rollout's time goes, spec off against n-gram (`--modes`: or against spec off under
  --enable-deterministic-inference, `deterministic`): the `rl` workload's prompts
  (one warm-up rollout each, then the measured one): its wall by part (prefill steps, decode
  steps, outside the steps, the garbage collector), its steps grouped by batch-size bucket and
  draft rows from `Engine.step_log`, and whether the drafter ran (it does with no draft rows for the
  budget's statistics): how many, and the median wall, device and host milliseconds.
- host: where the host's time per decode step goes, spec off against n-gram (`--fixed`: the
  budget off, every step verifies as many drafts as fit): cProfile around the measured
  rollout's steps, functions by their own time per decode step; the wait for the device is the
  `synchronize` row.
- collect: the host's time to collect a decode step, by part (the device's results read into
  tokens, the KV slots settled, the tokens appended to their sequences), per decode step and per
  sequence in it, wall clock around each part (cProfile's per-call cost inflates these ~2x), spec
  off against n-gram; on any device (the CPU's host runs the same Python).
- verify: what a step's draft rows cost the device, apart from acceptance: `--seqs` sequences
  with `--context` tokens of KV each, the captured decode/verify graph of each number of draft
  rows replayed (what the engine runs; default: the budget's choices for that batch), then the
  eager step's kernels by device time with none, the fewest and the most.
- budget: the speculation object's own host work per step, on any machine (no model): the
  budget's plan, with and without a drafting step measured since the last (which refits its
  line), recording a step's period, and scoring one step's returned trees, at `--seqs`
  sequences, with the budget in the state a long rollout leaves it (every bucket and capacity
  measured, acceptance known per bucket).
- head: a draft head's acceptance, tok/s and step time by tree, depth x topk (`--spec-head-steps`,
  `--spec-head-topk`; a depth alone is a chain), every step verifying the whole tree (the
  likeliest 8 nodes, or the chain however long), ShareGPT prompts one at a time, against spec off in the
  same run; with `--random-model`, random prompts to a target of that shape and a random EAGLE-3
  head of the shape published for it (what a draft-and-verify step costs against a decode step).
- headcost: what a draft head adds to a step, the hybrid's steps by kind (decode, verify of a
  draft row per sequence; each plain, with the head's pass, with its pass and next tree): graph
  replays and, eager, the kernels launched; then the head's own kernels by name.
- accept: what a draft head's first draft would be accepted at `--temperature`, offline and
  teacher-forced on the default model's own samples of the rl prompts (as recipes/train_eagle.py
  runs a head, 3 steps): drafted by argmax (the target's p(x); at T=0, whether x is its argmax),
  drawn from the head (sum of min(p, q): kernels/sampled_tree_accept.py), or its top k as
  siblings (their p summed), and a 3-draft chain's expected accepted drafts.

Each prints a Markdown table.
"""

from __future__ import annotations

import argparse

import torch

from kernels import skinny_gemm
from rollout.tools.bench_args import SPEED_SHAPES

HOST_PROBE = {  # a forward and a draw that cost next to nothing on a CPU: what is left of a step is the host's own work
    "model_type": "llama", "vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "eos_token_id": 2, "rope_theta": 10000.0,
}


def draft(args: argparse.Namespace) -> None:
    import triton

    from kernels.ngram_draft import draft_trees
    from rollout import Engine
    from spec.speculator import CANDIDATES, SCAN_WIDTH

    engine = Engine(model="default", spec="ngram", device="cuda", max_running_seqs=args.seqs,
                    max_model_len=args.output_len + 2000)
    table = engine.table
    g = torch.Generator().manual_seed(0)
    prompt_len, length = 100, 100 + args.output_len
    scan = torch.full((args.seqs, SCAN_WIDTH), -1, dtype=torch.int32)
    for p in range(args.seqs // 8):
        prompt = torch.randint(0, 49152, (prompt_len,), generator=g)
        motif = torch.randint(0, 49152, (24,), generator=g)
        history = range(table.history_start + args.history * p, table.history_start + args.history * (p + 1))
        rows = list(range(8 * p, 8 * p + 8)) + list(history)
        for r in rows:
            out = motif[torch.randint(0, 24, (args.output_len,), generator=g)]
            table.tokens[r, :length] = torch.cat([prompt, out]).to(torch.int32)
            table.lengths[r] = length
            table.prompt_lens[r] = prompt_len
        for r in range(8 * p, 8 * p + 8):
            scan[r, : min(len(rows), SCAN_WIDTH)] = torch.tensor(rows[:SCAN_WIDTH], dtype=torch.int32)
    rows = torch.arange(args.seqs, dtype=torch.int32, device="cuda")
    scan, cfg = scan.cuda(), engine.config.spec

    def run_draft():
        return draft_trees(table.tokens, table.lengths, table.prompt_lens, table.history_start, rows, scan,
                           cfg.max_match, cfg.min_match, CANDIDATES, args.width, args.width)

    found = int((run_draft()[1][:, 1:] >= 0).any(dim=1).sum())
    draft_ms = triton.testing.do_bench(run_draft, return_mode="median")
    graphs = engine.runner.graphs
    decode = graphs.graph(graphs.shape(args.seqs, 0, False, False, "sample"))
    decode.inputs.rows.copy_(rows)  # the filled rows: attention over their whole context
    decode.inputs.params[0].fill_(1.0)  # temperature
    step_ms = triton.testing.do_bench(decode.graph.replay, return_mode="median")
    print(f"{args.seqs} sequences of {length} tokens, {args.history} history rows per prompt, width {args.width}: "
          f"{found} trees with drafts")
    print("| drafting kernel us | decode step us | ratio |\n|---|---|---|")
    print(f"| {draft_ms * 1e3:.1f} | {step_ms * 1e3:.1f} | {draft_ms / step_ms:.1%} |")


def sampling(args: argparse.Namespace) -> None:
    from rollout.engine.sampler import SamplingTensors, sample, sample_reference

    print(f"{torch.cuda.get_device_name()}: us per draw, alone in a CUDA graph")
    print("| vocab | rows | mode | fused kernels | torch reference | ratio |\n|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab, rows in ((v, r) for v in map(int, args.vocabs.split(",")) for r in (1, 8, 64, 128, 256, 512)):
        logits = torch.randn(rows, vocab, generator=g, device="cuda") * 4
        for mode in ("greedy", "sample"):
            st = SamplingTensors(
                temperature=torch.full((rows,), 0.0 if mode == "greedy" else 1.0, device="cuda"),
                top_k=torch.zeros(rows, dtype=torch.int64, device="cuda"),
                top_p=torch.ones(rows, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                keys=torch.randint(0, 2**32, (rows,), generator=g, device="cuda"),
                positions=torch.arange(rows, device="cuda"),
                all_greedy=mode == "greedy", any_truncation=False,
            )
            fused = skinny_gemm.graph_ms(lambda logits=logits, st=st: sample(logits, st)) * 1e3
            ref = skinny_gemm.graph_ms(lambda logits=logits, st=st: sample_reference(logits, st)) * 1e3
            print(f"| {vocab} | {rows} | {mode} | {fused:.1f} | {ref:.1f} | {ref / fused:.1f}x |")


MODES = {"off": ("off", {}), "ngram": ("ngram", {}),  # (_each_mode's engines: the spec method, other EngineConfig fields)
         "deterministic": ("off", {"enable_deterministic_inference": True})}


def _each_mode(args: argparse.Namespace, run, adaptive: bool = True) -> None:
    """For each of args.modes (MODES; spec off, then n-gram by default): an engine on the rl workload's
    prompts (args.prompts x args.n), warmed up by one rollout (graphs, kernels, the budget's costs), its
    stats reset; then
    `run(mode, engine, prompts, params)`. Each engine's memory is back before the next is built."""
    from types import SimpleNamespace

    from rollout import Engine, SamplingParams
    from rollout.config import SpecConfig
    from rollout.engine.engine import freeze_heap, thaw_heap
    from rollout.tools.bench import speed_model_dir, workload_prompts

    shape = args.random_model
    model = speed_model_dir(shape, HOST_PROBE if shape == "host-probe" else None) if shape else "default"
    for mode in args.modes.split(","):
        method, config = MODES[mode]
        engine = Engine(model=model, spec=SpecConfig(method=method, adaptive=adaptive), device=args.device,
                        max_running_seqs=args.prompts * args.n, load_format="dummy" if args.random_model else "auto",
                        **config)
        freeze_heap()
        opts = SimpleNamespace(workload="rl", n=args.n, prompt_set="mixed", seed=0)
        prompts, n = workload_prompts(opts, engine.tokenizer, args.prompts * args.n)
        vocab = engine.model_config.vocab_size
        prompts = [[t % vocab for t in p] for p in prompts]  # (host-probe's 512 ids)
        params = SamplingParams(n=n, temperature=args.temperature, max_new_tokens=args.output_len, seed=0)
        engine.generate(prompts, params)
        engine.clear_speculation_history()
        engine.reset_stats()
        run(mode, engine, prompts, params)
        del engine
        thaw_heap()


def steps(args: argparse.Namespace) -> None:
    import statistics
    import time

    from rollout.tools.bench import GcTimer

    from spec.step import bucket

    def run(mode, engine, prompts, params) -> None:
        emitted, complete = [], engine.loop._complete

        def counted(step, updated):  # the tokens each step appended, beside its step_log record
            before = engine.output_tokens
            complete(step, updated)
            emitted.append(engine.output_tokens - before)

        engine.loop._complete = counted
        with GcTimer() as gc_time:
            start = time.perf_counter()
            engine.generate(prompts, params)
            wall_ms = 1e3 * (time.perf_counter() - start)
        groups: dict[tuple[int, int], list] = {}
        for r, k in zip(engine.step_log, emitted):
            if not r.prefill:
                groups.setdefault((bucket(r.num_seqs), r.draft_rows, r.drafting), []).append((r, k))
        total = sum(r.wall_ms for r in engine.step_log)
        stats = engine.stats()
        prefill = sum(r.wall_ms for r in engine.step_log if r.prefill)
        print(f"\n{mode}: {stats['rollout/output_tokens']} tokens, {len(engine.step_log)} steps, "
              f"{total / 1e3:.2f} s of steps")
        print(f"its wall: {wall_ms:.1f} ms = prefill steps {prefill:.1f} + decode steps {total - prefill:.1f} "
              f"+ outside steps {wall_ms - total:.1f}; in the garbage collector {1e3 * gc_time.seconds:.1f}")
        # (drafter ran with no draft rows: a step that drafted for the budget's statistics only)
        print("| bucket | draft rows | drafter ran | steps | share of time | wall ms | device ms | host ms | tokens per sequence |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for (b, w, drafted), rks in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])):
            rs = [r for r, _ in rks]
            med = lambda f, rs=rs: statistics.median(f(r) for r in rs)  # noqa: E731
            share = sum(r.wall_ms for r in rs) / total
            per_seq = sum(k for _, k in rks) / sum(r.num_seqs for r in rs)
            print(f"| {b} | {w} | {'yes' if drafted else 'no'} | {len(rs)} | {share:.1%} | {med(lambda r: r.wall_ms):.2f} | "
                  f"{med(lambda r: r.device_ms):.2f} | {med(lambda r: r.host_ms):.2f} | {per_seq:.2f} |")
        budget = {k.removeprefix("rollout/spec_"): round(v, 3) for k, v in stats.items() if "accept_" in k}
        if budget:
            print(f"the budget's estimates at the end: {budget}")

    _each_mode(args, run)


def host(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    def run(mode, engine, prompts, params) -> None:
        profile = cProfile.Profile()
        reqs = [engine.add_request(p, params) for p in prompts]
        profile.enable()
        while not all(r.finished for r in reqs):
            engine.step()
        profile.disable()
        decode = [r for r in engine.step_log if not r.prefill]
        wall = sum(r.wall_ms for r in engine.step_log)
        print(f"\n{mode}: {engine.output_tokens} tokens, {len(engine.step_log)} steps ({len(decode)} decode), "
              f"{wall:.0f} ms of steps, host {sum(r.host_ms for r in decode) / len(decode):.2f} ms per decode step")
        rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[: args.top]
        print("| function | calls per step | own us per step | with callees us per step |\n|---|---|---|---|")
        for (file, line, name), (_, calls, own, total, _) in rows:
            where = f"{file.split('/')[-1]}:{line}" if line else "~"
            print(f"| {where} {name} | {calls / len(decode):.1f} | {own / len(decode) * 1e6:.1f} | "
                  f"{total / len(decode) * 1e6:.1f} |")

    _each_mode(args, run, adaptive=not args.fixed)


def collect(args: argparse.Namespace) -> None:
    import time

    def run(mode, engine, prompts, params) -> None:
        spent = {"emit": 0.0, "settle": 0.0, "append": 0.0}

        def timed(part, fn):
            def call(*a, **k):
                t0 = time.perf_counter()
                out = fn(*a, **k)
                spent[part] += time.perf_counter() - t0
                return out
            return call

        # (instance attributes: the engine calls them through self)
        engine.runner._emit_decode = timed("emit", engine.runner._emit_decode)
        engine.scheduler.settle_step = timed("settle", engine.scheduler.settle_step)
        engine.loop.emitter.append = timed("append", engine.loop.emitter.append)
        engine.generate(prompts, params)
        decode = [r for r in engine.step_log if not r.prefill]
        seqs = sum(r.num_seqs for r in decode)
        print(f"\n{mode}: {len(decode)} decode steps, {seqs / len(decode):.0f} sequences a step on average "
              f"({sum(r.draft_rows > 0 for r in decode)} verified drafts)")
        print("| part | us per decode step | us per sequence |\n|---|---|---|")
        for part, s in [*spent.items(), ("all three", sum(spent.values()))]:  # (append: prefill steps' too)
            print(f"| {part} | {s / len(decode) * 1e6:.0f} | {s / seqs * 1e6:.2f} |")

    _each_mode(args, run)


def _filled(engine, s: int, context: int):
    """Rows 0..s-1 of `engine` filled as a long rollout leaves them (random tokens, KV slots spread
    over the pool), `context` tokens each; returns (inputs(c): a step's DecodeInputs with c draft
    rows, reset(): the lengths back, which a step's accept walk moved on)."""
    from rollout.engine.step import DecodeInputs

    table, pool = engine.table, engine.pool
    g = torch.Generator().manual_seed(0)
    for r in range(s):
        table.tokens[r, :context] = torch.randint(0, 49152, (context,), generator=g).to(torch.int32)
        pool.slot_table[r, :context] = torch.randint(1, pool.num_slots - 1, (context,), generator=g).to(torch.int32)
    table.prompt_lens[:s] = 100
    rows = torch.arange(s, dtype=torch.int32, device="cuda")

    def inputs(c: int) -> DecodeInputs:
        i64 = torch.zeros(s + c + 2 * s, dtype=torch.int64, device="cuda")  # slots all 0: the dump slot
        i32 = torch.cat([rows, torch.zeros(s, dtype=torch.int32, device="cuda")])
        f32 = torch.tensor([1.0] * s + [1.0] * s + [0.0] * s, device="cuda")
        return DecodeInputs(i64, i32, f32, s, s + c)

    def reset() -> None:
        table.lengths[:s] = context

    reset()
    return inputs, reset


def _replay_ms(engine, inputs, reset, shape) -> float:
    import triton

    graph = engine.runner.graphs.graph(shape)
    x = inputs(shape[1])
    for dst, src in zip((graph.inputs.i64, graph.inputs.i32, graph.inputs.f32), (x.i64, x.i32, x.f32)):
        dst.copy_(src)

    def replay():
        graph.graph.replay()
        reset()

    return triton.testing.do_bench(replay, return_mode="median")


def _kernels(run, steps: int = 5) -> dict[str, tuple[float, float]]:
    """Kernel name -> (launches, device us) per call of `run`, eager."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return {e.key: (e.count / steps, e.device_time_total / steps) for e in prof.key_averages()
            if not e.key.startswith(("cuda", "cuLaunch"))}  # (the kernels, not the runtime's calls launching them)


def verify(args: argparse.Namespace) -> None:
    from rollout import Engine

    engine = Engine(model="default", spec="ngram", device="cuda", max_running_seqs=args.seqs,
                    max_model_len=args.context + 200)
    counts = [int(c) for c in args.draft_rows.split(",")] if args.draft_rows else engine.spec.budget.capacities(args.seqs)
    s = args.seqs
    inputs, reset = _filled(engine, s, args.context)
    graphs = engine.runner.graphs
    print(f"{s} sequences, {args.context} tokens of KV each, T=1 (the step writes nothing it keeps: lengths reset)")
    print("| draft rows | graph replay ms | vs none |\n|---|---|---|")
    base = None
    for c in counts:
        ms = _replay_ms(engine, inputs, reset, graphs.shape(s, c, c > 0, False, "sample"))
        base = base or ms
        print(f"| {c} | {ms:.3f} | {ms / base:.2f}x |")
    for c in sorted({counts[0], counts[min(1, len(counts) - 1)], counts[-1]}):  # none, the fewest, the most
        x = inputs(c)

        def run(x=x, c=c):
            engine.runner.run_decode(x, c, c > 0, False, "sample", max_kv_len=args.context + 20)
            reset()

        kernels = _kernels(run)
        total = sum(us for _, us in kernels.values())
        print(f"\n{c} draft rows, eager: {total / 1e3:.3f} ms of kernels per step")
        print("| kernel | us per step | share |\n|---|---|---|")
        for name, (_, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"| {name[:70]} | {us:.1f} | {us / total:.1%} |")


def headcost(args: argparse.Namespace) -> None:
    """What a draft head adds to a step, by the step's kind: its pass over the step's rows, and
    the pass and its tree for the next step (HeadWork), in the hybrid's CUDA graphs (replayed,
    device time) and eager (kernels launched and their device time)."""
    from rollout import Engine
    from spec.step import HeadWork

    engine = Engine(model="default", spec="auto", spec_draft_model=args.head, spec_head_steps=args.head_steps,
                    spec_head_topk=args.head_topk, device="cuda", max_running_seqs=max(args.seqs),
                    max_model_len=args.context + 200)
    print(f"{args.context} tokens of KV each; head tree {args.head_steps} x {args.head_topk}, "
          f"{engine.runner.drafters.head.nodes} kept; draft rows: one per sequence")
    print("| seqs | step | graph replay ms | vs decode | kernels (eager) | their device us |")
    print("|---|---|---|---|---|---|")
    for s in args.seqs:
        inputs, reset = _filled(engine, s, args.context)
        base = None
        for drafting, head in ((False, HeadWork.NONE), (False, HeadWork.PASS), (True, HeadWork.NONE),
                               (True, HeadWork.PASS), (True, HeadWork.CHAIN)):
            c = s if drafting else 0
            ms = _replay_ms(engine, inputs, reset, engine.runner.graphs.shape(s, c, drafting, head, "sample"))
            base = base or ms
            x = inputs(c)

            def run(x=x, c=c, drafting=drafting, head=head):
                engine.runner.run_decode(x, c, drafting, head, "sample", max_kv_len=args.context + 40)
                reset()

            kernels = _kernels(run)
            launched, us = sum(n for n, _ in kernels.values()), sum(u for _, u in kernels.values())
            what = ("verify" if drafting else "decode") + {HeadWork.NONE: "", HeadWork.PASS: " + head pass",
                                                           HeadWork.CHAIN: " + head pass + tree"}[head]
            print(f"| {s} | {what} | {ms:.3f} | {ms / base:.2f}x | {launched:.0f} | {us:.0f} |")
            if s == args.seqs[0] and head == HeadWork.CHAIN:
                chain_kernels = kernels
            if s == args.seqs[0] and drafting and head == HeadWork.NONE:
                verify_kernels = kernels
    print(f"\nThe head's kernels at {args.seqs[0]} sequences (verify + pass + tree less verify), eager:")
    print("| kernel | launches | device us |\n|---|---|---|")
    extra = {k: (n - verify_kernels.get(k, (0, 0))[0], u - verify_kernels.get(k, (0, 0))[1])
             for k, (n, u) in chain_kernels.items()}
    for name, (n, u) in sorted(extra.items(), key=lambda kv: -kv[1][0])[: args.top]:
        if n > 0:
            print(f"| {name[:70]} | {n:.0f} | {u:.1f} |")


def head(args: argparse.Namespace) -> None:
    """A draft head's acceptance and speed by tree (depth x topk), every step verifying the whole tree
    (the budget off): ShareGPT prompts one at a time (rollout bench's, which train_eagle leaves
    out), spec off first in the same run."""
    import time

    import numpy as np

    from rollout import Engine, SamplingParams
    from rollout.tools.bench import speed_model_dir, workload_prompts

    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.output_len, seed=0)
    model, load, head_dir = "default", "auto", args.head
    opts = argparse.Namespace(workload="sharegpt", seed=0, sharegpt_file=args.sharegpt_file, max_prompt_len=1024,
                              prompt_len=128)
    if args.random_model:  # random weights; an EAGLE-3 head of the published shape for that target
        model, load, opts.workload = speed_model_dir(args.random_model), "dummy", "decode"
        head_dir = head_dir or _random_eagle3_head(model, RANDOM_HEADS[args.random_model])
    print("| spec | head tree (depth x topk) | tok/s | vs off | step ms (median) | vs off | accept len | first drafts accepted | drafts accepted |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for tree in ["-"] + args.head_trees.split(","):
        parts = [int(x) for x in tree.split("x")] if tree != "-" else [0]
        steps, topk, nodes = parts + [1, 0][len(parts) - 1 :]
        kw = {"spec": "off"} if not steps else {"spec": args.spec, "spec_draft_model": head_dir, "spec_adaptive": False,
                                                "spec_head_steps": steps, "spec_head_topk": topk,
                                                "spec_max_draft_tokens": nodes or max(8, steps),
                                                "spec_head_min_accept": 0.0}  # (the whole tree, whatever is accepted)
        engine = Engine(model=model, load_format=load, device=args.device, kv_cache_tokens=50_000, **kw)
        if engine.spec.cycle is not None:  # the head is not weighed against its time (HeadCycle's pay rule): it never sleeps
            engine.spec.cycle.costs = None
        prompts, _ = workload_prompts(opts, engine.tokenizer, args.prompts)
        engine.generate(prompts if base is None else prompts[:1], params)  # (warm-up; the first engine's compiles every shape)
        engine.reset_stats()
        engine.step_log.clear()
        t0 = time.perf_counter()
        tokens = sum(len(engine.generate([p], params)[0][0].token_ids) for p in prompts)
        rate = tokens / (time.perf_counter() - t0)
        step_ms = float(np.median([r.wall_ms for r in engine.step_log if not r.prefill]))
        base = base or (rate, step_ms)
        st = engine.stats()
        get = lambda k: st.get(f"rollout/spec_{k}", 0.0)  # noqa: E731
        print(f"| {kw['spec']} | {tree} | {rate:,.0f} | {rate / base[0]:.2f}x | {step_ms:.2f} | {step_ms / base[1]:.2f}x "
              f"| {get('accept_length') or 1:.2f} | {get('head_version_first_accept'):.2f} | {get('accept_rate'):.3f} |")
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


RANDOM_HEADS = {  # EAGLE-3 heads as published for these targets (hidden, intermediate, heads, kv heads, draft vocabulary)
    "llama3-8b": (4096, 14336, 32, 8, 32000),  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    "qwen3-8b": (4096, 12288, 32, 8, 32000),
}


def _random_eagle3_head(model_dir: str, shape: tuple[int, ...]) -> str:
    """An EAGLE-3 head with random weights of `shape` for the target in `model_dir`, written as
    recipes/train_eagle.py writes heads; returns its directory."""
    import sys
    import tempfile
    from pathlib import Path

    from rollout.models.config import ModelConfig
    from spec.draft_head import DraftHead, HeadConfig, default_aux_layers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    import train_eagle

    target = ModelConfig.from_dir(model_dir)
    hidden, inter, heads, kv_heads, draft_vocab = shape
    cfg = HeadConfig(kind="eagle3", hidden_size=hidden, intermediate_size=inter, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, target_hidden_size=target.hidden_size,
                     vocab_size=target.vocab_size, draft_vocab_size=draft_vocab)
    torch.manual_seed(0)
    head = DraftHead(cfg, target, layer=target.num_layers)
    out = Path(tempfile.mkdtemp(prefix="rollout-head-"))
    train_eagle.write_head(head, torch.arange(draft_vocab), target, default_aux_layers(target.num_layers), out)
    return str(out)


def accept(args: argparse.Namespace) -> None:
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from rollout import Engine, SamplingParams
    from rollout.tools.bench import workload_prompts
    from spec.draft_head import load_head, unrolled

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from train_eagle import Target

    chain, top_k = 3, (2, 4, 8)  # the chain's drafts; first levels of this many siblings
    t = args.temperature
    engine = Engine(model="default", device=args.device)
    head = load_head(args.head, engine.model.config, layer=engine.model.config.num_layers).to(engine.device)
    d2t = head.draft_to_target
    target = Target(engine, head.cfg.aux_layers)
    opts = SimpleNamespace(workload="rl", n=1, prompt_set="mixed", seed=0)
    prompts, _ = workload_prompts(opts, engine.tokenizer, args.prompts)
    outs = engine.generate(prompts, SamplingParams(temperature=t, max_new_tokens=args.max_new_tokens, seed=1))
    first = {"argmax": [], "sampled": [], **{f"top {k}": [] for k in top_k}}
    by_chain = {"argmax": [], "sampled": []}
    for prompt, out in zip(prompts, outs):
        ids = list(prompt) + out[0].token_ids
        aux, logp = target(ids)
        tokens = torch.tensor(ids[1:], device=engine.device)
        with torch.no_grad():
            steps = unrolled(head, engine.model.model.embed_tokens, tokens, aux[: len(ids) - 1],
                             engine.runner.cos, engine.runner.sin, steps=chain)
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
            if j == 0:  # the first level: the head's top k as siblings, their p summed
                for k in top_k:
                    siblings = d2t[logits.topk(k, dim=-1).indices]  # [n, k] target ids
                    first[f"top {k}"].append(p.gather(1, siblings).sum(dim=-1)[response].mean().item())
        first["argmax"].append(by_step[0][0].mean().item())
        first["sampled"].append(by_step[0][1].mean().item())
        m = min(len(a) for a, _ in by_step)
        for k, kind in enumerate(("argmax", "sampled")):
            alive, total = torch.ones(m, device=engine.device), torch.zeros(m, device=engine.device)
            for step in by_step:
                alive = alive * step[k][:m]
                total += alive
            by_chain[kind].append(total.mean().item())
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"{len(prompts)} samples at T={t}, head {args.head}")
    print(f"| drafted by | first draft accepted | {chain}-draft chain: drafts accepted |\n|---|---|---|")
    for kind in first:
        print(f"| {kind} | {mean(first[kind]):.3f} | {mean(by_chain[kind]):.3f} |" if kind in by_chain else
              f"| the head's {kind}, as siblings | {mean(first[kind]):.3f} | |")


def budget(args: argparse.Namespace) -> None:
    import timeit
    from types import SimpleNamespace

    import numpy as np

    from spec.step import bucket
    from spec.budget import FRACTIONS, SHADOW_EVERY, DraftBudget
    from spec.speculator import _Trees, score_trees

    depth, s = 8, args.seqs
    rng = np.random.default_rng(0)
    b = DraftBudget(max_draft_tokens=depth, max_verify_tokens=2048, max_rows=s)
    for k in sorted({bucket(n) for n in range(1, s + 1)}):
        for _ in range(5):
            b.observe_step(k, 0, 1e-3 * (1 + rng.random()))
        for c in b.capacities(k)[1:]:
            for _ in range(5):
                b.observe_step(k, c, 1e-3 * (1.2 + rng.random()))
        b.acc[k] = np.sort(rng.random(len(FRACTIONS)))
    c = b.capacities(bucket(s))[1]

    def plan_after_drafting() -> None:
        b.observe_step(s, c, 1.5e-3)
        b.plan(s, 100_000)

    n = 2_000
    plan_us = timeit.timeit(lambda: b.plan(s, 100_000), number=n) / n * 1e6
    observe_us = timeit.timeit(lambda: b.observe_step(s, 0, 1e-3), number=n) / n * 1e6
    refit_us = timeit.timeit(plan_after_drafting, number=n) / n * 1e6 - observe_us
    n_nodes = depth + 1
    seqs = [SimpleNamespace(tokens=rng.integers(0, 1000, 400).tolist(), row=i, finish_reason=None) for i in range(s)]
    depths = np.tile(np.arange(n_nodes), (s, 1))
    keys = np.where(depths > 0, rng.integers(0, 1000, (s, n_nodes)), -1)
    trees = _Trees(seqs, np.full(s, 300), rng.integers(0, 1000, (s, n_nodes)), depths,
                   np.cumsum(1 << np.arange(n_nodes))[None, :].repeat(s, 0), keys)
    score_us = timeit.timeit(lambda: b.observe_acceptance(s, *score_trees(trees)), number=200) / 200 * 1e6
    print(f"{s} sequences (bucket {bucket(s)}), the speculation object's host work, us per call")
    print("| work | us | when |\n|---|---|---|")
    print(f"| plan | {plan_us:.1f} | every decode step |")
    print(f"| plan, line refitted | {refit_us:.1f} | a step after a drafting step |")
    print(f"| observe_step | {observe_us:.1f} | every decode step |")
    print(f"| score one step's trees, update the estimates | {score_us:.1f} | one step in {SHADOW_EVERY} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="profile", required=True)
    d = sub.add_parser("draft", help="the drafting kernel against a decode step")
    d.add_argument("--seqs", type=int, default=512)
    d.add_argument("--output-len", type=int, default=1000)
    d.add_argument("--history", type=int, default=8, help="finished samples per prompt")
    d.add_argument("--width", type=int, default=8)
    sp = sub.add_parser("sampling", help="the fused sampling kernels against the torch reference")
    sp.add_argument("--vocabs", default="49152,151936", help="vocabulary sizes (151,936: the Qwen3-8B shape)")
    t = sub.add_parser("steps", help="where a rollout's steps spend their time, spec off against n-gram")
    h = sub.add_parser("host", help="the host's time per decode step by function (cProfile), spec off against n-gram")
    c = sub.add_parser("collect", help="the host's time to collect a decode step, by part (wall clock), spec off against n-gram")
    for p, output_len in ((t, 2048), (h, 256), (c, 64)):  # the rl workload of _each_mode
        p.add_argument("--prompts", type=int, default=64)
        p.add_argument("--n", type=int, default=8)
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--output-len", type=int, default=output_len)
        p.add_argument("--device", default="cuda")
        p.add_argument("--modes", default="off,ngram", help=f"engines in turn, of {', '.join(MODES)}")
        p.add_argument("--random-model", choices=[*sorted(SPEED_SHAPES), "host-probe"], default=None,
                       help="random weights of this shape (host-probe: a step that costs next to nothing but the host's work)")
    h.add_argument("--fixed", action="store_true", help="n-gram: every step verifies as many drafts as fit (the budget off)")
    h.add_argument("--top", type=int, default=25)
    u = sub.add_parser("budget", help="the speculation object's host work per step (no model, any machine)")
    u.add_argument("--seqs", type=int, default=512)
    v = sub.add_parser("verify", help="a decode/verify step's device time by draft rows, and its kernels")
    v.add_argument("--seqs", type=int, default=128)
    v.add_argument("--context", type=int, default=2000)
    v.add_argument("--draft-rows", default=None, help="comma-separated (default: the budget's for --seqs)")
    v.add_argument("--top", type=int, default=15)
    k = sub.add_parser("headcost", help="what a draft head adds to a step (pass, tree), graphs and eager kernels")
    k.add_argument("--head", required=True)
    k.add_argument("--seqs", type=lambda x: [int(v) for v in x.split(",")], default=[1, 64])
    k.add_argument("--context", type=int, default=600)
    k.add_argument("--head-steps", type=int, default=3)
    k.add_argument("--head-topk", type=int, default=1)
    k.add_argument("--top", type=int, default=40)
    e = sub.add_parser("head", help="a draft head's acceptance and speed by tree (depth x topk), the whole tree verified")
    e.add_argument("--head", default=None, help="the head's directory (with --random-model: a random head of the published shape)")
    e.add_argument("--random-model", choices=sorted(RANDOM_HEADS), default=None, help="a target of this shape, random weights")
    e.add_argument("--spec", default="eagle", choices=("eagle", "auto"))
    e.add_argument("--head-trees", default="1,2,3,5,8",
                   help="depths, or depth x topk [x nodes kept] (3x2: 3 levels of the 2 likeliest; 4x4x16: their 16 likeliest; else 8)")
    e.add_argument("--sharegpt-file", default=None)
    e.add_argument("--prompts", type=int, default=8)
    e.add_argument("--output-len", type=int, default=256)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--device", default="cuda")
    a = sub.add_parser("accept", help="a draft head's first-draft acceptance offline: argmax, drawn from it, its top k")
    a.add_argument("--head", required=True)
    a.add_argument("--temperature", type=float, default=1.0)
    a.add_argument("--prompts", type=int, default=12)
    a.add_argument("--max-new-tokens", type=int, default=192)
    a.add_argument("--device", default="cpu")
    args = ap.parse_args()
    {"accept": accept, "head": head, "headcost": headcost, "draft": draft, "sampling": sampling, "steps": steps, "host": host, "collect": collect, "verify": verify, "budget": budget}[args.profile](args)


if __name__ == "__main__":
    main()
