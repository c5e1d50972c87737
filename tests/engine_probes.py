"""Probes the engine tests attach to an engine: counting chained launches, forcing a drafting pattern."""

from __future__ import annotations

import itertools

from rollout import Engine


def count_chained(engine: Engine) -> list[int]:
    """Counts the steps launched before the step they follow was collected: [all, after a verify step]."""
    chained = [0, 0]
    launch = engine.runner.launch

    def counting(batch, trees, after=None):
        chained[0] += after is not None
        chained[1] += after is not None and bool(after.trees)
        return launch(batch, trees, after)

    engine.runner.launch = counting
    return chained


def draft_every_other_step(engine: Engine) -> None:
    """Every other step plans drafts for every sequence, so that decode steps follow verify steps."""
    turn = itertools.cycle([True, False])
    engine.budget.for_batch = lambda seqs: {s.seq_id: 4 for s in seqs} if next(turn) else {}
