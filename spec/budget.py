"""How many drafts each step verifies: measured costs against measured acceptance.

A step verifies the batch's best `C` drafts (its draft rows; C = 0: plain decoding), chosen on
the device by key across all sequences (kernels/draft_rows.py). The capacities a step of batch
bucket b may take are fixed fractions of the bucket (`FRACTIONS` draft rows per sequence, the
steps' CUDA graphs are captured for them), within `max_verify_tokens` rows in all and as many
free KV slots. Each step takes the capacity with the most tokens per second,
S (1 + acc(C)) / cost(b, C).

- acc(C), the drafts accepted per sequence, is read off the drafter's whole trees, which come
  back every SHADOW_EVERY steps whether the step drafts or not (drafting runs on the device and
  costs the host nothing): once the tree's sequence has emitted the tokens after its root, the
  speculator replays the device's choice of the best C drafts for every fraction and counts how
  deep each sequence's chosen nodes match what it emitted (spec/speculator.py). Under
  counter-based sampling a draft is accepted exactly when it equals the token the sequence
  emits anyway, so this is what verification would find, without verifying anything.
  Evaluations are averaged with decaying weights.
- cost(b, C): steps overlap the host's work, so a step costs the larger of its device time and
  the host's time per step, each a plain step's (the median of its last few at this bucket)
  plus what drafting adds. What it adds at (b, C) is the median of its own last few steps
  there, once it has MEASURED_AFTER. Before that, a line a + r C: a fixed part (drafting,
  laying out the rows: 0.15 ms of a 3.4-ms step at 128 sequences on an H100) and a part per
  row, one pair for the device and one for the host, fitted to the last drafting steps of any
  bucket (a line through the median added at each number of rows seen; with one number seen,
  r alone); until a drafting step was measured, a row is taken to cost a tenth of a plain
  step's time per sequence. The line is only a first guess: what a row adds depends on the
  bucket (the host's work per sequence, attention over longer contexts in the tail), and a
  guess too low is corrected after MEASURED_AFTER steps at (b, C), while one too high only
  keeps the budget from a choice that would not have paid by much. While drafting, every
  REFRESH_EVERY-th step decodes plainly, so the plain costs follow the contexts as they grow.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from rollout.engine.step import bucket

SHADOW_EVERY = 8  # steps between the trees that come back for the acceptance statistics
COST_WINDOW = 5  # plain costs are medians of the last this many steps
DRAFT_WINDOW = 32  # what drafting adds is fitted to the last this many drafting steps
REFRESH_EVERY = 16  # while drafting, one plain step in this many keeps the plain cost current
MEASURED_AFTER = 3  # steps at a (bucket, draft rows) after which their own costs replace the fitted line
ACCEPT_WEIGHT = 0.3  # how much one evaluation of trees moves acc
PRIOR_ROW_SHARE = 0.1  # a draft row's cost until one is measured, as a share of a plain step's per sequence
FRACTIONS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # draft rows per sequence a step may take


@dataclass(frozen=True)
class StepPlan:
    draft_rows: int  # drafts verified at most (0: plain decoding)
    drafting: bool  # the drafter runs (draft rows, or for the statistics only)
    shadow: bool  # its whole trees come back to the host


def rows_at(fraction: float, num_seqs: int, depth: int) -> int:
    """The draft rows of `fraction` per sequence for `num_seqs` sequences: at least one, at most
    every draft of every tree."""
    return min(math.ceil(fraction * num_seqs), num_seqs * depth)


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, adaptive: bool = True):
        self.depth = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self.acc = np.zeros(len(FRACTIONS))  # accepted drafts per sequence, by fraction
        self._plain: dict[int, deque] = {}  # bucket -> recent device times of plain steps
        self._plain_host: dict[int, deque] = {}  # bucket -> recent host times of plain steps
        self._added = deque(maxlen=DRAFT_WINDOW)  # (draft rows, device time added) of recent drafting steps
        self._added_host = deque(maxlen=DRAFT_WINDOW)  # (draft rows, host time added)
        self._fits: tuple | None = None  # _fit of both, until the next drafting step is measured (_added_cost)
        self._added_at: dict[tuple[int, int], deque] = {}  # (bucket, draft rows) -> recent (device, host) time added
        self._levels: dict[int, list[tuple[int, int]]] = {}
        self._drafting: dict[int, int] = {}  # bucket -> drafting steps since its last plain one
        self._steps = 0

    def capacities(self, b: int) -> list[int]:
        """The draft rows a step of bucket b may verify, 0 included (its CUDA graphs' shapes)."""
        return [0] + [c for _, c in self._levels_of(b)]

    def _levels_of(self, b: int) -> list[tuple[int, int]]:
        """(fraction index, draft rows) for bucket b: distinct rows, each with the largest fraction
        that gives them (that is what a step of b sequences gets per sequence)."""
        if b not in self._levels:
            rows: dict[int, int] = {}
            for i, f in enumerate(FRACTIONS):
                c = rows_at(f, b, self.depth)
                if c and b + c <= self.max_verify_tokens:
                    rows[c] = i
            self._levels[b] = sorted((i, c) for c, i in rows.items())
        return self._levels[b]

    def plan(self, num_seqs: int, free_slots: int) -> StepPlan:
        self._steps += 1
        shadow = self._steps % SHADOW_EVERY == 0
        b = bucket(num_seqs)
        fits = [(i, c) for i, c in self._levels_of(b) if num_seqs + c <= free_slots]
        c = 0
        if fits and not self.adaptive:
            c = fits[-1][1]
        elif fits and (plain := _median(self._plain.get(b))) is not None:  # (a bucket's first steps measure plain decoding)
            host = _median(self._plain_host.get(b)) or 0.0
            line = self._added_cost() or ((0.0, PRIOR_ROW_SHARE * plain / b),) * 2

            def value(i: int, c: int) -> float:  # tokens per second, per sequence
                seen = self._added_at.get((b, c), ())
                if len(seen) >= MEASURED_AFTER:
                    added, added_host = (statistics.median(t) for t in zip(*seen))
                else:
                    (a, r), (a_host, r_host) = line
                    added, added_host = a + r * c, a_host + r_host * c
                return (1 + self.acc[i]) / max(plain + added, host + added_host)

            best = max(fits, key=lambda ic: value(*ic))
            if value(*best) > 1 / max(plain, host):
                c = best[1]
        if c and self.adaptive:
            self._drafting[b] = self._drafting.get(b, 0) + 1
            if self._drafting[b] >= REFRESH_EVERY:
                c, self._drafting[b] = 0, 0
        return StepPlan(c, c > 0 or shadow, shadow)

    def observe_step(self, num_seqs: int, rows: int, device_s: float, host_s: float) -> None:
        b = bucket(num_seqs)
        if rows == 0:
            self._plain.setdefault(b, deque(maxlen=COST_WINDOW)).append(device_s)
            self._plain_host.setdefault(b, deque(maxlen=COST_WINDOW)).append(host_s)
            return
        plain, host = _median(self._plain.get(b)), _median(self._plain_host.get(b))
        if plain is not None:
            self._added.append((rows, device_s - plain))
            self._added_host.append((rows, host_s - host))
            self._added_at.setdefault((b, rows), deque(maxlen=COST_WINDOW)).append((device_s - plain, host_s - host))
            self._fits = None

    def _added_cost(self) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """What drafting adds, (a, r) for the device and for the host (`_fit`), or None before a
        drafting step was measured; refitted only after one was."""
        if self._added and self._fits is None:
            self._fits = (_fit(self._added), _fit(self._added_host))
        return self._fits

    def observe_acceptance(self, accepted: np.ndarray) -> None:
        """accepted [S, fractions]: the drafts each sequence would have had accepted at each fraction."""
        if len(accepted):
            self.acc += ACCEPT_WEIGHT * (accepted.mean(axis=0) - self.acc)

    def costs(self) -> dict[str, float]:
        """Milliseconds (for stats and benchmarks): plain steps by bucket, and what drafting adds."""
        out = {f"b{b}_plain": 1e3 * _median(v) for b, v in self._plain.items() if v}
        out.update({f"b{b}_plain_host": 1e3 * _median(v) for b, v in self._plain_host.items() if v})
        if (added := self._added_cost()) is not None:
            for name, (a, r) in zip(("", "_host"), added):
                out[f"draft_fixed{name}"], out[f"draft_row{name}"] = 1e3 * a, 1e3 * r
        return out


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def _fit(added) -> tuple[float, float]:
    """(a, r) >= 0 such that a drafting step of C rows adds a + r C, from (rows, added) samples, at
    least one: a line through the median added at each number of rows (medians: one slow step
    moves nothing); with a single number of rows, a = 0."""
    by_rows: dict[int, list[float]] = {}
    for c, t in added:
        by_rows.setdefault(c, []).append(t)
    c = np.array(list(by_rows), dtype=np.float64)
    t = np.array([statistics.median(v) for v in by_rows.values()])
    if len(c) == 1:
        return 0.0, max(float(t[0] / c[0]), 0.0)
    r, a = np.polyfit(c, t, 1)
    if a < 0:  # through the origin
        return 0.0, max(float(c @ t / (c @ c)), 0.0)
    if r < 0:
        return max(float(np.median(t)), 0.0), 0.0
    return float(a), float(r)
