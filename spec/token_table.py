"""Every sequence's tokens on the device, where steps read their inputs and drafts are searched.

Row r of the table holds the tokens (prompt, then output) of the sequence that owns KV row r
of the pool; past the live rows and the pool's padding row come history rows, which keep
finished samples for later rollouts of their prompt. A decode or verify step reads each
sequence's last token here and writes what it emitted back (kernels/tree_accept.py), so the
next step can be launched before the host has seen this one: a running sequence's cached KV
is always its token count less one (its last token is the next step's input).

The host writes what only it knows: prompt chunks and first tokens at prefill
(`record_prefill`), a fork's copy of its prompt, and history rows (`keep`). Its own copy of
the tokens (Sequence.tokens) trails the device by the steps still in flight. Samples finish
by the hundred in one step of a large batch, so `keep` only queues its row copy; `flush`
(before the next step whose drafter runs, and before any other write or read here, such as a
prefill's) makes them all at once, before the live rows they read from can be reused.
"""

from __future__ import annotations

import numpy as np
import torch

from spec.step import to_device


class TokenTable:
    def __init__(self, live_rows: int, history_rows: int, capacity: int, device: torch.device):
        self.padding_row = live_rows  # the KV pool's padding row: never written
        self.history_start = live_rows + 1
        self.num_rows = live_rows + 1 + history_rows
        self.capacity = capacity
        self.device = device
        self.tokens = torch.zeros(self.num_rows, capacity, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        self.prompt_lens = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        # each row's sampling key (uint32 values): a history row drawn with a running sample's key is
        # that sample's earlier rollout under coupled sampling, which it drafts from (kernels/ngram_draft.py)
        self.keys = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
        self._kept: dict[int, tuple[int, int, int]] = {}  # history row -> (live row, length, prompt length), queued

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.lengths, self.prompt_lens, self.keys))

    def write(self, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
        """tokens[rows[i], cols[i]] = values[i] (host-known tokens: prompt chunks)."""
        self.flush()
        if len(rows):
            self.tokens[to_device(rows, self.device), to_device(cols, self.device)] = to_device(values.astype(np.int32), self.device)

    def record_prefill(self, rows: np.ndarray, lengths: np.ndarray, prompt_lens: np.ndarray, keys: np.ndarray,
                       drawn: torch.Tensor | None = None, draw_rows: np.ndarray | None = None,
                       draw_cols: np.ndarray | None = None) -> None:
        """After an eager step: the lengths, prompt lengths and sampling keys of `rows`, and the drawn
        tokens (on the device) at (draw_rows, draw_cols)."""
        self.flush()
        r = to_device(rows, self.device)
        if drawn is not None and len(draw_rows):
            self.tokens[to_device(draw_rows, self.device), to_device(draw_cols, self.device)] = drawn.to(torch.int32)
        self.lengths[r] = to_device(lengths.astype(np.int32), self.device)
        self.prompt_lens[r] = to_device(prompt_lens.astype(np.int32), self.device)
        self.keys[r] = to_device(keys.astype(np.int64), self.device)

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Rows `dsts` take the first `length` tokens of row `src` (a fork's prompt)."""
        self.flush()
        if dsts and length:
            self.tokens[to_device(np.array(dsts, dtype=np.int64), self.device), :length] = self.tokens[src, :length]

    def keep(self, src: int, dst: int, length: int, prompt_len: int) -> None:
        """History row `dst` takes the first `length` tokens of live row `src` (a finished sample), at
        the next `flush` (a later keep into the same row replaces it)."""
        self._kept[dst] = (src, length, prompt_len)

    def flush(self) -> None:
        """Make the queued keeps: whole rows in one copy (their lengths bound what is read)."""
        if not self._kept:
            return
        # one copy to the device for all four columns (a copy costs the host as much as a kernel)
        queued = np.array([(dst, *v) for dst, v in self._kept.items()], dtype=np.int32).T
        self._kept.clear()
        dst, src, length, prompt_len = to_device(queued, self.device)
        self.tokens[dst] = self.tokens[src]
        self.keys[dst] = self.keys[src]
        self.lengths[dst] = length
        self.prompt_lens[dst] = prompt_len

    def forget(self, row: int) -> None:
        self.flush()
        # a fill, queued like a kernel (`lengths[row] = 0` would copy a host scalar and wait for the device)
        self.lengths[row : row + 1].fill_(0)

    def read(self, row: int) -> list[int]:
        """A row's tokens (a host sync: for tests and checks)."""
        self.flush()
        return self.tokens[row, : int(self.lengths[row])].tolist()

    def indexed(self, seqs) -> tuple[int, int]:
        """(output tokens found in the table, output tokens) of `seqs` (Drafted): a running one's own
        row, a finished one's history row if it was kept. A host sync: for benchmarks and tests."""
        found = total = 0
        for seq in seqs:
            total += seq.num_output
            row = seq.row if seq.finish_reason is None else seq.history_row
            if row >= 0:
                have = self.read(row)[: len(seq.tokens)]
                found += sum(a == b for a, b in zip(have[seq.num_prompt :], seq.tokens[seq.num_prompt :]))
        return found, total
