"""What a decode step and speculation share, where both can import it (spec/ imports nothing of
rollout.engine): the batch buckets (a CUDA graph each, and the budget's costs by bucket), which
drafter made a sequence's tree (`Source`), what a step asks of a draft head (`HeadWork`), what the
n-gram drafter searches (`DraftSettings`), a host array onto the device, and the views of a
sequence and of the KV pool that speculation reads (`Drafted`, `KVCache`: rollout.engine's
Sequence and KVPool are them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import numpy as np
import torch

# Batch sizes are padded up to these (one CUDA graph each): costs are kept per bucket too.
BATCH_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` (on the CPU: the same memory, no copy)."""
    # non_blocking: a blocking copy would wait for the device to finish the step in flight. From
    # pageable memory the copy is staged before the call returns, so `a` may be dropped at once.
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def bucket(num_seqs: int) -> int:
    """The padded batch size of `num_seqs` sequences, or num_seqs past the largest bucket."""
    i = bisect.bisect_left(BATCH_BUCKETS, num_seqs)
    return BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else num_seqs


class Source(IntEnum):
    """Which drafter made a sequence's tree in a step (its statistics' name: `Emitted.sources`)."""

    NGRAM = 0
    HEAD = 1  # a draft head's (eagle or mtp)
    COUPLED = 2  # the sample's earlier rollout under coupled sampling


class HeadWork(IntEnum):
    """What a step asks of a draft head (spec/head_drafter.py)."""

    NONE = 0  # the head sleeps: no pass, the running sequences' head KV falls behind (their chains end)
    PASS = 1  # its pass over the step's rows: their head KV is kept, no chains for the next step
    CHAIN = 2  # the pass, and chains for the next step


@dataclass(frozen=True)
class DraftSettings:
    """What the drafter searches (kernels/ngram_draft.py): SpecConfig's values."""

    window: int
    min_match: int
    cands: int
    depth: int  # deepest draft, and a tree's drafts at most (its top-ranked)
    scan: torch.Tensor  # [groups, M] int32: the rows each group of sequences searches (spec/index.py)
    coupled: bool = False  # a sample follows its earlier rollout drawn with its key (kernels/coupled_draft.py)


@dataclass
class StepReport:
    """What a collected decode step's drafts did, for speculation's policies (Speculator.observe)."""

    by_source: dict  # drafter name -> its verified drafts this step (`drafted`, `accepted`, `sequences`, `first_accepted`)
    index_misses: int | None = None  # a hybrid's drafting step: sequences the index had nothing for
    coupled: int | None = None  # a drafting step under coupled sampling: sequences that followed their earlier rollout
    head: HeadWork = HeadWork.NONE  # what the draft head did in it
    tokens: int = 0  # tokens the step appended


class Drafted(Protocol):
    """A running (or finished) sequence as the index and the budget see it."""

    seq_id: int
    request: Any  # its request: `prompt_ids`, the prompt its group shares
    row: int  # its KV and token-table row while it holds one (-1 after)
    group: int  # its group's line in the scan table while it runs (written by the index)
    history_row: int  # the token-table row it was kept in once finished (written by the index)
    tokens: list[int]  # prompt + output
    num_prompt: int
    finish_reason: str | None

    @property
    def num_output(self) -> int: ...


class KVCache(Protocol):
    """The KV pool as a draft head's drafter reads it (its own scratch slots, the slot table, the caches)."""

    device: torch.device
    max_context: int
    slot_table: torch.Tensor  # [rows + 1, max_context] int32
    k_caches: list[torch.Tensor]  # per layer [num_slots, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]

    def reserved_slots(self) -> np.ndarray: ...
