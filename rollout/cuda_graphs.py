"""CUDA graphs for decode and verify steps: one graph per padded (sequences, tokens) shape.

A decode step of a small model is mostly kernel-launch time; replaying a captured graph
turns ~10 launches per layer into one. Each graph owns its input tensors: a step's layout
is padded to the graph's shape (empty sequences, tokens that belong to none and write
slot 0), copied into those tensors with two host-to-device copies, and replayed. The
attention kernels read real lengths on the device, so one graph serves every context
length up to the pool's, and every tree up to `max_tree_tokens` tokens per sequence.
Graphs are captured on first use; prefill steps run eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from rollout.model_runner import ModelRunner, StepLayout

BATCH_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    i64: torch.Tensor  # [5 * T]: input ids, positions, out slots, tree mask, logits rows
    i32: torch.Tensor  # [3 * B + 1]: seq rows, kv lens, qo indptr
    i64_host: torch.Tensor  # pinned staging for the two copies
    i32_host: torch.Tensor
    logits: torch.Tensor  # [T, vocab], written by every replay


class _StaticStep:
    """The DeviceStep view of a graph's input tensors (see rollout.model_runner.DeviceStep)."""

    def __init__(self, i64: torch.Tensor, i32: torch.Tensor, num_seqs: int, num_tokens: int, tree: bool,
                 max_q_len: int, max_kv_len: int):
        t, b = num_tokens, num_seqs
        self.input_ids, self.positions, self.out_slots = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t]
        self.tree_mask = i64[3 * t : 4 * t] if tree else None
        self.logits_rows = i64[4 * t :]
        self.seq_rows, self.kv_lens, self.qo_indptr = i32[:b], i32[b : 2 * b], i32[2 * b :]
        self.max_q_len, self.max_kv_len = max_q_len, max_kv_len


class CudaGraphs:
    def __init__(self, runner: "ModelRunner", max_batch: int, max_tokens: int, max_tree_tokens: int):
        self.runner = runner
        self.batch_sizes = [b for b in BATCH_BUCKETS if b <= max_batch] or [max_batch]
        self.max_tokens = max_tokens
        self.max_tree_tokens = max_tree_tokens
        cfg = runner.model.config
        dtype = runner.model.model.embed_tokens.weight.dtype
        self._attn_out = torch.zeros(max_tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=runner.device)
        self._mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}

    def shape(self, lay: "StepLayout") -> tuple[int, int, bool] | None:
        """The captured shape serving this layout, or None (too large: run eagerly)."""
        num_seqs = len(lay.seq_rows)
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        if i == len(self.batch_sizes):
            return None
        b = self.batch_sizes[i]
        tree = lay.tree_mask is not None
        t = b if not tree else max(b, 1 << (lay.num_tokens - 1).bit_length())
        if t > self.max_tokens or (tree and int(lay.q_lens.max()) > self.max_tree_tokens):
            return None
        return b, t, tree

    def run(self, lay: "StepLayout", shape: tuple[int, int, bool]) -> torch.Tensor:
        """Logits [len(lay.logits_rows), vocab] for the layout, by graph replay."""
        g = self._graphs.get(shape) or self._capture(*shape)
        b, t, tree = shape
        padded = lay.padded(b, t, t, self.runner.pool.padding_row)
        qo_indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(padded.q_lens, out=qo_indptr[1:])
        mask = padded.tree_mask if tree else np.zeros(t, dtype=np.int64)
        np.concatenate(
            [padded.input_ids, padded.positions, padded.out_slots, mask, padded.logits_rows], out=g.i64_host.numpy()
        )
        np.concatenate([padded.seq_rows, padded.kv_lens, qo_indptr], out=g.i32_host.numpy())
        g.i64.copy_(g.i64_host, non_blocking=True)
        g.i32.copy_(g.i32_host, non_blocking=True)
        g.graph.replay()
        return g.logits[: len(lay.logits_rows)]

    def _capture(self, num_seqs: int, num_tokens: int, tree: bool) -> _Graph:
        runner, dev = self.runner, self.runner.device
        i64 = torch.zeros(5 * num_tokens, dtype=torch.int64, device=dev)
        i32 = torch.zeros(3 * num_seqs + 1, dtype=torch.int32, device=dev)
        i32[:num_seqs] = runner.pool.padding_row  # all padding until the first replay writes real values
        if tree:
            i64[3 * num_tokens : 4 * num_tokens] = 1
        step = _StaticStep(
            i64, i32, num_seqs, num_tokens, tree,
            max_q_len=self.max_tree_tokens if tree else 1, max_kv_len=runner.pool.max_context,
        )
        attn_out = self._attn_out[:num_tokens]
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                runner.forward(step, attn_out)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = runner.forward(step, attn_out)
        g = _Graph(
            graph, i64, i32,
            torch.empty(i64.shape, dtype=torch.int64, pin_memory=True),
            torch.empty(i32.shape, dtype=torch.int32, pin_memory=True),
            logits,
        )
        self._graphs[(num_seqs, num_tokens, tree)] = g
        return g
