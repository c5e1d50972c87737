"""The fused all-reduce + residual + RMSNorm kernel (kernels/all_reduce_norm.py) over 2, 3 and 4 GPUs
(run on the device machine: -m gpu): on fresh random parts, bitwise the ranks' parts summed in rank
order in float32 and rounded once (`RankGroup.ordered_sum`, a coupled engine's sum), then
`fused.rms_norm`; over 2 GPUs bitwise the one-shot all-reduce then `fused.rms_norm` too (what steps
of more than 16 rows run); the same bits on every rank, and the same again in each of two
CUDA-graph replays (the buffer's halves taken in the other order, then in eager's). The same kernel
without the norm, float16's all-reduce (torch's one-shot kernel sums bf16 and fp32 only), taking
turns with the fused one on the same buffers and flags: bitwise the ordered sum up to 64 rows, on
every rank, in graphs too."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.gpu

# (consecutive cases of other row counts: each row's buffer halves alternate on their own)
CASES = [(torch.bfloat16, 1, 4096), (torch.bfloat16, 7, 576), (torch.bfloat16, 16, 4096), (torch.bfloat16, 3, 5120),
         (torch.float16, 1, 4096), (torch.float16, 7, 576), (torch.float32, 1, 576), (torch.float32, 16, 4096)]
SUM_ROWS = [1, 17, 64, 5]  # float16's plain all-reduce, [rows, 4096], after each fused case


def _rank(rank: int, size: int, port: int) -> None:
    from torch._C._distributed_c10d import TCPStore

    from kernels import fused
    from rollout.engine.tensor_parallel import RankGroup

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
    group = RankGroup(rank, size, device, store)
    try:
        for case, (dtype, rows, n) in enumerate(CASES):
            shared = torch.Generator(device=device).manual_seed(100 + case)  # (the residual and weight are replicated)
            residual = torch.randn(rows, n, generator=shared, device=device).to(dtype)
            weight = (1 + torch.randn(n, generator=shared, device=device) / 4).to(dtype)
            own = torch.Generator(device=device).manual_seed(1000 * rank + case)
            parts = [(torch.randn(rows, n, generator=own, device=device) * 3).to(dtype) for _ in range(3)]
            assert group.one_shot.fits_norm(parts[0], residual), (dtype, rows, n)

            once = case % 2 == 1  # (--enable-fp32-activations' norms round once)

            def fused_calls(xs):
                return [torch.cat(group.all_reduce_norm(x, residual, weight, 1e-5, round_once=once), dim=1) for x in xs]

            got = fused_calls(parts)
            for x, g in zip(parts, got):
                want = torch.cat(fused.rms_norm(group.ordered_sum(x), weight, 1e-5, residual, round_once=once), dim=1)
                assert torch.equal(g, want), f"fused != the ordered sum then the norm {dtype} {rows}x{n}"
                if size == 2:
                    apart = torch.cat(fused.rms_norm(group.all_reduce(x.clone()), weight, 1e-5, residual,
                                                     round_once=once), dim=1)
                    assert torch.equal(g, apart), f"fused != apart {dtype} {rows}x{n}"
            _same_on_every_rank_and_in_graphs(group, fused_calls, parts, got, f"{dtype} {rows}x{n}")
            _check_float16_sum(group, SUM_ROWS[case % len(SUM_ROWS)], case)
        torch.cuda.synchronize()
    finally:
        group.close()


def _check_float16_sum(group, rows: int, case: int) -> None:
    device = group.device
    own = torch.Generator(device=device).manual_seed(5000 * group.rank + case)
    parts = [(torch.randn(rows, 4096, generator=own, device=device) * 3).half() for _ in range(2)]
    assert group.one_shot.fits(parts[0])

    def sums(xs):
        return [group.all_reduce(x.clone()) for x in xs]  # (the sum is in place: the graph's input stays)

    got = sums(parts)
    for x, g in zip(parts, got):
        assert torch.equal(g, group.ordered_sum(x)), f"float16 sum != the ordered sum, {rows} rows"
    _same_on_every_rank_and_in_graphs(group, sums, parts, got, f"float16 sum, {rows} rows")


def _same_on_every_rank_and_in_graphs(group, calls, parts, got, what: str) -> None:
    """`got` (calls(parts), eager) the same on every rank, and again in each of two replays of calls captured
    in a CUDA graph (the buffer's halves in the other order, then in eager's)."""
    everyone = group.nccl_all_gather(torch.stack(got).reshape(1, -1)).view(group.size, -1)
    assert all(torch.equal(everyone[0], other) for other in everyone[1:]), f"ranks differ: {what}"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    static = [x.clone() for x in parts]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = calls(static)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, g) for o, g in zip(outs, got)), f"graph != eager: {what}"


@pytest.mark.parametrize("size", [2, 3, 4])
def test_fused_all_reduce_norm_is_the_sum_then_the_norm_bitwise(size: int):
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(size, port), nprocs=size, join=True)
