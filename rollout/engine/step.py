"""The types of one engine step, from the scheduler's batch to what the host collects; and
the one packing of a decode step's inputs, shared by eager steps and CUDA graphs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

from rollout.engine.sequence import Sequence
from spec.step import HeadWork


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens whose KV this step computes: a prefill chunk, or 1 (+ drafts) for decode
    samples: bool  # this step draws the sequence's next token(s)
    decode: bool = False  # a running sequence's decode (or verify) step, not a prefill chunk


@dataclass
class Batch:
    """One step's sequences. A decode step (every running sequence, drafts or not) is its list of
    sequences alone; a prefill step has an item per sequence: prompt chunks, with running
    sequences' decode tokens riding along (without drafts)."""

    seqs: list[Sequence]
    items: list[ScheduledSeq] | None = None  # prefill steps only, in `seqs` order
    epoch: int | None = None  # decode steps: the scheduler's running set this is (Scheduler.epoch), if whole

    @property
    def is_prefill(self) -> bool:
        return self.items is not None

    @staticmethod
    def prefill(items: list[ScheduledSeq]) -> "Batch":
        return Batch([item.seq for item in items], items)


class StepRecord(NamedTuple):
    """One step as it ran, for profiles (Engine.step_log)."""

    num_seqs: int
    draft_rows: int  # drafts verified in the batch at most (its capacity; 0: plain decoding)
    drafting: bool  # the drafter ran (with no draft rows: for the budget's statistics only)
    prefill: bool
    wall_ms: float  # the wall time the step added (overlapping steps: since the one before completed)
    device_ms: float  # decode and verify steps: the device's time (CUDA events; prefill: 0)
    host_ms: float  # the wall time less the time the host waited for the device
    began_s: float  # time.perf_counter() when the step began (one clock for a host's processes: ranks line up)


@dataclass
class Emitted:
    """What a step produced, in columns, one entry per sequence (before stop-condition truncation).
    Columns rather than an object per sequence: at 512 sequences a step's host work is its budget."""

    seqs: list[Sequence]
    tokens: list[list[int]] | list[int]  # (`single`: the token itself)
    logprobs: list[list[float]] | list[float]
    counted: list[bool]  # a decode/verify step's tokens (they count toward accept length), not a prefill's first
    drafted: list[int]  # draft tokens verified for each sequence (accepted: its tokens less one)
    sources: list[str] | None = None  # each sequence's drafter (verify steps; what `append` reads where drafts were verified)
    top: list[list[tuple[list[int], list[float]]]] | None = None  # per token: the most likely tokens and their logprobs
    index_misses: int | None = None  # a hybrid's drafting step: sequences the n-gram index found nothing for
    coupled: int | None = None  # a drafting step: sequences that followed their earlier rollout (Source.COUPLED)
    overflowed: list[int] | None = None  # sequences whose emitted logprobs are NaN: the forward overflowed (inf or NaN)
    # One token each, nothing drafted (plain decode steps, prefills): tokens[i] and logprobs[i] are the
    # token and its logprob, not lists, which at 512 sequences saves the host a list per sequence and column.
    single: bool = False


class I64Row(IntEnum):
    """The rows of a step's packed integer sampling inputs [2, S] (SamplingRows.i64, DecodeInputs.sampling)."""

    KEY = 0  # the RNG key (rollout.engine.sampler.sequence_key)
    TOP_K = 1


class F32Row(IntEnum):
    """The rows of a step's packed float sampling inputs [3, S] (SamplingRows.f32, DecodeInputs.params)."""

    TEMPERATURE = 0
    TOP_P = 1
    MIN_P = 2


@dataclass
class SamplingRows:
    """Per-sequence sampling inputs on the host, packed so that each goes to the device in one copy:
    i64 [2, S] by I64Row, f32 [3, S] by F32Row."""

    i64: np.ndarray
    f32: np.ndarray
    mode: str  # greedy | sample | truncate: the code path all rows can share

    @staticmethod
    def of(seqs: list[Sequence]) -> "SamplingRows":
        n = len(seqs)
        params = [s.request.params for s in seqs]
        col = lambda values, dtype: np.fromiter(values, dtype, n)  # noqa: E731
        i64 = np.empty((len(I64Row), n), np.int64)
        i64[I64Row.KEY], i64[I64Row.TOP_K] = col((s.key for s in seqs), np.int64), col((p.top_k for p in params), np.int64)
        f32 = np.empty((len(F32Row), n), np.float32)
        f32[F32Row.TEMPERATURE] = col((p.temperature for p in params), np.float32)
        f32[F32Row.TOP_P] = col((p.top_p for p in params), np.float32)
        f32[F32Row.MIN_P] = col((p.min_p for p in params), np.float32)
        if not f32[F32Row.TEMPERATURE].any():
            mode = "greedy"
        elif (i64[I64Row.TOP_K] > 0).any() or (f32[F32Row.TOP_P] < 1).any() or (f32[F32Row.MIN_P] > 0).any():
            mode = "truncate"
        else:
            mode = "sample"
        return SamplingRows(i64, f32, mode)


@dataclass
class BatchRows:
    """A decode batch's per-sequence inputs that stay the same while its sequences do: the model
    runner keeps them for as long as the scheduler's running set is unchanged (Batch.epoch)."""

    epoch: int | None
    rows: np.ndarray  # [S] int32: each sequence's token-table and KV row
    i32: np.ndarray  # [2 * S] int32: rows, then n-gram groups (DecodeInputs' i32)
    sampling: SamplingRows
    editing: bool  # some sequence's logits are edited
    top: int  # the most top logprobs a sequence asks for

    @staticmethod
    def of(batch: Batch) -> "BatchRows":
        seqs, s = batch.seqs, len(batch.seqs)
        rows = np.fromiter((q.row for q in seqs), np.int32, s)
        groups = np.fromiter((q.group for q in seqs), np.int32, s)
        return BatchRows(batch.epoch, rows, np.concatenate([rows, groups]), SamplingRows.of(seqs),
                         any(q.request.edits_logits for q in seqs), max(q.request.top_logprobs_num for q in seqs))


class DecodeInputs:
    """A decode or verify step's inputs on the device, packed in three tensors (one copy each):
    i64 [R + 2 * S]: the KV slot of each of the step's R rows (S + its draft rows), then `sampling`
    [2, S] by I64Row; i32 [2 * S]: rows, groups; f32: `params` [3, S] by F32Row."""

    def __init__(self, i64: torch.Tensor, i32: torch.Tensor, f32: torch.Tensor, num_seqs: int, num_rows: int):
        s, r = num_seqs, num_rows
        self.i64, self.i32, self.f32 = i64, i32, f32
        self.slots = i64[:r]
        self.sampling = i64[r:].view(len(I64Row), s)
        self.rows, self.groups = i32[:s], i32[s:]
        self.params = f32.view(len(F32Row), s)

    @staticmethod
    def host_arrays(slots: np.ndarray, b: BatchRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.concatenate([slots.ravel(), b.sampling.i64.ravel()]), b.i32, b.sampling.f32.ravel()


class OutCol(IntEnum):
    """The columns of a decode step's integer outputs past its N emitted tokens (DecodeOutputs.ints)."""

    LENGTH = 0  # the tokens it emitted: its accepted drafts and the draw after them
    BITS = 1  # its accepted nodes, a bit each (node order is depth order)
    COUNT = 2  # its rows in the step: its root and the drafts laid out for it
    SOURCE = 3  # the drafter that made its tree (Source)


@dataclass
class DecodeOutputs:
    """What a decode or verify step leaves on the device for the host."""

    ints: torch.Tensor  # [S, N + len(OutCol)] int64: emitted tokens by depth, then the OutCol columns
    logprobs: torch.Tensor  # [S, N] float32: the emitted tokens' logprobs
    trees: tuple[torch.Tensor, ...] | None  # the drafter's whole trees (tokens, depths, ancestors, keys) [S, depth + 1]
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # ids [R, k], logprobs [R, k] by row (eager steps)


class DeviceClock:
    """When a step's device work starts, to time it against the HostCopy that ends it (CUDA
    events: exact and asynchronous; on the CPU, where a step is done at launch, wall time)."""

    def __init__(self, device: torch.device):
        self.event = None
        self.began = time.perf_counter()
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()


class HostCopy:
    """A step's results on their way to the host: asynchronous copies into pinned memory, one event."""

    def __init__(self, tensors: list[torch.Tensor], clock: DeviceClock | None = None):
        self.event = None
        self.clock = clock
        self.waited = 0.0  # seconds the host spent waiting for it
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=clock is not None)
            self.event.record()
        else:
            self.host = list(tensors)  # (on the CPU every step makes fresh tensors: no graphs)
            self.ended = time.perf_counter()

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:
            t0 = time.perf_counter()
            self.event.synchronize()  # the step's one intended host sync
            self.waited = time.perf_counter() - t0
        return [h.numpy() for h in self.host]

    @property
    def synchronous(self) -> bool:
        """The step was done when launched (the CPU)."""
        return self.event is None

    def device_seconds(self) -> float:
        """The step's device time, from its clock to its results' copy (after `wait`)."""
        if self.event is None:
            return self.ended - self.clock.began
        return self.clock.event.elapsed_time(self.event) / 1e3


@dataclass
class StepInFlight:
    """A launched step: what `collect` needs once the device is done."""

    batch: Batch
    draft_rows: int  # decode and verify steps: drafts verified at most (0: plain decoding)
    result: HostCopy
    slots: np.ndarray | None = None  # [S + draft_rows] decode/verify: each row's KV slot
    rows: np.ndarray | None = None  # [S] decode/verify: each sequence's row at launch
    drafting: bool = False  # decode/verify: the drafter ran
    shadow: bool = False  # the drafter's whole trees come back too
    top: bool = False
    head: HeadWork = HeadWork.NONE  # decode/verify: a draft head's work in it
    trees: tuple[np.ndarray, ...] | None = None  # those trees (tokens, depths, ancestors, keys [S, depth + 1]), once collected
    accepted: np.ndarray | None = None  # [S, N] decode/verify: the nodes whose KV is kept, once collected
    first_row: np.ndarray | None = None  # [S] decode/verify: each sequence's first row (its root's), once collected
    began: float = 0.0  # when the engine's step() that launched it began

    @property
    def chainable(self) -> bool:
        """A decode or verify step: the next one can be launched before this one is collected."""
        return not self.batch.is_prefill
