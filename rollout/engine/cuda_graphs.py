"""CUDA graphs of decode and verify steps: one per (batch bucket, draft rows, drafting, head work, sampling mode).

A decode step of a small model is mostly kernel-launch time; replaying a captured graph turns
hundreds of launches into one. A graph holds the whole of a decode step (`ModelRunner.run_decode`): the
drafter, the layout, the model, the draws (one graph per sampling mode: greedy, plain
sampling, or with top-k/top-p/min-p truncation) and the accept walk. Its inputs are three
small tensors (rows and groups, KV slots and RNG keys, sampling numbers), padded to the
bucket with sequences of the pool's padding row, which change nothing (and rows past the real
ones with the dump slot 0); each launch copies the
host's arrays in (pinned staging, two sets used in turn: a step chained after another of the
same shape may be staged while the earlier copy is still queued) and replays. Attention reads
real lengths on the device, so one graph serves every context length. `capture_all` captures
every shape the engine can ask for up front. Prefill steps run eagerly, except one sequence's
short chunk alone (rollout/engine/prefill_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from rollout.engine.step import DecodeInputs, DecodeOutputs, F32Row, I64Row
from spec.step import BATCH_BUCKETS, HeadWork, bucket

MODES = ("greedy", "sample")  # captured up front; truncation is captured when first used

T = TypeVar("T")
Shape = tuple[int, int, bool, HeadWork, str]  # batch bucket, draft rows, drafting, a draft head's work, sampling mode


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs
    host: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # pinned staging of i64, i32, f32, in turn
    out: DecodeOutputs
    turn: int = 0


class CudaGraphs:
    def __init__(self, run_decode: Callable[..., DecodeOutputs], attn_out: torch.Tensor, padding_row: int,
                 max_batch: int, capacities: Callable[[int], list[int]], kinds: list[tuple[bool, HeadWork]]):
        """`run_decode(inputs, draft_rows, drafting, head, mode, attn_out=...)` is the step to capture
        (ModelRunner's); `attn_out` [max rows, heads, head_dim] its attention output buffer, shared by
        every graph; `capacities(bucket)`: the draft rows a step of that bucket may have (0 included);
        `kinds`: the (drafting, head work) pairs a step may have (Speculator.step_kinds)."""
        self.run_decode = run_decode
        self.device = attn_out.device
        self.padding_row = padding_row
        self.batch_sizes = [b for b in BATCH_BUCKETS if b <= max_batch] or [max_batch]
        self.capacities = capacities
        self.kinds = kinds
        self.max_tokens = attn_out.shape[0]  # a step's rows at most
        self._attn_out = attn_out
        self._mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Shape, _Graph] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._mempool = torch.cuda.graph_pool_handle()

    def shape(self, num_seqs: int, draft_rows: int, drafting: bool, head: HeadWork, mode: str) -> Shape | None:
        """The graph serving this step, or None (too large: run eagerly)."""
        b = bucket(num_seqs)
        if b not in self.batch_sizes or b + draft_rows > self.max_tokens:
            return None
        return b, draft_rows, drafting, head, mode

    def shapes(self) -> list[Shape]:
        """Every shape the engine may ask for with the plain modes."""
        out = []
        for b in self.batch_sizes:
            for c in self.capacities(b):
                if b + c > self.max_tokens:
                    continue
                out += [(b, c, d, h, m) for d, h in self.kinds if d or not c for m in MODES]  # (draft rows need the drafter)
        return out

    def capture_all(self) -> int:
        for shape in self.shapes():
            if shape not in self._graphs:
                self._capture(*shape)
        return len(self._graphs)

    def head_costs(self, replays: int = 10) -> dict[int, tuple[float, float]]:
        """Seconds a draft head adds to a step, per batch bucket, timed on the device by replaying
        the captured graphs (their inputs as captured: padding): (its pass over a decode step's
        rows, its tree for the next step on a drafting step of the fewest draft rows, over that
        step with the pass alone, or for a head alone, over a decode step with the pass)."""
        none, pass_, tree = HeadWork.NONE, HeadWork.PASS, HeadWork.CHAIN
        verify_alone = (True, pass_) in self.kinds
        out = {}
        for b in self.batch_sizes:
            c = next((c for c in self.capacities(b) if 0 < c and b + c <= self.max_tokens), None)
            if c is None:
                continue
            plain, with_pass = (self._replay_seconds((b, 0, False, h, "sample"), replays) for h in (none, pass_))
            with_tree = self._replay_seconds((b, c, True, tree, "sample"), replays)
            without = self._replay_seconds((b, c, True, pass_, "sample"), replays) if verify_alone else with_pass
            out[b] = (max(with_pass - plain, 0.0), max(with_tree - without, 0.0))
        return out

    def _replay_seconds(self, shape: Shape, replays: int) -> float:
        g = self.graph(shape)
        g.graph.replay()  # (warm)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def launch(self, shape: Shape, arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> DecodeOutputs:
        """Replay the graph for these host arrays (DecodeInputs.host_arrays of the real sequences);
        returns its outputs, cut to the real sequences."""
        g = self.graph(shape)
        b, draft_rows = shape[:2]
        i64, i32, f32 = arrays
        s = len(i32) // 2
        staging = g.host[g.turn]
        g.turn ^= 1
        h64, h32, hf = (h.numpy() for h in staging)
        _pad_into(h64, i64, s, b, b + draft_rows)
        _pad_into_i32(h32, i32, s, b, self.padding_row)
        _pad_into_f32(hf, f32, s, b)
        for dst, src in zip((g.inputs.i64, g.inputs.i32, g.inputs.f32), staging):
            dst.copy_(src, non_blocking=True)
        g.graph.replay()
        o = g.out
        trees = None if o.trees is None else tuple(t[:s] for t in o.trees)
        return DecodeOutputs(o.ints[:s], o.logprobs[:s], trees)

    def graph(self, shape: Shape) -> _Graph:
        """The captured graph of this shape, captured now if it was not."""
        return self._graphs.get(shape) or self._capture(*shape)

    def _capture(self, b: int, draft_rows: int, drafting: bool, head: HeadWork, mode: str) -> _Graph:
        dev = self.device
        r = b + draft_rows
        i64 = torch.zeros(r + 2 * b, dtype=torch.int64, device=dev)
        i32 = torch.zeros(2 * b, dtype=torch.int32, device=dev)
        f32 = torch.zeros(3 * b, dtype=torch.float32, device=dev)
        i32[:b] = self.padding_row  # all padding until the first replay writes real values
        f32.view(len(F32Row), b)[F32Row.TOP_P] = 1.0
        inputs = DecodeInputs(i64, i32, f32, b, r)

        def step() -> DecodeOutputs:
            return self.run_decode(inputs, draft_rows, drafting, head, mode, attn_out=self._attn_out[:r])

        graph, out = capture(step, dev, self._mempool)
        host = [tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in (i64, i32, f32)) for _ in range(2)]
        g = _Graph(graph, inputs, host, out)
        self._graphs[(b, draft_rows, drafting, head, mode)] = g
        return g


def capture(step: Callable[[], T], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`step` captured in a CUDA graph (memory from `pool`), after two runs on a side stream outside the
    capture: Triton compiles its kernels, the products time theirs (kernels/skinny_gemm.py), allocations
    settle. Returns the graph and what the captured run returned (its output buffers)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


def _pad_into(dst: np.ndarray, src: np.ndarray, s: int, b: int, r: int) -> None:
    """i64 staging: slots [r] then the sampling rows (I64Row) [b] each; rows past the real ones:
    slot 0; padding sequences: key 0, no top-k."""
    real = len(src) - len(I64Row) * s  # the real sequences' rows
    dst[:] = 0
    dst[:real] = src[:real]
    for k in I64Row:
        dst[r + k * b : r + k * b + s] = src[real + k * s : real + (k + 1) * s]


def _pad_into_i32(dst: np.ndarray, src: np.ndarray, s: int, b: int, padding_row: int) -> None:
    """i32 staging: rows [b] then groups [b]; padding sequences sit in the padding row."""
    dst[:b] = padding_row
    dst[:s] = src[:s]
    dst[b:] = 0
    dst[b : b + s] = src[s:]


def _pad_into_f32(dst: np.ndarray, src: np.ndarray, s: int, b: int) -> None:
    """f32 staging: the sampling rows (F32Row) [b] each; padding sequences are greedy, top_p 1."""
    dst[:] = 0
    dst[F32Row.TOP_P * b : (F32Row.TOP_P + 1) * b] = 1.0
    for k in F32Row:
        dst[k * b : k * b + s] = src[k * s : (k + 1) * s]
