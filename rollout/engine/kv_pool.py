"""The KV cache: one preallocated pool of token slots, and the table mapping sequences to slots.

Slots are token-granular (page size 1), so a draft tree, a shared prompt or a compacted
accepted path is just a list of slot ids. Slots are reference counted: the `n` samples
of a prompt point at the same prompt slots, which return to the free list when the last
sample lets go. Slot 0 is never handed out; padded tokens write there.

`reserved` slots past the pool's own are set aside for a drafter's scratch KV (spec/head_drafter.py):
they are never handed out, so they count neither as used nor as free, and an idle engine's
pool is empty (a colocated trainer's `release_memory` needs that).
"""

from __future__ import annotations

import numpy as np
import torch

from spec.step import to_device


class OutOfSlots(Exception):
    """The pool cannot hold the requested tokens; the scheduler preempts and retries."""


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_context: int,
        reserved: int = 0,
    ):
        self.num_slots = num_slots
        self.reserved = reserved
        self.device = device
        self.dtype = dtype
        self.cache_shape = (num_layers, num_slots + reserved, num_kv_heads, head_dim)
        self.allocate()

        # Row r holds the slots of one sequence's tokens in order. The host copy is the truth;
        # the device copy receives only this step's new entries (see commit_rows). The extra
        # last row stays all zeros: padding sequences use it, so they read and write slot 0.
        self.rows_host = np.zeros((max_rows + 1, max_context), dtype=np.int32)
        if device.type == "cpu":
            self.slot_table = torch.from_numpy(self.rows_host)
        else:
            self.slot_table = torch.zeros((max_rows + 1, max_context), dtype=torch.int32, device=device)
        self.padding_row = max_rows
        self.max_rows = max_rows
        self.max_context = max_context
        self.reset()

    def reset(self) -> None:
        """Every slot and row free, the slot table zeroed (the K/V contents are left as they are)."""
        self.refcount = np.zeros(self.num_slots, dtype=np.int32)
        self._free_stack = np.arange(self.num_slots - 1, 0, -1, dtype=np.int32)  # slot 0 reserved
        self._free_top = self.num_slots - 1
        self._free_rows = list(range(self.max_rows - 1, -1, -1))
        self.rows_host[:] = 0
        if self.device.type != "cpu":
            self.slot_table.zero_()

    def allocate(self) -> None:
        # Zeroed, not empty: masked-out and padding slots still enter the attention matmuls,
        # and garbage there (NaN * 0 = NaN) would poison whole rows.
        self.k_cache = torch.zeros(self.cache_shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(self.cache_shape, dtype=self.dtype, device=self.device)
        self.k_caches = list(self.k_cache.unbind(0))
        self.v_caches = list(self.v_cache.unbind(0))

    def free_memory(self) -> int:
        """Drop the K/V tensors (every slot must be free); `allocate` brings them back. Returns the bytes let go."""
        if self.used_slots:
            raise RuntimeError(f"{self.used_slots} KV slots are in use: the pool can only be freed when idle")
        freed = self.nbytes
        self.k_cache = self.v_cache = None
        self.k_caches, self.v_caches = [], []
        return freed

    @property
    def nbytes(self) -> int:
        return 0 if self.k_cache is None else 2 * self.k_cache.numel() * self.k_cache.element_size()

    # ---- slots ----
    def reserved_slots(self) -> np.ndarray:
        """The slots set aside for a drafter's scratch KV, past the pool's own."""
        return np.arange(self.num_slots, self.num_slots + self.reserved, dtype=np.int64)

    @property
    def free_slots(self) -> int:
        return self._free_top

    @property
    def used_slots(self) -> int:
        return self.num_slots - 1 - self._free_top

    def alloc(self, n: int) -> np.ndarray:
        if n > self._free_top:
            raise OutOfSlots(f"need {n} KV slots, {self._free_top} free")
        top = self._free_top
        slots = self._free_stack[top - n : top].copy()
        self._free_top = top - n
        self.refcount[slots] = 1
        return slots

    def share(self, slots: np.ndarray) -> None:
        self.refcount[slots] += 1

    def release(self, slots: np.ndarray) -> None:
        """Drop one reference from each slot (slots must be distinct); free those left unreferenced."""
        if len(slots) == 0:
            return
        self.refcount[slots] -= 1
        freed = slots[self.refcount[slots] == 0]
        top = self._free_top
        self._free_stack[top : top + len(freed)] = freed
        self._free_top = top + len(freed)

    # ---- rows ----
    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def commit_rows(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """Copy host entries (rows[i], cols[i]) to the device slot table, one scatter per step."""
        if self.device.type == "cpu" or len(rows) == 0:
            return
        values, r, c = (to_device(a, self.device) for a in (self.rows_host[rows, cols], rows.astype(np.int64),
                                                              cols.astype(np.int64)))
        self.slot_table[r, c] = values
