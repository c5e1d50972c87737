"""Where a tensor-parallel decode step's time goes: --batch sequences (one by default) of the
Llama-3.1-8B shape (random weights), decode steps' wall, device and host time (Engine.step_log,
medians), by setting; and where the run's time went: its prefill, its decode steps, their slowest,
and the time outside steps. The kernel tables (--kernels) profile decode steps as the variant runs
them (CUDA graphs; PDL off): at TP > 1 a collective's kernel absorbs its wait for the other ranks
(once seen at 32B b64 TP4, where NCCL's all-reduce took most of an eager step), so they read true
at TP1 and at b1.

    python bench/tp_profile.py --tp-sizes 1,2 --variants default,no-pdl,no-overlap,no-graphs
    python bench/tp_profile.py --tp-sizes 1,2 --kernels 14   # rank 0's kernels per decode step
    python bench/tp_profile.py --tp-sizes 1,2 --kernels 14 --prefill --host 14   # the prefill's kernels and host ops
    python bench/tp_profile.py --shape default --tp-sizes 1 --batch 512 --variants default,deterministic --kernels 20
    python bench/tp_profile.py --shape qwen3-30b-a3b --tp-sizes 1 --batch 512 --temperatures 0,1.0   # decode steps alone
    PYTHONPATH=. python bench/tp_profile.py --tp-sizes 2 --ranks   # each rank's prefill and decode steps
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rollout import Engine, SamplingParams
from rollout.models.default_model import ensure_default_model
from rollout.tools.bench import speed_model_dir

VARIANTS = {"default": {}, "no-pdl": {"pdl": False}, "no-overlap": {"overlap_schedule": False},
            "no-graphs": {"cuda_graphs": False}, "deterministic": {"enable_deterministic_inference": True},
            "float16": {"dtype": "float16"}, "fp32-activations": {"enable_fp32_activations": True},
            "fp32-islands": {"enable_fp32_residual": True, "enable_fp32_lm_head": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", help="a speed shape, or `default`: the default model's (random "
                    "weights)")
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a sequence")
    ap.add_argument("--temperatures", default="0", help="sampling temperatures, each a run of the variant's engine; "
                    "kernel tables: the first")
    ap.add_argument("--batch", type=int, default=1, help="sequences")
    ap.add_argument("--n", type=int, default=1, help="samples a prompt (its sequences share its KV): --batch / n prompts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--kernels", type=int, default=0, metavar="K", help="instead: rank 0's K costliest kernels per step")
    ap.add_argument("--prefill", action="store_true", help="with --kernels: the prompts' prefill, not decode steps")
    ap.add_argument("--host", type=int, default=0, metavar="K", help="with --kernels: rank 0's K costliest host ops")
    ap.add_argument("--ranks", action="store_true", help="then each rank's steps (the repository root on PYTHONPATH)")
    args = ap.parse_args()
    model = str(ensure_default_model()) if args.shape == "default" else speed_model_dir(args.shape)
    if args.kernels:
        return kernel_tables(model, args)
    rank_rows = []
    print("| tp | variant | temp | step ms | device ms | host ms | tok/s | run ms | prefill ms | decode steps ms "
          "| slowest step ms | outside steps ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for tp in map(int, args.tp_sizes.split(",")):
        for variant in args.variants.split(","):
            engine = profiled_engine(model, tp, args, **VARIANTS[variant])
            for temperature in map(float, args.temperatures.split(",")):
                params = sampling(temperature, args.tokens, args.n)
                for _ in range(2):  # the first run warms up
                    engine.reset_stats()
                    start = time.perf_counter()
                    engine.generate(prompts(args), params)
                    run_ms = (time.perf_counter() - start) * 1e3
                steps = [r for r in engine.step_log if not r.prefill]
                prefill = sum(r.wall_ms for r in engine.step_log if r.prefill)
                med = lambda k: statistics.median(getattr(r, k) for r in steps)  # noqa: E731
                walls = sum(r.wall_ms for r in steps)
                print(f"| {tp} | {variant} | {temperature} | {med('wall_ms'):.2f} | {med('device_ms'):.2f} | "
                      f"{med('host_ms'):.2f} | {args.batch * 1e3 / med('wall_ms'):.1f} | {run_ms:.1f} | {prefill:.1f} | "
                      f"{walls:.1f} | {max(r.wall_ms for r in steps):.1f} | {run_ms - prefill - walls:.1f} |", flush=True)
            if args.ranks and engine.tp is not None:
                engine.tp.record("rank_steps")
                engine.tp.flush()
                rank_rows += [(tp, variant, rank, row) for rank, row in enumerate(rank_steps(engine))]
            engine.close()
            del engine
    if rank_rows:
        print("| tp | variant | rank | prefill began ms (after rank 0's) | prefill host ms | prefill wall ms "
              "| decode host ms | decode wall ms |\n|---|---|---|---|---|---|---|---|")
        for tp, variant, rank, (began, *ms) in rank_rows:
            print(f"| {tp} | {variant} | {rank} | {began:.2f} | " + " | ".join(f"{v:.2f}" for v in ms) + " |")


def rank_steps(engine: Engine) -> list[list[float]]:
    """Every rank's latest run, gathered over the ranks' host group: its last prefill's start
    (ms after rank 0's), host and wall ms, and its decode steps' median host and wall ms. The
    ranks share a host clock (time.perf_counter)."""
    log = list(engine.step_log)
    prefill = [r for r in log if r.prefill][-1]
    decode = [r for r in log if not r.prefill and r.began_s > prefill.began_s]
    mine = torch.tensor([prefill.began_s * 1e3, prefill.host_ms, prefill.wall_ms,
                         statistics.median(r.host_ms for r in decode), statistics.median(r.wall_ms for r in decode)],
                        dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(engine.tp.size)]
    engine.tp.group.host.allgather([rows], [mine]).wait()
    return [[row[0].item() - rows[0][0].item(), *row[1:].tolist()] for row in rows]


def rank_handlers(engine: Engine) -> dict:
    """The other ranks' side of `--ranks` (Engine's `tp_hooks`)."""
    return {"rank_steps": lambda: rank_steps(engine)}


def sampling(temperature: float, max_new_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True, n=n)


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """--batch / --n prompts of --prompt-len tokens."""
    return [[100 + (i * args.prompt_len + j) % 32000 for j in range(args.prompt_len)] for i in range(args.batch // args.n)]


def profiled_engine(model: str, tp: int, args: argparse.Namespace, **config) -> Engine:
    hooks = "bench.tp_profile:rank_handlers" if args.ranks else None
    return Engine(model=model, load_format="dummy", spec="off", tp_size=tp, max_running_seqs=max(8, args.batch),
                  kv_cache_tokens=args.batch * (args.prompt_len + new_tokens(args)) + 4096, tp_hooks=hooks, **config)


def new_tokens(args: argparse.Namespace) -> int:
    """A request's new tokens at most: the kernel tables' decoding runs past --tokens (the pool holds it all)."""
    return 4 * args.tokens + 64


Rows = list[tuple[str, int, float]]  # (name, count, us), costliest first


def profiled(run) -> dict[str, Rows]:
    """Rank 0's work while `run()` runs, costliest first: "device", its kernels (name, launches,
    device us; CUPTI reports the kernels inside a CUDA graph's replay one by one); "host", the
    host's ops (name, calls, self CPU us: the time in the op itself, its launches included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    fields = {"device": "self_device_time_total", "host": "self_cpu_time_total"}
    return {kind: sorted(((e.key, e.count, getattr(e, f)) for e in events if getattr(e, f) > 0), key=lambda k: -k[2])
            for kind, f in fields.items()}


def kernel_tables(model: str, args: argparse.Namespace) -> None:
    """Rank 0's kernels, us per step, costliest first, with --host K the K costliest host ops too
    (the rest of the wall is Python), and the profiled steps' median wall. Decode steps run as the
    variant runs them (CUDA graphs by default) but without PDL: a kernel placed early counts its
    wait for the one before, and the table stops adding up (MoE b1: 5.5 ms of kernels in a 3.6 ms
    step). Every prompt is prefilled first, then --tokens steps are profiled; with --prefill, the
    prompts' prefill instead. Aten ops that launch kernels (aten::mm) count their kernels' time
    again. A collective counts its wait for the other ranks."""
    print("| tp | variant | kernel or host op | per step | us per step |\n|---|---|---|---|---|", flush=True)
    temperature = float(args.temperatures.split(",")[0])
    for tp, variant in ((tp, v) for tp in map(int, args.tp_sizes.split(",")) for v in args.variants.split(",")):
        engine = profiled_engine(model, tp, args, **{**VARIANTS[variant], "pdl": False})
        engine.generate(prompts(args), sampling(temperature, args.tokens, args.n))
        if args.prefill:
            steps, run = 1, lambda: engine.generate(prompts(args), sampling(temperature, 1))
        else:
            steps, run = args.tokens, decoding(engine, args)
        engine.reset_stats()
        work = profiled(run)
        profiled_steps = [r for r in engine.step_log if r.prefill == args.prefill]
        for kind, top in (("device", args.kernels), ("host", args.host)):
            for name, count, us in work[kind][:top]:
                print(f"| {tp} | {variant} | {kind}: {name[:70]} | {count / steps:.0f} | {us / steps:.1f} |",
                      flush=True)
            if top:
                total = sum(k[2] for k in work[kind]) / steps
                print(f"| {tp} | {variant} | {kind}: all {len(work[kind])} | | {total:.1f} |", flush=True)
        wall = statistics.median(r.wall_ms for r in profiled_steps) * 1e3
        print(f"| {tp} | {variant} | the profiled steps' median wall ({len(profiled_steps)} steps) | | {wall:.1f} |",
              flush=True)
        engine.abort_all()
        engine.close()
        del engine


def decoding(engine: Engine, args: argparse.Namespace):
    """Every prompt added and prefilled (steps until one decodes them all); returns the run that
    takes the next --tokens steps (the requests outlive it: the caller aborts them)."""
    params = sampling(float(args.temperatures.split(",")[0]), new_tokens(args), args.n)
    engine.reset_stats()  # (the step log: from these requests on)
    for p in prompts(args):
        engine.add_request(p, params)
    for _ in range(new_tokens(args)):
        engine.step()
        last = engine.step_log[-1] if engine.step_log else None
        if last is not None and not last.prefill and last.num_seqs == args.batch:
            break
    else:
        raise RuntimeError(f"no decode step of all {args.batch} sequences")

    def run() -> None:
        for _ in range(args.tokens):
            engine.step()

    return run


if __name__ == "__main__":
    main()
