"""Who drafts in a step, and how much: a cost model of the step against expected acceptance.

Speculation pays when the tokens a step emits per second beat plain decoding. That splits
into two things learned separately while running, so neither needs exploring the other:

- What a step costs: the wall time of recent steps by shape (batch-size bucket, and for a
  drafting step the power-of-two bucket of the tokens it verifies). This depends on the
  machine and the model, not on the text, so a shape is measured a couple of times and then
  known. Shapes not yet measured are assumed to cost what a decode step does, so each gets
  tried; a shape that turns out dear is simply not chosen again. Under the engine's overlap
  schedule a verify step also breaks the pipeline: the decode step after it cannot start
  before the host has its tokens. That restart is measured too (decode steps reported as
  `restart`), and its excess over a pipelined decode step is charged to every drafting step
  (too much when drafting steps follow each other; only the last one restarts).
- What a draft brings: per sequence, an average of the drafts it recently had accepted; a
  sequence not yet verified is credited the average over all sequences. One whose prompt was
  rolled out before drafts a little once, early, whatever the costs say (FIRST_LOOK), so that
  its own result takes over. A
  sequence whose drafts keep failing stops drafting; every PROBE_EVERY steps such sequences
  are offered again, at a modest expected value, so acceptance that returns is noticed.

Each step the candidates are ranked by expected accepted tokens per drafted token, and the
prefix of that ranking with the best expected tokens per second is drafted, or none of it
if plain decoding is expected to be faster. At most `max_verify_tokens` are verified per step.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.sequence import Sequence

EMA_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average
PRIOR_WEIGHT = 0.05  # weight of each observation in the all-sequence average (a new sequence's start)
FIRST_PRIOR = 1.0  # the all-sequence average before any draft was verified
COST_WINDOW = 5  # a shape's cost is the median of its last this many steps
MIN_OBSERVED = 2  # steps of a shape before its measured cost replaces the optimistic guess
PROBE_EVERY = 16
PROBE_VALUE = 0.5  # expected accepted tokens credited to a paused sequence on a probe step
MIN_ACCEPTED = 0.2  # accepted drafts per step below which a sequence pauses drafting
RESTART = -1  # the cost-table shape of decode steps that restart the overlap pipeline
# A sequence offered a first look (its prompt was rolled out before, so the trie holds earlier
# epochs' samples) drafts this many tokens once, early, even where the costs advise against
# it, so that its own acceptance replaces the all-sequence average, which failing sequences of
# new prompts may have pulled down far below what such a prompt gets accepted.
FIRST_LOOK = 2


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, adaptive: bool = True):
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self._accepted_ema: dict[int, float] = {}
        self._prior = FIRST_PRIOR
        self._step_s: dict[tuple[int, int], deque[float]] = {}  # step shape -> recent wall times
        self._median_s: dict[tuple[int, int], float] = {}  # their medians, computed when first asked for
        self._steps = 0
        self._first_look: set[int] = set()  # sequences offered a first look that have not had it

    def per_sequence_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_draft_tokens, self.max_verify_tokens // max(batch_size, 1) - 1))

    def for_batch(self, seqs: list[Sequence]) -> dict[int, int]:
        """Draft budgets by seq_id for this step (empty: no speculation this step)."""
        self._steps += 1
        cap = self.per_sequence_cap(len(seqs))
        if cap == 0:  # checked before the sequences are looked at: the common case at 256 sequences
            return {}
        if not self.adaptive:
            return {seq.seq_id: cap for seq in seqs}
        decode_s = self._cost(self._key(len(seqs), 0))
        if decode_s is None:
            return {}  # measure plain decoding at this batch size first
        restart_s = max(0.0, (self._cost(self._restart_key(len(seqs))) or decode_s) - decode_s)
        probing = self._steps % PROBE_EVERY == 0
        candidates = []  # (expected accepted tokens, draft budget, seq_id)
        for seq in seqs:
            accepted = self._accepted_ema.get(seq.seq_id, self._prior)
            if accepted >= MIN_ACCEPTED:
                candidates.append((accepted, min(cap, 1 + int(2 * accepted + 0.5)), seq.seq_id))
            elif probing:
                candidates.append((PROBE_VALUE, min(cap, 2), seq.seq_id))
        candidates.sort(key=lambda c: c[0] / c[1], reverse=True)
        best_rate, best_k = len(seqs) / decode_s, 0
        expected, drafts = float(len(seqs)), 0
        costs: dict[tuple[int, int], float] = {}  # a few shapes cover every prefix; look each up once
        for k, (accepted, budget, _) in enumerate(candidates, 1):
            expected += accepted
            drafts += budget
            key = self._key(len(seqs), drafts)
            if key not in costs:
                costs[key] = (self._cost(key) or decode_s) + restart_s
            rate = expected / costs[key]
            if rate > best_rate:
                best_rate, best_k = rate, k
        plan = {seq_id: budget for _, budget, seq_id in candidates[:best_k]}
        if self._first_look:  # whatever the costs say: see FIRST_LOOK
            for seq in seqs:
                if seq.seq_id in self._first_look:
                    self._first_look.discard(seq.seq_id)
                    if seq.seq_id not in self._accepted_ema:
                        plan.setdefault(seq.seq_id, min(cap, FIRST_LOOK))
        return plan

    def offer_first_look(self, seq_id: int) -> None:
        """This sequence's prompt was rolled out before: it drafts once early, whatever the costs say."""
        self._first_look.add(seq_id)

    def _key(self, num_seqs: int, num_drafts: int) -> tuple[int, int]:
        tokens = num_seqs + num_drafts
        return num_seqs.bit_length(), (tokens - 1).bit_length() if num_drafts else 0

    def _restart_key(self, num_seqs: int) -> tuple[int, int]:
        return num_seqs.bit_length(), RESTART

    def _cost(self, key: tuple[int, int]) -> float | None:
        """Median wall seconds of recent steps of this shape; None while not measured enough."""
        cost = self._median_s.get(key)
        if cost is None:
            times = self._step_s.get(key)
            if times is None or len(times) < MIN_OBSERVED:
                return None
            cost = self._median_s[key] = statistics.median(times)
        return cost

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float, restart: bool = False) -> None:
        """A decode or verify step of `num_seqs` sequences and `num_drafts` draft tokens took `seconds`;
        `restart`: a decode step that could not overlap the one before, because that one verified."""
        if seconds > 0 and num_seqs > 0:
            key = self._restart_key(num_seqs) if restart else self._key(num_seqs, num_drafts)
            self._step_s.setdefault(key, deque(maxlen=COST_WINDOW)).append(seconds)
            self._median_s.pop(key, None)

    def observe(self, seq_id: int, accepted: int) -> None:
        prev = self._accepted_ema.get(seq_id)  # a sequence's own first result replaces the prior outright
        self._accepted_ema[seq_id] = accepted if prev is None else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * accepted
        self._prior = (1 - PRIOR_WEIGHT) * self._prior + PRIOR_WEIGHT * accepted

    def forget(self, seq_id: int) -> None:
        self._accepted_ema.pop(seq_id, None)
        self._first_look.discard(seq_id)
