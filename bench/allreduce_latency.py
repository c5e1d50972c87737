"""All-reduce and all-gather latency between the GPUs of one machine, as a decode step pays it:
`per-graph` collectives (each on its own input) captured in one CUDA graph, replayed; per
collective, median. Through the engine's `RankGroup`: `nccl` (NCCL's ring) and `one-shot` (the
engine's default: rollout/engine/one_shot_all_reduce.py). All-reduces of [rows, hidden] bf16; the
all-reduce into the next RMSNorm with the residual added, apart (two kernels) and fused
(kernels/all_reduce_norm.py); the gather of the LM head's float32 logits, [1, vocab / GPUs] a rank.
Checks that every rank got the same bits and that each case's second way equals its first (the sums
bitwise over 2 GPUs, within bf16 rounding over more; the gathers bitwise).

    python -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py --rows 1,64 --hidden 4096,5120
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from datetime import timedelta

import torch
from torch._C._distributed_c10d import TCPStore

from kernels import fused
from rollout.engine.tensor_parallel import RankGroup
from rollout.tools.bench_args import SPEED_SHAPES


def graph_results(run: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, replays: int) -> tuple[list, float]:
    """`run` on each of `inputs` in one CUDA graph: one replay's results, and the median us per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            run(inputs[i].clone())
    torch.cuda.synchronize()
    work = inputs.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [run(work[i]) for i in range(len(inputs))]
    work.copy_(inputs)
    graph.replay()
    torch.cuda.synchronize()
    results = [o.clone() for o in outs]
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return results, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--hidden", default="4096")
    ap.add_argument("--vocab", type=int, default=SPEED_SHAPES["llama3-8b"]["vocab_size"],
                    help="the gathered logits' columns, all ranks'")
    ap.add_argument("--per-graph", type=int, default=64, help="all-reduces per graph (2 x layers)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rank, size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1, size, rank == 0, timeout=timedelta(seconds=120))
    group = RankGroup(rank, size, device, store)
    assert group.one_shot is not None, "the one-shot path did not start"

    def nccl_sum(x: torch.Tensor) -> torch.Tensor:
        group.dev.allreduce([x]).wait()
        return x

    def same_everywhere(x: torch.Tensor) -> bool:
        everyone = group.nccl_all_gather(x.reshape(1, -1)).view(size, -1)  # (rank order)
        return bool((everyone == everyone[0]).all())

    gen = torch.Generator(device=device).manual_seed(1 + rank)  # every rank its own inputs
    cases = [(f"all-reduce [{r}, {h}] bf16", torch.randn(args.per_graph, r, h, dtype=torch.bfloat16, device=device,
                                                        generator=gen), {"nccl": nccl_sum, "one-shot": group.all_reduce})
             for r in map(int, args.rows.split(",")) for h in map(int, args.hidden.split(","))]
    for r in map(int, args.rows.split(",")):  # the decoder's all-reduce into the next norm: apart, and one kernel
        h = int(args.hidden.split(",")[0])
        residual = torch.randn(r, h, device=device, generator=torch.Generator(device=device).manual_seed(7)).bfloat16()
        weight = torch.rand(h, device=device, generator=torch.Generator(device=device).manual_seed(8)).bfloat16() + 0.5
        cases.append((f"all-reduce + residual + RMSNorm [{r}, {h}] bf16",
                      torch.randn(args.per_graph, r, h, dtype=torch.bfloat16, device=device, generator=gen), {
                          "apart": lambda x, w=weight, res=residual: torch.cat(
                              fused.rms_norm(group.all_reduce(x), w, 1e-5, res), dim=1),
                          "fused": lambda x, w=weight, res=residual: torch.cat(
                              group.all_reduce_norm(x, res, w, 1e-5), dim=1)}))
    cols = -(-args.vocab // size)
    cases.append((f"all-gather [1, {cols}] float32 a rank", torch.randn(args.per_graph, 1, cols, device=device, generator=gen),
                  {"nccl": group.nccl_all_gather, "one-shot": group.all_gather}))
    for what, inputs, methods in cases:
        results = {}
        for method, run in methods.items():
            outs, us = graph_results(run, inputs, args.replays)
            results[method] = torch.stack(outs)
            same = same_everywhere(results[method])
            if rank == 0:
                print(f"{what} ({method}) over {size} GPUs in a CUDA graph: {us:.1f} us median ({args.replays} replays "
                      f"of {args.per_graph}); every rank the same bits: {same}", flush=True)
        if rank == 0:
            (first, a), (second, b) = ((m, r.float()) for m, r in results.items())
            print(f"  {second} against {first}: bitwise equal {torch.equal(a, b)}, max |diff| {(a - b).abs().max().item():.3g} "
                  f"(values up to {a.abs().max().item():.3g})", flush=True)


if __name__ == "__main__":
    main()
