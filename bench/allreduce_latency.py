"""NCCL all-reduce latency between the GPUs of one machine, as a decode step pays it: `layers` x 2
all-reduces of [rows, hidden] bf16 captured in one CUDA graph, replayed; per all-reduce, median.

    python -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py --rows 1,64 --hidden 4096,5120
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--hidden", default="4096")
    ap.add_argument("--per-graph", type=int, default=64, help="all-reduces per graph (2 x layers)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    for rows, hidden in ((r, h) for r in map(int, args.rows.split(",")) for h in map(int, args.hidden.split(","))):
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(args.per_graph):
                dist.all_reduce(x)
        times = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.per_graph)
        if rank == 0:
            print(f"all-reduce [{rows}, {hidden}] bf16 over {dist.get_world_size()} GPUs in a CUDA graph: "
                  f"{statistics.median(times):.1f} us median ({args.replays} replays of {args.per_graph})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
