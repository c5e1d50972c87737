"""Continuous batching: who runs this step, how many tokens each computes, and where their KV goes.

A step is either an extend step (prefill chunks of waiting sequences, plus one decode
token for every running sequence) or a decode step (every running sequence, each with
a draft tree when speculation is on). Prefill of a request is done once for its `n`
samples: the first sample prefills, its siblings ride along as `forks` and take the
prompt's KV slots when it finishes. When the KV pool runs dry, the newest running
sequences are preempted: their slots are freed and they are recomputed later.

The scheduler is the one owner of KV rows and slots: it allocates them for each step
(`place_prefill`, `step_slots`), keeps a verify step's accepted nodes and frees the rest
(`settle_step`), shares a prompt's slots with its forks, and frees a sequence's row when it
finishes or is preempted. The model runner only reads the layout it is given.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import numpy as np

from rollout.engine.kv_pool import KVPool
from rollout.engine.sequence import Sequence, Status
from rollout.engine.step import Batch, ScheduledSeq

# While sequences decode, a new prompt is admitted only once this share of the rows is free
# (or it has waited MAX_ADMIT_WAIT steps): a step that holds prefill work runs without a CUDA
# graph, several times slower than a decode step, so admissions are batched instead of
# trickling in one finished sample at a time.
ADMIT_SHARE = 1 / 8
MAX_ADMIT_WAIT = 16
# A waiting request that does not fit now (rows or KV slots) lets the ones behind it pass, so a
# large `n` never blocks small requests; after it was passed this many steps, nothing passes it
# until it fits, so it cannot starve either.
MAX_OVERTAKEN = 64
# A request whose samples hold more than this share of the rows gives its newest ones up (they are
# preempted, and queued behind the newcomer) to a new request that finds no row free: a trainer's
# group of n = --max-running-seqs never stalls an interactive request for its whole run, and
# alone it still takes every row.
FAIR_SHARE = 1 / 2
# A new prompt is admitted only if its prefill and the tokens its samples are expected to add fit
# beside what the running samples are expected to add (SGLang's new-token ratio): a sample is
# expected to add `growth_ratio` of the tokens it may still add (max_new_tokens less its output, at
# most GROWTH_CLIP). The ratio starts at GROWTH_INIT and falls by GROWTH_DECAY a decode step to
# GROWTH_MIN, since most samples stop well before max_new_tokens; a preemption (admission was too
# bold: the pool ran dry) raises it to what the running samples turned out to need. Without it, a
# pool far below the groups' worst case thrashed: admitted, grown, preempted, recomputed, admitted
# (bench/probes/admission_thrash.py, 32 x 8 samples of up to 300 tokens on 8,000 slots: 615
# preemptions against 31; rl 64 x 8 on an H200's 12,000 slots: 2,112 against 75, 0.69x the speed).
# An idle engine admits the first waiting request whatever the estimate (one sample alone always
# fits: rollout.config.request_limit).
GROWTH_INIT, GROWTH_MIN = 0.7, 0.1
GROWTH_DECAY = (GROWTH_INIT - GROWTH_MIN) / 600
GROWTH_CLIP = 4096
PREEMPT_LOOKAHEAD = 20  # steps of growth a preemption's estimate adds for the samples still running
_EPOCHS = itertools.count()  # unique across schedulers and their resets (a decode batch caches its arrays by epoch)


class Scheduler:
    def __init__(self, pool: KVPool, max_running_seqs: int, max_prefill_tokens: int,
                 on_release: Callable[[Sequence], None] | None = None, conservativeness: float = 1.0):
        self.pool = pool
        self.on_release = on_release  # called before a sequence's KV row is freed (finished or preempted)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_rows = max_running_seqs
        self.admit_rows = max(1, int(max_running_seqs * ADMIT_SHARE))
        self.conservativeness = conservativeness  # scales the growth estimate (EngineConfig.schedule_conservativeness)
        self.reset()

    def reset(self) -> None:
        """No sequence waiting or running (the pool's slots and rows are its owner's to reset)."""
        self._admit_wait = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.epoch = next(_EPOCHS)  # changes whenever `running` does: a decode batch's arrays are cached by it
        self.num_preempted = 0
        self._passed: Sequence | None = None  # the first waiting sequence others overtook, and how often
        self._passed_steps = 0
        self.growth_ratio = GROWTH_INIT  # the share of its remaining max_new_tokens a sample is expected to add

    def add(self, leader: Sequence) -> None:
        """Queue a request's prefill: `leader` computes the prompt, `leader.forks` share it."""
        self.waiting.append(leader)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        prefill = self._schedule_prefill()
        if not self.running and not prefill:
            return None
        decode = self._schedule_decode()
        if not prefill:
            return Batch(decode, epoch=self.epoch)
        return Batch.prefill([ScheduledSeq(s, 1, True, decode=True) for s in decode] + prefill)

    def _make_room(self) -> bool:
        """Rows for a new request that finds none free, from a request holding more than FAIR_SHARE
        of them (its newest samples, preempted and queued behind the newcomer). True if it made
        room: the newcomer is admitted this step."""
        head = self.waiting[0] if self.waiting else None
        if head is None or head.num_cached or not self.running:
            return False
        need = 1 + len(head.forks) - self.pool.free_rows
        if need <= 0 or any(q.request is head.request for q in self.running):
            return False
        held: dict[int, list[Sequence]] = {}
        for q in self.running:
            held.setdefault(id(q.request), []).append(q)
        hog = max(held.values(), key=len)
        excess = len(hog) - int(FAIR_SHARE * self.max_rows)
        if excess < need:
            return False
        for q in hog[-need:]:
            self.preempt(q, behind=True)
        return True

    def _hold_admission(self) -> bool:
        """Whether the next prompt waits this step (see ADMIT_SHARE); a prompt whose prefill has
        begun, or one arriving at an idle engine, never waits."""
        head = self.waiting[0] if self.waiting else None
        if head is None or not self.running or head.num_cached or self.pool.free_rows >= self.admit_rows:
            self._admit_wait = 0
            return False
        self._admit_wait += 1
        if self._admit_wait > MAX_ADMIT_WAIT:
            self._admit_wait = 0
            return False
        return True

    def _schedule_prefill(self) -> list[ScheduledSeq]:
        if not self._make_room() and self._hold_admission():
            return []
        if not self.waiting:
            return []
        items: list[ScheduledSeq] = []
        budget = self.max_prefill_tokens
        # A slot for every running sequence's next token, and what they are expected to add (see GROWTH_INIT).
        idle = not self.running
        spare = self.pool.free_slots - len(self.running) - sum(self._growth(q, 1) for q in self.running)
        rows_left = self.pool.free_rows
        skipped, overtaken = None, False
        for seq in self.waiting:
            if budget <= 0:
                break
            remaining = len(seq.tokens) - seq.num_cached
            chunk = min(remaining, budget)
            finishing = chunk == remaining
            needs_rows = (seq.row < 0) + (len(seq.forks) if finishing else 0)
            needs_slots = chunk + (len(seq.forks) + 1 if finishing else 0)
            grows = self._growth(seq, 1 + len(seq.forks))
            if needs_rows > rows_left or needs_slots > spare or (needs_slots + grows > spare and not idle):
                skipped = skipped or seq
                if seq is self._passed and self._passed_steps >= MAX_OVERTAKEN:
                    break  # it has waited long enough: the rows and slots that free up are its
                continue
            if seq.row < 0:
                seq.row = self.pool.alloc_row()
            rows_left -= needs_rows
            spare -= needs_slots + grows
            budget -= chunk
            idle = False
            items.append(ScheduledSeq(seq, chunk, finishing))
            overtaken = overtaken or skipped is not None
        if overtaken:
            self._passed_steps = self._passed_steps + 1 if skipped is self._passed else 1
            self._passed = skipped
        elif skipped is None:
            self._passed = None
        return items

    def _growth(self, seq: Sequence, samples: int) -> int:
        """KV slots `samples` samples at `seq`'s length are expected to add (see GROWTH_INIT)."""
        left = min(seq.request.max_len - len(seq.tokens), GROWTH_CLIP)
        return int(samples * left * self.growth_ratio * self.conservativeness)

    def _schedule_decode(self) -> list[Sequence]:
        if len(self.running) > self.pool.free_slots:
            while len(self.running) > self.pool.free_slots and len(self.running) > 1:
                self.preempt(self.running[-1])
            self._raise_growth_ratio()
        else:
            self.growth_ratio = max(GROWTH_MIN, self.growth_ratio - GROWTH_DECAY)
        return list(self.running)

    def _raise_growth_ratio(self) -> None:
        """After the pool ran dry: the share of max_new_tokens the running samples have added so far
        (and a few steps more), as SGLang estimates it after a retraction."""
        added = sum(q.num_output + PREEMPT_LOOKAHEAD for q in self.running)
        allowed = sum(q.request.params.max_new_tokens for q in self.running)
        self.growth_ratio = min(1.0, max(self.growth_ratio, added / allowed))

    def on_prefill_done(self, seq: Sequence) -> None:
        """`seq` (and its forks) computed the whole prompt: they join the running batch."""
        self.waiting.remove(seq)
        for s in [seq, *seq.forks]:
            s.status = Status.RUNNING
            self.running.append(s)
        seq.forks = []
        self.epoch = next(_EPOCHS)

    def preempt_all(self) -> None:
        """Drop all cached KV (e.g. after a weight update): every sequence is recomputed from scratch."""
        for seq in list(self.running):
            self.preempt(seq)
        for seq in self.waiting:
            self._release(seq)

    def preempt(self, seq: Sequence, behind: bool = False) -> None:
        """Free `seq`'s KV; it is recomputed later, first in the queue (`behind`: last)."""
        self.running.remove(seq)
        self.epoch = next(_EPOCHS)
        self._release(seq)
        seq.status = Status.WAITING
        if behind:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preempted += 1

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.epoch = next(_EPOCHS)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    # ---------------- KV slots ----------------
    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    def place_prefill(self, batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """KV slots for a prefill step's tokens after each sequence's cached prefix, in the slot table
        on the host and (committed) on the device. A finished prompt's forks get rows sharing its
        slots. Advances every sequence's cached length; returns the slots, each token's position, and
        each item's start (its cached length before this step)."""
        items = batch.items
        rows = np.fromiter((item.seq.row for item in items), np.int64, len(items))
        starts = np.fromiter((item.seq.num_cached for item in items), np.int64, len(items))
        q_lens = np.fromiter((item.num_new for item in items), np.int64, len(items))
        offsets = np.arange(int(q_lens.sum())) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        slots = self.pool.alloc(len(offsets)).astype(np.int64)
        positions = np.repeat(starts, q_lens) + offsets
        edits = [(np.repeat(rows, q_lens), positions, slots)]
        self.pool.rows_host[edits[0][0], edits[0][1]] = slots  # (forks below read the prompt's slots)
        for item in items:
            seq = item.seq
            seq.num_cached += item.num_new
            if item.samples and seq.forks:
                n = seq.num_cached
                prompt_slots = self.pool.rows_host[seq.row, :n]
                for fork in seq.forks:
                    fork.row = self.pool.alloc_row()
                    self.pool.share(prompt_slots)
                    edit = (np.full(n, fork.row, dtype=np.int64), np.arange(n, dtype=np.int64), prompt_slots.copy())
                    self.pool.rows_host[edit[0], edit[1]] = edit[2]
                    edits.append(edit)
                    fork.num_cached = n
                    fork.cached_tokens = fork.cached_tokens or n
        self.pool.commit_rows(np.concatenate([r for r, _, _ in edits]), np.concatenate([c for _, c, _ in edits]))
        return slots, positions, starts

    def step_slots(self, num_rows: int) -> np.ndarray:
        """Fresh KV slots for a decode or verify step's rows; `settle_step` keeps the accepted ones."""
        return self.pool.alloc(num_rows).astype(np.int64)

    def settle_step(self, batch: Batch, rows: np.ndarray, slots: np.ndarray, first_row: np.ndarray,
                    accepted: np.ndarray) -> None:
        """After a decode or verify step: a sequence that still holds its KV row keeps its accepted
        nodes' slots (`accepted` [S, N], depth order; node j of sequence i had step row
        first_row[i] + j, whose slot is slots[that row]; the device moved them into its KV row
        already, the host's copy of the slot table follows) and its cached length grows by them;
        every other slot is freed. A sequence preempted or finished since the launch keeps none."""
        seqs = batch.seqs
        s, n = accepted.shape
        keep = accepted
        if batch.epoch != self.epoch:  # (the same running set: every sequence still holds its row)
            holds = np.fromiter((q.row == r and not q.finished for q, r in zip(seqs, rows.tolist())), bool, s)
            keep = accepted & holds[:, None]
        step_rows = np.minimum(first_row[:, None] + np.arange(n), len(slots) - 1)[keep]  # (a node without a row: not kept)
        cached = np.fromiter((q.num_cached for q in seqs), np.int64, s)
        cols = cached[:, None] + np.cumsum(keep, axis=1) - 1
        self.pool.rows_host[np.broadcast_to(rows[:, None], (s, n))[keep], cols[keep]] = slots[step_rows]
        unused = np.ones(len(slots), dtype=bool)
        unused[step_rows] = False
        self.pool.release(slots[unused])
        for q, k in zip(seqs, keep.sum(axis=1).tolist()):
            q.num_cached += k

    def _release(self, seq: Sequence) -> None:
        if seq.row >= 0 and self.on_release is not None:
            self.on_release(seq)
        if seq.row >= 0:
            self.pool.release(self.pool.rows_host[seq.row, : seq.num_cached])
            self.pool.free_row(seq.row)
        seq.row = -1
        seq.num_cached = 0
