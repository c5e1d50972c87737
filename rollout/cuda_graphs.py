"""CUDA graphs for decode and verify steps: one graph per padded (sequences, tokens) shape.

A decode step of a small model is mostly kernel-launch time; replaying a captured graph
turns ~10 launches per layer into one. A graph covers the whole step after the host
layout: the model, then sampling every row (one graph per sampling mode: greedy, plain
sampling, or with top-k/top-p/min-p truncation). Each graph owns its input tensors: a
step's layout is padded to the graph's shape (empty sequences, tokens that belong to
none and write slot 0), copied in with three host-to-device copies, replayed, and its
tokens and logprobs come back in one copy. The attention kernels read real lengths on
the device, so one graph serves every context length up to the pool's (attention splits the
keys for that bound, and spreads each step's real keys over the splits), and every tree up
to `max_tree_tokens` tokens per sequence. `capture_all` captures the decode and verify
shapes up front (the engine does so at start); any other shape is captured on first use.
Prefill steps run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout.model_runner import DrawInputs, Handoff
from rollout.sampler import sample

if TYPE_CHECKING:
    from rollout.model_runner import ModelRunner, StepLayout

BATCH_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


def tree_step_tokens(num_seqs: int, num_tokens: int) -> int:
    """Padded tokens of a verify graph: the padded batch size, or the next power of two above it."""
    return max(num_seqs, 1 << (num_tokens - 1).bit_length())


def verify_token_counts(num_seqs: int, max_tokens: int, max_tree_tokens: int) -> list[int]:
    """Every `tree_step_tokens` value a verify step of `num_seqs` padded sequences can take."""
    longest = min(max_tokens, num_seqs * max_tree_tokens)
    counts = [num_seqs] if num_seqs > 1 else []  # fewer tokens than padded rows (a lone sequence always drafts)
    t = 1 << num_seqs.bit_length()
    while t < 2 * longest and t <= max_tokens:
        counts.append(t)
        t *= 2
    return counts


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    i64: torch.Tensor  # [10 * T]: ids, positions, out slots, tree mask, tree parents, logits rows | (unused) row, key, position, top_k
    i32: torch.Tensor  # [3 * B + 1]: seq rows, kv lens, qo indptr
    f32: torch.Tensor  # [3 * T]: temperature, top_p, min_p
    # Pinned staging of i64, i32, f32, two sets used in turn: with a step chained after another
    # of the same shape, the earlier one's upload may still be queued when the next is staged.
    host: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    out: torch.Tensor  # [2, T] float64: drawn tokens, their logprobs; written by every replay
    step: "_StaticStep"  # the DeviceStep view of i64, i32 and f32
    handoff: Handoff  # for a decode step chained after a replay; written by every replay of a verify graph
    turn: int = 0


class _StaticStep:
    """The DeviceStep view of a graph's input tensors (see rollout.model_runner.DeviceStep)."""

    def __init__(self, i64: torch.Tensor, i32: torch.Tensor, f32: torch.Tensor, num_seqs: int, num_tokens: int,
                 tree: bool, mode: str, max_q_len: int, max_kv_len: int):
        t, b = num_tokens, num_seqs
        self.input_ids, self.positions, self.out_slots = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t]
        self.tree_mask = i64[3 * t : 4 * t] if tree else None
        self.tree_parents = i64[4 * t : 5 * t] if tree else None
        self.logits_rows = i64[5 * t : 6 * t]
        draw_cols = i64[6 * t :].view(4, t)
        self.draw_positions = draw_cols[2]  # every logits row draws once, in order: no draw_rows
        draws = DrawInputs(np.zeros((4, 0), np.int64), np.zeros((3, 0), np.float32), mode)
        self.sampling = draws.tensors(draw_cols, f32.view(3, t))
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
        self.max_context = runner.pool.max_context
        self._graphs: dict[tuple[int, int, bool, str], _Graph] = {}

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._mempool = torch.cuda.graph_pool_handle()

    def shape(self, lay: "StepLayout", mode: str) -> tuple[int, int, bool, str] | None:
        """The captured shape serving this layout, or None (too large: run eagerly)."""
        num_seqs = len(lay.seq_rows)
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        if i == len(self.batch_sizes):
            return None
        b = self.batch_sizes[i]
        tree = lay.tree_mask is not None
        t = tree_step_tokens(b, lay.num_tokens) if tree else b
        if t > self.max_tokens or (tree and int(lay.q_lens.max()) > self.max_tree_tokens):
            return None
        return b, t, tree, mode

    def capture_all(self, modes: tuple[str, ...] = ("greedy", "sample"), speculation: bool = True) -> int:
        """Capture every decode shape (and verify shapes when speculating) ahead of time, so no
        step pays a capture; returns how many graphs exist. Truncated sampling stays lazy."""
        for b in self.batch_sizes:
            shapes = [(b, b, False)]
            if speculation:
                shapes += [(b, t, True) for t in verify_token_counts(b, self.max_tokens, self.max_tree_tokens)]
            for num_seqs, num_tokens, tree in shapes:
                for mode in modes:
                    if (num_seqs, num_tokens, tree, mode) not in self._graphs:
                        self._capture(num_seqs, num_tokens, tree, mode)
        return len(self._graphs)

    def launch(self, lay: "StepLayout", draws: "DrawInputs", shape: tuple[int, int, bool, str],
               prepare: Callable[["_StaticStep"], None] | None = None) -> tuple["_StaticStep", torch.Tensor, Handoff]:
        """Replay the graph for this layout; returns its inputs on the device, its [2, n] (tokens,
        logprobs) output there, and what a decode step chained after it needs. `prepare`: completes
        a chained step's inputs on the device once they are uploaded (see ModelRunner.launch)."""
        g = self._graphs.get(shape) or self._capture(*shape)
        b, t, tree, _ = shape
        n = len(lay.logits_rows)
        padded = lay.padded(b, t, t, self.runner.pool.padding_row)
        qo_indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(padded.q_lens, out=qo_indptr[1:])
        mask, parents = (padded.tree_mask, padded.tree_parents) if tree else (np.zeros(t, np.int64),) * 2
        staging = g.host[g.turn]
        g.turn ^= 1
        i64_host, i32_host, f32_host = (h.numpy() for h in staging)
        np.concatenate(
            [padded.input_ids, padded.positions, padded.out_slots, mask, parents, padded.logits_rows],
            out=i64_host[: 6 * t],
        )
        draw_cols = i64_host[6 * t :].reshape(4, t)
        draw_cols[:, n:] = 0  # padding rows: greedy draws of row 0, ignored
        draw_cols[:, :n] = draws.i64
        f32_host.reshape(3, t)[:, n:] = 0
        f32_host.reshape(3, t)[:, :n] = draws.f32
        np.concatenate([padded.seq_rows, padded.kv_lens, qo_indptr], out=i32_host)
        for dst, src in zip((g.i64, g.i32, g.f32), staging):
            dst.copy_(src, non_blocking=True)
        if prepare is not None:
            prepare(g.step)
        g.graph.replay()
        return g.step, g.out[:, :n], g.handoff

    def _capture(self, num_seqs: int, num_tokens: int, tree: bool, mode: str) -> _Graph:
        runner, dev = self.runner, self.runner.device
        t = num_tokens
        i64 = torch.zeros(10 * t, dtype=torch.int64, device=dev)
        i32 = torch.zeros(3 * num_seqs + 1, dtype=torch.int32, device=dev)
        f32 = torch.zeros(3 * t, dtype=torch.float32, device=dev)
        i32[:num_seqs] = runner.pool.padding_row  # all padding until the first replay writes real values
        if tree:
            i64[3 * t : 4 * t] = 1
            i64[4 * t : 5 * t] = -1
        step = _StaticStep(
            i64, i32, f32, num_seqs, t, tree, mode,
            max_q_len=self.max_tree_tokens if tree else 1, max_kv_len=self.max_context,
        )

        def step_fn() -> tuple[torch.Tensor, Handoff]:
            logits = runner.forward(step, self._attn_out[:t])
            tokens, logprobs = sample(logits, step.sampling)
            out = torch.stack([tokens.double(), logprobs.double()])
            return out, runner.verify_handoff(step, out[0], self.max_tree_tokens) if tree else Handoff(out[0], None)

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                step_fn()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out, handoff = step_fn()
        host = [tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in (i64, i32, f32)) for _ in range(2)]
        g = _Graph(graph, i64, i32, f32, host, out, step, handoff)
        self._graphs[(num_seqs, num_tokens, tree, mode)] = g
        return g
