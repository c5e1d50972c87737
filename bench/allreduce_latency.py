"""All-reduce latency between the GPUs of one machine, as a decode step pays it: `per-graph`
all-reduces of [rows, hidden] bf16 (each its own input) captured in one CUDA graph, replayed; per
all-reduce, median. Through the engine's `RankGroup`: `nccl` (NCCL's ring) and `one-shot` (the
engine's default: rollout/engine/one_shot_all_reduce.py). Checks that every rank got the same
bits and that the one-shot sums equal NCCL's (bitwise over 2 GPUs, within bf16 rounding over more).

    python -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py --rows 1,64 --hidden 4096,5120
"""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import timedelta

import torch
from torch._C._distributed_c10d import TCPStore

from rollout.engine.tensor_parallel import RankGroup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--hidden", default="4096")
    ap.add_argument("--methods", default="nccl,one-shot")
    ap.add_argument("--per-graph", type=int, default=64, help="all-reduces per graph (2 x layers)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rank, size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1, size, rank == 0, timeout=timedelta(seconds=120))
    group = RankGroup(rank, size, device, store)
    assert group.one_shot is not None, "the one-shot path did not start"

    def nccl(x: torch.Tensor) -> None:
        group.dev.allreduce([x]).wait()

    reducers = {"nccl": nccl, "one-shot": group.all_reduce}
    shapes = [(r, h) for r in map(int, args.rows.split(",")) for h in map(int, args.hidden.split(","))]
    gen = torch.Generator(device=device).manual_seed(1 + rank)  # every rank its own inputs
    for rows, hidden in shapes:
        inputs = torch.randn(args.per_graph, rows, hidden, dtype=torch.bfloat16, device=device, generator=gen)
        sums = {}
        for method in args.methods.split(","):
            reduce = reducers[method]
            work = inputs.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(3):
                    reduce(work[i].clone())
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(args.per_graph):
                    reduce(work[i])
            work.copy_(inputs)
            graph.replay()
            torch.cuda.synchronize()
            sums[method] = work.clone()  # one replay's sums of the inputs
            times = []
            for _ in range(args.replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.per_graph)
            everyone = group.all_gather(sums[method].view(1, -1)).view(size, -1)  # (NCCL's gather: rank order)
            same = bool((everyone == everyone[0]).all())
            if rank == 0:
                print(f"all-reduce ({method}) [{rows}, {hidden}] bf16 over {size} GPUs in a CUDA graph: "
                      f"{statistics.median(times):.1f} us median ({args.replays} replays of {args.per_graph}); "
                      f"every rank the same bits: {same}", flush=True)
        if rank == 0 and {"nccl", "one-shot"} <= sums.keys():
            a, b = sums["nccl"].float(), sums["one-shot"].float()
            print(f"  one-shot against NCCL: bitwise equal {torch.equal(a, b)}, max |diff| {(a - b).abs().max().item():.3g} "
                  f"(sums up to {a.abs().max().item():.3g})", flush=True)


if __name__ == "__main__":
    main()
