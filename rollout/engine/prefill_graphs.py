"""CUDA graphs of small one-sequence prefill steps, one per token-count bucket.

A request alone (b1) prefills its prompt in one step, eagerly: on the Llama-3.1-8B shape its
~400 launches took the host longer than the GPU took to run them (15-22 ms for 128 tokens on
an H200, where reading the weights takes ~3.4 ms; 6.1 ms in these graphs: bench/RESULTS.md). A prefill step of one
sequence's chunk of at most BUCKETS[-1] tokens, with nothing riding along and no draft head
reading its hidden states, replays instead the graph of the smallest bucket that holds it:

- its inputs are one int64 buffer (tokens, positions and KV slots, each padded to the bucket,
  then the sequence's row, its length after the chunk, and the chunk's length), copied in from
  pinned staging (two sets used in turn, as decode graphs do);
- padding tokens are token 0 at position 0 with their K/V written to the dump slot 0, and
  attention is told the chunk's real length, so they belong to no sequence: their attention
  output stays as captured (zeros: the buffer is this module's) and their rows are never read;
- attention plans for the pool's context, as decode graphs do (its keys split by the real
  length), so one graph serves every start;
- the graph's output is the logits of the chunk's last token; the draws stay outside, eager.

Graphs are captured up front (`capture_all`), or when a bucket is first used after they were
dropped (a weight or KV release).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from rollout.engine.cuda_graphs import capture

BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    inputs: torch.Tensor  # int64 [3 x bucket + 4] on the device
    host: list[torch.Tensor]  # pinned staging of the inputs, used in turn
    out: torch.Tensor | None = None  # [1, vocab] float32 logits
    turn: int = 0


class PrefillGraphs:
    def __init__(self, forward: Callable[..., torch.Tensor], slot_table: torch.Tensor, padding_row: int,
                 max_context: int, attn_out: torch.Tensor):
        """`forward(input_ids, positions, meta, logits_rows, attn_out)`: the model's forward
        (ModelRunner.forward); `padding_row`: the pool's row whose slots are all the dump slot;
        `attn_out` [BUCKETS[-1], heads, head_dim], zeros: attention's output buffer of every bucket
        (padding rows keep its zeros)."""
        self.forward = forward
        self.slot_table = slot_table
        self.padding_row = padding_row
        self.max_context = max_context
        self.device = attn_out.device
        self._attn_out = attn_out
        self._mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._graphs: dict[int, _Graph] = {}

    @staticmethod
    def bucket(num_tokens: int) -> int | None:
        """The bucket of a chunk of `num_tokens`, or None (too long: eager)."""
        return next((b for b in BUCKETS if num_tokens <= b), None)

    def clear(self) -> None:
        """Forget the graphs (they hold the addresses of the weights and the KV pool)."""
        self._graphs.clear()
        self._mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def capture_all(self) -> int:
        for b in BUCKETS:
            self.graph(b)
        return len(self._graphs)

    def run(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, row: int, start: int) -> torch.Tensor:
        """Logits [1, vocab] of the chunk's last token (the graph's output buffer: read it before the
        next run): `tokens`, their `positions` and KV `slots`, the sequence's pool `row`, the chunk's
        `start` (tokens already cached)."""
        g = self.graph(self.bucket(len(tokens)))
        self.stage(g, tokens, positions, slots, row, start)
        g.graph.replay()
        return g.out

    def stage(self, g: _Graph, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, row: int,
              start: int) -> None:
        """The chunk into `g`'s inputs (through the next pinned staging set)."""
        b, q = (len(g.inputs) - 4) // 3, len(tokens)
        host = g.host[g.turn]
        g.turn ^= 1
        h = host.numpy()
        h[:] = 0
        h[:q], h[b : b + q], h[2 * b : 2 * b + q] = tokens, positions, slots
        h[3 * b :] = (row, start + q, 0, q)  # seq_rows, kv_lens, qo_indptr
        g.inputs.copy_(host, non_blocking=True)

    def step(self, g: _Graph) -> torch.Tensor:
        """The padded forward of `g`'s inputs: what its graph captures."""
        b = (len(g.inputs) - 4) // 3
        x = g.inputs
        small = x[3 * b :].to(torch.int32)
        meta = AttentionMetadata(seq_rows=small[0:1], kv_lens=small[1:2], qo_indptr=small[2:4],
                                 slot_table=self.slot_table, out_slots=x[2 * b : 3 * b], tree_mask=None,
                                 max_q_len=b, max_kv_len=self.max_context)
        return self.forward(x[:b], x[b : 2 * b], meta, x[-1:] - 1, self._attn_out[:b])

    def graph(self, b: int) -> _Graph:
        """Bucket `b`'s graph, captured now if it was not."""
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(self.inputs(b))
        return g

    def inputs(self, b: int) -> _Graph:
        """A bucket's inputs and staging, holding a chunk of one token until the first run."""
        g = _Graph(None, torch.zeros(3 * b + 4, dtype=torch.int64, device=self.device),
                   [torch.zeros(3 * b + 4, dtype=torch.int64, pin_memory=self.device.type == "cuda") for _ in range(2)])
        g.inputs[3 * b :] = torch.tensor([self.padding_row, 1, 0, 1])  # (one token of the padding row)
        return g

    def _capture(self, g: _Graph) -> _Graph:
        g.graph, g.out = capture(lambda: self.step(g), self.device, self._mempool)
        return g
