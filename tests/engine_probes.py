"""Probes the engine tests attach to an engine: counting chained launches, forcing a drafting pattern."""

from __future__ import annotations

import itertools

from rollout import Engine
from spec.budget import StepPlan
from spec.step import HeadWork


def count_chained(engine: Engine) -> list[int]:
    """Counts the decode and verify steps launched before the step they follow was collected:
    [all, after a verify step]."""
    chained, outstanding = [0, 0], []
    launch, collect = engine.runner.launch_decode, engine.runner.collect

    def launching(batch, slots, draft_rows, drafting, head=HeadWork.NONE, shadow=False, after=None):
        if outstanding:
            chained[0] += 1
            chained[1] += outstanding[-1].draft_rows > 0
        step = launch(batch, slots, draft_rows, drafting, head, shadow, after)
        outstanding.append(step)
        return step

    def collecting(step):
        if step in outstanding:
            outstanding.remove(step)
        return collect(step)

    engine.runner.launch_decode = launching
    engine.runner.collect = collecting
    return chained


def draft_every_other_step(engine: Engine, per_seq: int = 4) -> None:
    """Every other step verifies `per_seq` draft rows per sequence, so that decode steps follow verify steps."""
    turn = itertools.cycle([True, False])
    engine.spec.plan = lambda num_seqs, free_slots, draining: (
        StepPlan(per_seq * num_seqs, True, False) if next(turn) and num_seqs * (per_seq + 1) <= free_slots
        else StepPlan(0, False, False)
    )


def attention_slack(engine: Engine) -> list[int]:
    """For each plain decode step's attention plan (one query row a sequence): how many keys its
    bound `max_kv_len` allows past the longest sequence (the CPU's reference attention pads every
    row to the bound)."""
    slack, plan = [], engine.runner.backend.plan

    def planning(meta):
        if meta.max_q_len == 1 and meta.num_seqs:
            slack.append(meta.max_kv_len - int(meta.kv_lens.max()))
        return plan(meta)

    engine.runner.backend.plan = planning
    return slack
