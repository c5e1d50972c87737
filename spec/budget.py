"""Who drafts in a step, and how much: a cost model of the step against expected acceptance.

Speculation pays when the tokens a step emits per second beat plain decoding. That splits
into two things learned separately while running, so neither needs exploring the other:

- What a step costs: the wall time of recent steps by shape (batch-size bucket, and for a
  drafting step the power-of-two bucket of the tokens it verifies). This depends on the
  machine and the model, not on the text, so a shape is measured a couple of times and then
  known. Shapes not yet measured are assumed to cost what a decode step does, so each gets
  tried; a shape that turns out dear is simply not chosen again. Under the engine's overlap
  schedule a verify step drains the pipeline before it (drafting needs the last tokens), so
  its measured cost includes the host's drafting and layout, which no device work hides.
- What a draft token brings: the chance that verification gets that far. Per sequence, the
  drafter's tokens are taken to be accepted one after the other with a probability `a`
  (estimated from decaying counts of accepted and rejected draft tokens), so its j-th draft
  token is worth a**j accepted tokens. A sequence starts from the counts of all sequences.
  Acceptance comes in runs (a sample that loops, code that repeats its prompt): a sequence
  that drafted well drafts deep, and the cost of a deep draft, which at small batch is that
  of a shallow one, is measured rather than assumed.

Each step the draft tokens of all sequences are ranked by value, and the prefix of that
ranking with the best expected tokens per second is drafted (the prefix holds the first
tokens of each sequence, as values fall with depth), or none of it if plain decoding is
expected to be faster. A sequence whose drafts keep failing is thereby paused; on a probe
step every sequence is valued at no less than PROBE_ACCEPT, so acceptance that returns is
noticed, where the step costs let a draft worth that much pay (where verify steps are dear,
e.g. batch 1 on an H100, they do not, and a paused sequence stays paused). Probes come every
PROBE_EVERY steps, but a probe drains the overlap pipeline and verifies a wider step (at 64
sequences on an H100, 3-4 ms against a 1.2 ms decode step), so where drafting steps keep
falling short of plain decoding the interval doubles per batch-size bucket, up to
MAX_PROBE_EVERY, and one drafting step that beats plain decoding brings it back. One
whose prompt was rolled out before drafts a little once, early, whatever the costs say
(FIRST_LOOK), so that its own result takes over. At most `max_verify_tokens` are verified
per step.

Planning costs ~0.08 ms of host time per step at 64-128 sequences on an H100 host, 5-8% of
a step, so a plan that drafts nothing stands while what it was made from stays: until a
verify step is observed (acceptance or cost), a first look is waiting, the batch grows or
leaves its batch-size bucket, or a probe step comes. Meanwhile the decode cost moves a
little and sequences finish, which rarely turns a plan of nothing into a plan of something;
the next probe re-plans with both.

The model can be wrong where it cannot see: step costs are medians, so rare long steps
escape them; a trie that fell behind the text (spec/upkeep.py) drafts worse than its
sequences' past acceptance says; a plan the drafter had nothing for costs a drained pipeline
and brings nothing. So each drafting step's realized tokens per second are compared with
what its plan predicted, and per batch-size bucket the decaying ratio scales the prediction
before it is weighed against plain decoding: a bucket whose drafting steps keep falling
short stops drafting but for probes, which measure it again.
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import accumulate
from operator import itemgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.sequence import Sequence

EMA_WEIGHT = 0.3  # how much a sequence's newest verify step moves its counts
PRIOR_WEIGHT = 0.05  # how much each verify step moves the all-sequence counts (a new sequence's start)
FIRST_PRIOR = (1.0, 1.0)  # (accepted, rejected) counts before any draft was verified: a = 0.5
COST_WINDOW = 5  # a shape's cost is the median of its last this many steps
MIN_OBSERVED = 2  # steps of a shape before its measured cost replaces the optimistic guess
PROBE_EVERY = 16  # steps between probes while drafting at a batch size pays off (powers of two)
MAX_PROBE_EVERY = 256  # ... and the longest interval, after drafting steps that did not
PROBE_ACCEPT = 0.5  # on a probe step, every sequence's per-token acceptance is taken as at least this
MIN_VALUE = 0.02  # draft tokens worth fewer expected accepted tokens are never ranked
# A sequence offered a first look (its prompt was rolled out before, so the trie holds earlier
# epochs' samples) drafts this many tokens once, early, even where the costs advise against
# it, so that its own acceptance replaces the all-sequence counts, which failing sequences of
# new prompts may have pulled down far below what such a prompt gets accepted.
FIRST_LOOK = 2
REALIZED_WEIGHT = 0.25  # how much a drafting step moves its batch-size bucket's calibration


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, adaptive: bool = True):
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self._counts: dict[int, tuple[float, float]] = {}  # seq_id -> decaying (accepted, rejected) draft tokens
        self._prior = FIRST_PRIOR
        self._step_s: dict[tuple[int, int], deque[float]] = {}  # step shape -> recent wall times
        self._median_s: dict[tuple[int, int], float] = {}  # their medians, computed when first asked for
        self._steps = 0
        self._first_look: set[int] = set()  # sequences offered a first look that have not had it
        # batch-size bucket -> realized over predicted tokens/s of its drafting steps (decaying)
        self._calibration: dict[int, float] = {}
        self._probe_every: dict[int, int] = {}  # batch-size bucket -> steps between its probes
        self.predicted_rate: float | None = None  # tokens/s the last plan was expected to emit at
        self._nothing_planned_for = 0  # batch size of the last plan while it drafts nothing and stands

    def per_sequence_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_draft_tokens, self.max_verify_tokens // max(batch_size, 1) - 1))

    def accept_chance(self, seq_id: int) -> float:
        """The estimated chance that verification accepts the sequence's next draft token."""
        accepted, rejected = self._counts.get(seq_id, self._prior)
        return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.0

    def for_batch(self, seqs: list[Sequence]) -> dict[int, int]:
        """Draft budgets by seq_id for this step (empty: no speculation this step). Sets
        `predicted_rate` for `observe_drafting` (None where the plan is not the cost model's)."""
        self._steps += 1
        self.predicted_rate = None
        cap = self.per_sequence_cap(len(seqs))
        if cap == 0:  # checked before the sequences are looked at: the common case at 256 sequences
            return {}
        if not self.adaptive:
            return {seq.seq_id: cap for seq in seqs}
        n, standing = len(seqs), self._nothing_planned_for
        stands = n <= standing and n.bit_length() == standing.bit_length() and not self._first_look
        if stands and not self._probes(n):
            return {}  # the plan that drafts nothing stands (see the module docstring)
        decode_s = self._cost(self._key(n, 0))  # (a median, recomputed after every decode step)
        if decode_s is None:
            return {}  # measure plain decoding at this batch size first
        plan = self._best_plan(seqs, cap, decode_s)
        self._nothing_planned_for = 0 if plan else n
        if self._first_look:  # whatever the costs say: see FIRST_LOOK
            for seq in seqs:
                if seq.seq_id in self._first_look:
                    self._first_look.discard(seq.seq_id)
                    if seq.seq_id not in self._counts:
                        plan.setdefault(seq.seq_id, min(cap, FIRST_LOOK))
        return plan

    def _best_plan(self, seqs: list[Sequence], cap: int, decode_s: float) -> dict[int, int]:
        probe = self._probes(len(seqs))
        floor = PROBE_ACCEPT if probe else 0.0
        ranked = []  # (value ranked by, expected accepted tokens, seq_id): every draft token worth ranking
        counts, prior = self._counts, self._prior
        for seq in seqs:
            accepted, rejected = counts.get(seq.seq_id, prior)  # accept_chance, inlined: this runs every step
            chance = accepted / (accepted + rejected) if accepted + rejected > 0 else 0.0
            a = max(chance, floor)
            value, worth = a, chance
            for _ in range(cap):
                if value < MIN_VALUE:
                    break
                ranked.append((value, worth, seq.seq_id))
                value *= a
                worth *= chance
        ranked.sort(key=itemgetter(0), reverse=True)
        n = len(seqs)
        decode_rate = n / decode_s
        best_rate, best_k, best_s = decode_rate, 0, decode_s
        # A prefix costs what its shape costs, and the shape changes only at powers of two of the
        # tokens verified; within one shape every token adds value, so only a shape's longest
        # prefix can be the best (this runs every step, over every token of the batch).
        value_of_prefix = list(accumulate(value for value, _, _ in ranked))
        k = 1
        while k <= len(ranked):
            key = self._key(n, k)
            k = min(len(ranked), (1 << key[1]) - n)  # the longest prefix of this shape: n + k <= 2**bucket
            cost = self._cost(key) or decode_s
            rate = (n + value_of_prefix[k - 1]) / cost
            if rate > best_rate:
                best_rate, best_k, best_s = rate, k, cost
            k += 1
        predicted = (n + sum(worth for _, worth, _ in ranked[:best_k])) / best_s  # probe floor aside
        # What drafting steps of this batch size realized against their predictions corrects the
        # model (step costs are medians, so tails and a trie that fell behind escape it). A probe
        # drafts regardless, or a bucket written off would never be measured again.
        if best_k == 0 or (not probe and predicted * self._calibration.get(n.bit_length(), 1.0) <= decode_rate):
            return {}
        self.predicted_rate = predicted
        plan: dict[int, int] = {}
        for _, _, seq_id in ranked[:best_k]:
            plan[seq_id] = plan.get(seq_id, 0) + 1
        return plan

    def _probes(self, num_seqs: int) -> bool:
        # (intervals are powers of two, so a bucket's probes stay on the steps of the shorter ones)
        return self._steps % self._probe_every.get(num_seqs.bit_length(), PROBE_EVERY) == 0

    def offer_first_look(self, seq_id: int) -> None:
        """This sequence's prompt was rolled out before: it drafts once early, whatever the costs say."""
        self._first_look.add(seq_id)

    def _key(self, num_seqs: int, num_drafts: int) -> tuple[int, int]:
        tokens = num_seqs + num_drafts
        return num_seqs.bit_length(), (tokens - 1).bit_length() if num_drafts else 0

    def _cost(self, key: tuple[int, int]) -> float | None:
        """Median wall seconds of recent steps of this shape; None while not measured enough."""
        cost = self._median_s.get(key)
        if cost is None:
            times = self._step_s.get(key)
            if times is None or len(times) < MIN_OBSERVED:
                return None
            cost = self._median_s[key] = statistics.median(times)
        return cost

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """A decode or verify step of `num_seqs` sequences and `num_drafts` draft tokens took `seconds`."""
        if seconds > 0 and num_seqs > 0:
            key = self._key(num_seqs, num_drafts)
            self._step_s.setdefault(key, deque(maxlen=COST_WINDOW)).append(seconds)
            self._median_s.pop(key, None)
            if num_drafts:
                self._nothing_planned_for = 0

    def observe_drafting(self, num_seqs: int, emitted: int, seconds: float, predicted_rate: float) -> None:
        """A step planned at `predicted_rate` tokens/s emitted `emitted` tokens in `seconds`, its wait
        for the step before it included (also when the drafter had nothing for it)."""
        if seconds > 0 and predicted_rate > 0:
            bucket, realized = num_seqs.bit_length(), emitted / seconds
            old = self._calibration.get(bucket, 1.0)
            self._calibration[bucket] = old + REALIZED_WEIGHT * (realized / predicted_rate - old)
            self._nothing_planned_for = 0
            decode_s = self._cost(self._key(num_seqs, 0))
            if decode_s is not None:  # probe less where drafting does not beat plain decoding
                every = self._probe_every.get(bucket, PROBE_EVERY)
                paid = realized > num_seqs / decode_s
                self._probe_every[bucket] = PROBE_EVERY if paid else min(2 * every, MAX_PROBE_EVERY)

    def observe(self, seq_id: int, accepted: int, rejected: bool) -> None:
        """Verification accepted `accepted` of the sequence's draft tokens in a row, then rejected the
        next one (`rejected`) or ran out of drafts. A planned draft the drafter had nothing for counts
        as a rejected first token: it cost the overlap pipeline as much."""
        self._nothing_planned_for = 0
        acc, rej = self._counts.get(seq_id, self._prior)
        keep = 1 - EMA_WEIGHT
        self._counts[seq_id] = (keep * acc + EMA_WEIGHT * accepted, keep * rej + EMA_WEIGHT * rejected)
        acc, rej = self._prior
        keep = 1 - PRIOR_WEIGHT
        self._prior = (keep * acc + PRIOR_WEIGHT * accepted, keep * rej + PRIOR_WEIGHT * rejected)

    def forget(self, seq_id: int) -> None:
        self._counts.pop(seq_id, None)
        self._first_look.discard(seq_id)
