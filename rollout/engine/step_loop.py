"""The step loop: schedule a batch, launch its step, complete the step before it, emit.

With the overlap schedule (on by default), a decode or verify step is left running on the device
when `step()` returns, and the next call launches the following one before it collects the earlier
one: the host's bookkeeping of one step hides under the device's work on the next. A decode or
verify step reads what it needs from the device (each sequence's last token and length, its drafts),
so steps chain whether they draft or not; a sequence that stops in the earlier step has its tokens
from the later one dropped. Prefill steps need the host's view of every token, and so do steps
whose logits are edited (rollout/engine/logits_processing.py): the pipeline drains before them.

The loop holds the requests in flight, the step left running, and what the next `step()` reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from rollout.config import EngineConfig
from rollout.engine.emit import Emitter, overflow_message
from rollout.engine.model_runner import ModelRunner
from rollout.engine.scheduler import Scheduler
from rollout.engine.sequence import Request, Sequence, Status
from rollout.engine.stats import EngineStats
from rollout.engine.step import Batch, StepInFlight, StepRecord
from rollout.engine.tensor_parallel import flush, rank0_choice
from spec.budget import StepPlan
from spec.speculator import Speculator
from spec.step import HeadWork, StepReport


class StepLoop:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, spec: Speculator,
                 counters: EngineStats, tp, tokenizer, dtype: torch.dtype, weight_version: Callable[[], int]):
        """`weight_version()`: the engine's, which each emitted token records."""
        self.config, self.scheduler, self.runner, self.spec, self.counters, self.tp = (
            config, scheduler, runner, spec, counters, tp)
        self.weight_version = weight_version
        self.emitter = Emitter(tokenizer, self.finish, overflow_message(dtype))
        self.requests: dict[str, Request] = {}
        self.reset()

    def reset(self) -> None:
        """Nothing in flight and nothing to report (the requests are the caller's to fail)."""
        self.requests.clear()
        self.updated: dict[int, Request] = {}  # reported by the next step(): aborted, or completed by a drain
        self._ended: dict[int, Request] = {}  # requests with a sequence finished since the last collect
        self.in_flight: StepInFlight | None = None  # a decode or verify step left running
        self._last_done = 0.0  # when the last step completed
        self._editing_logits = 0  # live requests whose logits are edited: their steps need the host's tokens

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or bool(self.updated)

    def admit(self, req: Request) -> None:
        self.requests[req.rid] = req
        self._editing_logits += req.edits_logits
        self.scheduler.add(req.sequences[0])

    def abort(self, req: Request) -> None:
        for seq in req.sequences:
            if not seq.finished:
                seq.forks = []
                self.finish(seq, "abort")
        self.updated[id(req)] = req

    def finish(self, seq: Sequence, reason: str, message: str | None = None) -> None:
        seq.finish_reason = reason
        seq.finish_message = message
        seq.finished_at = time.perf_counter()
        self._ended[id(seq.request)] = seq.request
        self.scheduler.finish(seq)

    # ---------------- a step ----------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that progressed (check `.finished`)."""
        updated, self.updated = self.updated, {}
        began = time.perf_counter()
        prev, self.in_flight = self.in_flight, None
        batch = self.scheduler.schedule()
        chain = (prev is not None and batch is not None and not batch.is_prefill and self.config.overlap_schedule
                 and not self._editing_logits)
        if chain:
            launched = self._launch(batch, began, after=prev)
            self._complete(prev, updated)
            if all(seq.finished for seq in batch.seqs):  # nothing left to wait for
                self._complete(launched, updated)
            else:
                self.in_flight = launched
        else:
            if prev is not None:
                self._complete(prev, updated)
                batch = _without_finished(batch)
            if batch is not None:
                launched = self._launch(batch, began)
                if self.config.overlap_schedule and launched.chainable and not self._editing_logits:
                    self.in_flight = launched
                else:
                    self._complete(launched, updated)
        self.counters.busy_s += time.perf_counter() - began
        return self.collect(updated)

    def drain(self) -> list[Request]:
        """Complete the step in flight, if any, so that nothing runs until the next `step()`;
        returns what `step()` would."""
        self.complete_in_flight()
        updated, self.updated = self.updated, {}
        return self.collect(updated)

    def complete_in_flight(self) -> None:
        """As drain(), keeping the progressed requests for the next step() to report."""
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            self._complete(step, self.updated)

    def collect(self, updated: dict) -> list[Request]:
        ended, self._ended = self._ended, {}
        for req in ended.values():  # (only these can have finished: asking every updated request costs)
            if req.finished and self.requests.get(req.rid) is req:
                del self.requests[req.rid]
                self._editing_logits -= req.edits_logits
                if self.tp is not None and self.tp.rank > 0:  # (rank 0 hands it out; here nothing reads it again)
                    req.detach()
        return list(updated.values())

    def _launch(self, batch: Batch, began: float, after: StepInFlight | None = None) -> StepInFlight:
        """Launch `batch`'s step; `after`: the step it follows, still in flight."""
        if batch.is_prefill:
            slots, positions, starts = self.scheduler.place_prefill(batch)
            (head,) = rank0_choice(self.tp, "prefill_head",  # (the head's cycle decides)
                                   lambda: (int(self.spec.head_for_prefill(bool((starts == 0).any()))),))
            flush(self.tp)
            step = self.runner.launch_prefill(batch, slots, positions, starts, bool(head))
        else:
            plan = self._plan(len(batch.seqs))
            self.spec.before_decode(plan.drafting)
            self.counters.draft_steps += plan.draft_rows > 0
            slots = self.scheduler.step_slots(len(batch.seqs) + plan.draft_rows)
            flush(self.tp)
            step = self.runner.launch_decode(batch, slots, plan.draft_rows, plan.drafting, plan.head, plan.shadow, after)
        step.began = began
        return step

    def _plan(self, num_seqs: int) -> StepPlan:
        """The decode step's plan (the speculation budget's)."""
        def decide() -> tuple:
            plan = self.spec.plan(num_seqs, self.scheduler.free_slots, draining=not self.scheduler.waiting)
            return plan.draft_rows, plan.drafting, plan.shadow, int(plan.head)

        draft_rows, drafting, shadow, head = rank0_choice(self.tp, "plan", decide)
        return StepPlan(draft_rows, drafting, shadow, HeadWork(head))

    def _complete(self, step: StepInFlight, updated: dict) -> None:
        """Wait for a launched step, apply what it emitted, and tell speculation what it cost."""
        seqs = step.batch.seqs
        roots = np.fromiter((len(q.tokens) for q in seqs), np.int64, len(seqs)) if step.shadow else None
        emitted = self.runner.collect(step)
        if step.accepted is not None:
            self.scheduler.settle_step(step.batch, step.rows, step.slots, step.first_row, step.accepted)
        if step.batch.is_prefill:
            for item in step.batch.items:  # (a decode item may be waiting too: preempted while this step ran)
                if item.samples and not item.decode and item.seq.status is Status.WAITING:
                    for seq in [item.seq, *item.seq.forks]:
                        self.spec.join(seq)
                    self.scheduler.on_prefill_done(item.seq)
        appended, by_source = self.emitter.append(emitted, updated, self.weight_version(), self.counters.spec)
        self.counters.output_tokens += appended
        cost = self._record(step)
        if not step.batch.is_prefill:
            report = StepReport(by_source, emitted.index_misses, emitted.coupled, step.head, appended)
            self.spec.observe(seqs, roots, step.trees, step.draft_rows, cost, report)

    def _record(self, step: StepInFlight) -> float:
        """The step into the counters' log (the wall time it added: from its start, or from when the
        step before it completed if they overlapped); returns its cost for the speculation budget."""
        done = time.perf_counter()
        wall = done - max(step.began, self._last_done)
        self._last_done = done
        prefill = step.batch.is_prefill
        device_s = 0.0 if prefill else step.result.device_seconds()
        self.counters.step_log.append(StepRecord(len(step.batch.seqs), step.draft_rows, step.drafting, prefill, wall * 1e3,
                                                 device_s * 1e3, (wall - step.result.waited) * 1e3, step.began))
        self.counters.steps += 1
        if prefill:
            return wall
        if step.result.synchronous:
            # the CPU: a step runs at its launch, which comes before the step ahead of it completes, so
            # the wall time between two completions is the next step's; a verify step's own cost was
            # counted to the plain step before it, which made drafting look free
            return device_s
        # at least its device time: a step completed right after the one before it, nothing launched
        # between (a rollout's last), adds little wall time, and the budget prices plain decoding at
        # a bucket's least cost
        return max(wall, device_s)


def _without_finished(batch: Batch | None) -> Batch | None:
    """A batch scheduled before the step in flight completed, less the sequences that stopped in it."""
    if batch is None:
        return None
    if batch.is_prefill:
        items = [item for item in batch.items if not item.seq.finished]
        return Batch.prefill(items) if items else None
    if not any(seq.finished for seq in batch.seqs):
        return batch
    seqs = [seq for seq in batch.seqs if not seq.finished]
    return Batch(seqs) if seqs else None

