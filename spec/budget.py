"""How many drafts each step verifies: measured costs against measured acceptance.

A step verifies the batch's best `C` drafts (its draft rows; C = 0: plain decoding), chosen on
the device by key across all sequences (kernels/draft_rows.py). The capacities a step of batch
bucket b may take are fixed fractions of the bucket (`FRACTIONS` draft rows per sequence, the
steps' CUDA graphs are captured for them), within `max_verify_tokens` rows in all and as many
free KV slots. Each step takes the capacity with the most tokens per second,
S (1 + acc(C)) / cost(b, C).

- acc(C), the drafts accepted per sequence, is read off the drafter's whole trees, which come
  back every SHADOW_EVERY steps whether the step drafts or not (drafting runs on the device;
  while no draft pays, the interval doubles at each return up to SHADOW_MOST, since copying the
  trees back and scoring them is host work that grows with the batch: at b512 T=1.0 it cost
  n-gram 0.93x of spec off, 0.99x with the backoff): once the tree's sequence has emitted the
  tokens after its root, the speculator replays the device's choice of the best C drafts for
  every fraction and counts how deep each sequence's chosen nodes match what it emitted
  (spec/speculator.py). Under counter-based sampling a draft is accepted exactly when it equals
  the token the sequence emits anyway, so this is what verification would find, without
  verifying anything. A step that does verify drafts measures acc at its own fraction, and that
  counts as an evaluation of it (`observe_verified`): with the trees back every 64 steps, a
  bucket that drafted on estimates learnt at another temperature went on for a rollout (grpo b512
  at T=1.0 after T=0.7: 10-49 drafting steps a rollout, 0-2 alone).
  Evaluations are averaged with decaying weights, per bucket: a fraction means different
  drafts at different batch sizes (1/8 of a draft per sequence at 512 sequences, a whole one
  for each of 2), and one estimate for all had the tail's acceptance of 0.48 drafts per
  sequence priced into 64 rows at 512 sequences, which can confirm 0.125 at most. A bucket
  not yet evaluated borrows the nearest one's estimate, capped at the drafts each fraction
  gives a sequence there.
- While nothing waits to be admitted (a rollout's whole batch is running, as in RL), a step
  that speeds some sequences up does not end the batch sooner: it ends with its slowest
  sequences. Then acc(C) is at most the drafts the slowest tenth of the running sequences
  have accepted (`slowest`): each sequence keeps its own rate, moved by each evaluation of its
  trees. With one estimate for all, the rl workload at T=1.0 (every sample runs to the length
  limit, drafts accepted for a few repetitive ones) drafted on over a third of its steps, raising
  tokens per second while saving 16 of 2,050 steps (commit f143e0d).
- cost(b, C) is a step's period: the wall time from one step's completion to the next's.
  Steps overlap the host's work, so the period is whichever of the device and the host is
  slower, as measured, with nothing modelled (a model of the two apart priced drafting as free
  on the host where the host had been slow for other reasons: bench/results/spec-8a4b12b/
  rl-budget.log); a period is at least the step's device time (a rollout's last step completes
  right after the one before it), and on the CPU, where a step runs at its launch, ahead of the
  previous step's completion, a step's cost is its own launch's time (rollout/engine/step_loop.py
  `_record`). Other work lands on some periods (admissions and the joins after a prefill,
  the collector, the caller between steps) and only ever adds, so a plain step costs the least
  of its bucket's last COST_WINDOW periods; while drafting, every REFRESH_EVERY-th step decodes
  plainly, so that least follows the contexts as they grow. What drafting adds at (b, C) is
  the median, over its last few steps there, of each step's period less the plain cost then,
  once it has MEASURED_AFTER of them. Before that, a line a + r C through what the last
  drafting steps of any bucket added: a fixed part (drafting, laying out the rows: 0.15 ms of a
  3.4-ms step at 128 sequences on an H100) and a part per row (with one number of rows seen, r
  alone); until a drafting step was measured, a row is taken to cost a tenth of a plain step's
  time per sequence. The line is only a first guess: what a row adds depends on the bucket (the
  host's work per sequence, attention over longer contexts in the tail), and a guess too low
  is corrected after MEASURED_AFTER steps at (b, C), while one too high only keeps the budget
  from a choice that would not have paid by much.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from spec.step import HeadWork, bucket

SHADOW_EVERY = 8  # steps between the trees that come back for the acceptance statistics
SHADOW_MOST = 64  # ... at most, while no draft pays
COST_WINDOW = 5  # periods kept per bucket (plain) and per (bucket, draft rows)
LINE_WINDOW = 32  # the line is fitted to the last this many drafting steps, of any bucket
REFRESH_EVERY = 16  # while drafting, one plain step in this many keeps the plain cost current
MEASURED_AFTER = 3  # steps at a (bucket, draft rows) after which their own costs replace the fitted line
ACCEPT_WEIGHT = 0.3  # how much one evaluation of trees moves acc
SEQ_WEIGHT = 0.1  # how much one evaluation moves a sequence's own rate (its trees are scored every 8-32 steps)
SLOWEST = 0.1  # the share of running sequences whose rate bounds acc while the batch drains
PRIOR_ROW_SHARE = 0.1  # a draft row's cost until one is measured, as a share of a plain step's per sequence
FRACTIONS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # draft rows per sequence a step may take


@dataclass(frozen=True)
class StepPlan:
    draft_rows: int  # drafts verified at most (0: plain decoding)
    drafting: bool  # the drafter runs (draft rows, or for the statistics only)
    shadow: bool  # its whole trees come back to the host
    head: HeadWork = HeadWork.NONE  # what a draft head does in the step (spec/head_drafter.py)


def rows_at(fraction: float, num_seqs: int, depth: int) -> int:
    """The draft rows of `fraction` per sequence for `num_seqs` sequences: at least one, at most
    every draft of every tree."""
    return min(math.ceil(fraction * num_seqs), num_seqs * depth)


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, max_rows: int, adaptive: bool = True):
        self.depth = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self.acc: dict[int, np.ndarray] = {}  # bucket -> accepted drafts per sequence, by fraction
        self.last_evaluated: int | None = None  # the bucket of the last evaluation (for stats)
        self._seq_acc = np.full((max_rows, len(FRACTIONS)), np.nan)  # by KV row: its running sequence's rate
        self.slowest: np.ndarray | None = None  # the (lower) SLOWEST quantile of the rates, by fraction, as of the last evaluation
        self._plain: dict[int, deque] = {}  # bucket -> periods of its last plain steps
        self._added: dict[tuple[int, int], deque] = {}  # (bucket, draft rows) -> what its last steps added
        # (draft rows, added) of the last drafting steps: the line's points (it is refitted after
        # every drafting step; over every (bucket, rows) kept above, late in a run, that would
        # walk hundreds of samples a step)
        self._recent = deque(maxlen=LINE_WINDOW)
        self._line: tuple[float, float] | None = None  # _fit of _recent, until the next drafting step is measured
        self._levels: dict[int, list[tuple[int, int]]] = {}
        self._drafting: dict[int, int] = {}  # bucket -> drafting steps since its last plain one
        self._shadow_every = SHADOW_EVERY
        self._since_shadow = 0

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

    def plan(self, num_seqs: int, free_slots: int, draining: bool = False, sure: float = 0.0) -> StepPlan:
        """`draining`: nothing waits to be admitted, so the batch ends with its slowest sequences.
        `sure`: drafts the batch holds that will be accepted with little doubt (coupled chains),
        ranked above the rest: whatever the estimates, a step of C rows accepts min(C, sure) of them."""
        self._since_shadow += 1
        shadow = self._since_shadow >= self._shadow_every
        if shadow:
            self._since_shadow = 0
        b = bucket(num_seqs)
        fits = [(i, c) for i, c in self._levels_of(b) if num_seqs + c <= free_slots]
        c = 0
        if fits and not self.adaptive:
            c = fits[-1][1]
        elif fits and (plain := self._plain_cost(b)) is not None:  # (a bucket's first steps measure plain decoding)
            a, r = self._fitted_line() or (0.0, PRIOR_ROW_SHARE * plain / b)
            acc = self.accepted_at(b)
            if draining and self.slowest is not None:
                acc = np.minimum(acc, self.slowest)
            if sure:
                acc = np.maximum(acc, [min(rows_at(f, b, self.depth), sure) / num_seqs for f in FRACTIONS])

            def value(i: int, c: int) -> float:  # tokens per second, per sequence
                seen = self._added.get((b, c), ())
                added = statistics.median(seen) if len(seen) >= MEASURED_AFTER else a + r * c
                return (1 + acc[i]) / (plain + added)

            best = max(fits, key=lambda ic: value(*ic))
            if value(*best) > 1 / plain:
                c = best[1]
        if c:
            self._shadow_every = SHADOW_EVERY
        elif shadow:
            self._shadow_every = min(2 * self._shadow_every, SHADOW_MOST)
        if c and self.adaptive:
            self._drafting[b] = self._drafting.get(b, 0) + 1
            if self._drafting[b] >= REFRESH_EVERY:
                c, self._drafting[b] = 0, 0
        return StepPlan(c, c > 0 or shadow, shadow)

    def fewest_rows(self, num_seqs: int, free_slots: int) -> int:
        """The fewest draft rows a step of `num_seqs` sequences may verify (0: none fits)."""
        fits = [c for _, c in self._levels_of(bucket(num_seqs)) if num_seqs + c <= free_slots]
        return min(fits, default=0)

    def shadow_often(self) -> None:
        """Trees back every SHADOW_EVERY steps from now on, until no draft pays again (a woken draft
        head's choices wait for its first evaluations: spec/head_watch.py INFORMED_AFTER)."""
        self._shadow_every = SHADOW_EVERY

    @property
    def shadow_next(self) -> bool:
        """The next step's trees come back (as `plan` will say)."""
        return self._since_shadow + 1 >= self._shadow_every

    def observe_step(self, num_seqs: int, rows: int, seconds: float) -> None:
        """A decode or verify step of `num_seqs` sequences and `rows` draft rows took `seconds`
        (its period)."""
        b = bucket(num_seqs)
        if rows == 0:
            self._plain.setdefault(b, deque(maxlen=COST_WINDOW)).append(seconds)
        elif (plain := self._plain_cost(b)) is not None:
            self._added.setdefault((b, rows), deque(maxlen=COST_WINDOW)).append(seconds - plain)
            self._recent.append((rows, seconds - plain))
            self._line = None

    def _plain_cost(self, b: int) -> float | None:
        periods = self._plain.get(b)
        return min(periods) if periods else None

    def _fitted_line(self) -> tuple[float, float] | None:
        """What drafting adds, (a, r) of `_fit`, or None before a drafting step was measured;
        refitted only after one was."""
        if self._recent and self._line is None:
            self._line = _fit(self._recent)
        return self._line

    def accepted_at(self, b: int) -> np.ndarray:
        """acc by fraction at bucket b: its own evaluations', else the nearest evaluated bucket's,
        at most the drafts each fraction gives a sequence at b (zeros before any evaluation)."""
        if b in self.acc:
            return self.acc[b]
        if not self.acc:
            return np.zeros(len(FRACTIONS))
        near = min(self.acc, key=lambda k: abs(math.log(k / b)))
        share = np.array([rows_at(f, b, self.depth) / b for f in FRACTIONS])
        return np.minimum(self.acc[near], share)

    def observe_acceptance(self, num_seqs: int, accepted: np.ndarray, rows: np.ndarray) -> None:
        """accepted [P, fractions]: the drafts sequences of a step of `num_seqs` would have had
        accepted at each fraction; rows [P]: their KV rows (-1: no longer running)."""
        if len(accepted):
            b = bucket(num_seqs)
            acc = self._own_estimate(b)
            acc += ACCEPT_WEIGHT * (accepted.mean(axis=0) - acc)
            self.last_evaluated = b
            live = rows >= 0
            rows, accepted = rows[live], accepted[live]
            rate = self._seq_acc[rows]
            rate = np.where(np.isnan(rate), self.acc[b], rate)  # a sequence's first evaluation moves from its bucket's
            self._seq_acc[rows] = rate + SEQ_WEIGHT * (accepted - rate)
            known = self._seq_acc[~np.isnan(self._seq_acc[:, 0])]
            k = int(SLOWEST * (len(known) - 1))  # (the lower SLOWEST quantile, by partition: np.quantile costs 5x)
            self.slowest = np.partition(known, k, axis=0)[k] if len(known) else None

    def observe_verified(self, num_seqs: int, rows: int, accepted: int) -> None:
        """A step of `num_seqs` sequences verified `rows` drafts of the index and `accepted` of them
        were: what acc says of the fraction that gives those rows, measured (a step that drafts on
        estimates learnt elsewhere, at another temperature or bucket, corrects them at once; trees
        come back only every SHADOW_EVERY to SHADOW_MOST steps)."""
        b = bucket(num_seqs)
        i = next((i for i, c in self._levels_of(b) if c == rows), None)
        if i is not None:
            acc = self._own_estimate(b)
            acc[i] += ACCEPT_WEIGHT * (accepted / num_seqs - acc[i])

    def _own_estimate(self, b: int) -> np.ndarray:
        """Bucket b's estimate, to be moved in place: from the borrowed one (`accepted_at`) at its first evaluation."""
        if b not in self.acc:
            self.acc[b] = self.accepted_at(b).copy()
        return self.acc[b]

    def forget(self, row: int) -> None:
        """The sequence in KV row `row` stopped running."""
        self._seq_acc[row] = np.nan

    def costs(self) -> dict[str, float]:
        """Milliseconds (for stats and benchmarks): plain steps by bucket, and what drafting adds."""
        out = {f"b{b}_plain": 1e3 * min(v) for b, v in self._plain.items() if v}
        if (line := self._fitted_line()) is not None:
            out["draft_fixed"], out["draft_row"] = 1e3 * line[0], 1e3 * line[1]
        return out


def _fit(added: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, r) >= 0 such that a drafting step of C rows adds a + r C, from (rows, added) points, at
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
