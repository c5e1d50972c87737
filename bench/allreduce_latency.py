"""All-reduce latency between the GPUs of one machine, as a decode step pays it: `layers` x 2
all-reduces of [rows, hidden] bf16 captured in one CUDA graph, replayed; per all-reduce, median.
Methods: `nccl` (dist.all_reduce) and `symm` (torch's symmetric-memory one-shot all-reduce: each
rank reads its peers' buffers over NVLink P2P; no multicast).

    python -m torch.distributed.run --nproc-per-node 2 bench/allreduce_latency.py --rows 1,64 --hidden 4096,5120
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def reducer(method: str, rows: int, hidden: int):
    """A function that all-reduces a [rows, hidden] bf16 tensor, for capture."""
    if method == "nccl":
        return lambda x: dist.all_reduce(x)
    import torch.distributed._symmetric_memory as symm_mem

    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, name)

    def one_shot(x: torch.Tensor) -> None:
        buf.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, x)
    return one_shot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--hidden", default="4096")
    ap.add_argument("--methods", default="nccl")
    ap.add_argument("--per-graph", type=int, default=64, help="all-reduces per graph (2 x layers)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    shapes = [(r, h) for r in map(int, args.rows.split(",")) for h in map(int, args.hidden.split(","))]
    for method in args.methods.split(","):
        for rows, hidden in shapes:
            reduce = reducer(method, rows, hidden)
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
            dist.broadcast(x, 0)  # every rank the same input: the sum is world_size * x
            y = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                reduce(y)
                ok = torch.allclose(y.float(), dist.get_world_size() * x.float(), rtol=1e-2, atol=1e-2)
                for _ in range(3):
                    reduce(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.per_graph):
                    reduce(x)
            times = []
            for _ in range(args.replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.per_graph)
            if rank == 0:
                print(f"all-reduce ({method}) [{rows}, {hidden}] bf16 over {dist.get_world_size()} GPUs in a CUDA graph: "
                      f"{statistics.median(times):.1f} us median ({args.replays} replays of {args.per_graph}); "
                      f"sum {'right' if ok else 'WRONG'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
