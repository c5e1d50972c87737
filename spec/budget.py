"""Who drafts in a step, and how much.

Speculation pays only when the accepted drafts outweigh what verifying them costs: extra
tokens in the forward pass (nearly free at small batch on a GPU, proportional once the
step is compute-bound) and host time to draft and to walk the trees. Neither is known in
advance, so both are learned while running:

- Per batch size (power-of-two buckets), the engine's step times give tokens emitted per
  second with drafting and without. The better choice is used; the other is re-measured
  every EXPLORE_EVERY steps, so a wrong choice costs at most that share of the run.
- Per sequence, the budget follows an average of its recently accepted drafts: one whose
  drafts keep failing stops drafting, and is re-probed every PROBE_EVERY steps.
- Per step, at most `max_verify_tokens` tokens are verified in total.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rollout.sequence import Sequence

EMA_WEIGHT = 0.3  # weight of the newest step in the per-sequence acceptance average
RATE_WEIGHT = 0.2  # weight of the newest step in the per-bucket throughput averages
WARMUP_STEPS = 3  # steps measured for each choice in a bucket before choosing
EXPLORE_EVERY = 32
PROBE_EVERY = 16
MIN_ACCEPTED = 0.2  # accepted drafts per step below which a sequence pauses drafting


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int, adaptive: bool = True):
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self._accepted_ema: dict[int, float] = {}
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, drafting) -> tokens per second
        self._seen: dict[tuple[int, bool], int] = {}
        self._steps = 0
        self._choice: tuple[int, bool] | None = None  # the decision of the step in flight

    def per_sequence_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_draft_tokens, self.max_verify_tokens // max(batch_size, 1) - 1))

    def for_batch(self, seqs: Iterable[Sequence]) -> dict[int, int]:
        """Draft budgets by seq_id for this step (empty: no speculation this step)."""
        seqs = list(seqs)
        self._steps += 1
        cap = self.per_sequence_cap(len(seqs))
        self._choice = None
        if cap == 0:
            return {}
        if not self.adaptive:
            return {seq.seq_id: cap for seq in seqs}
        bucket = len(seqs).bit_length()
        drafting = self._choose(bucket)
        self._choice = (bucket, drafting)
        if not drafting:
            return {}
        budgets = {}
        for seq in seqs:
            accepted = self._accepted_ema.get(seq.seq_id)
            if accepted is None:  # optimistic start
                budgets[seq.seq_id] = cap
            elif accepted >= MIN_ACCEPTED or (self._steps + seq.seq_id) % PROBE_EVERY == 0:
                budgets[seq.seq_id] = min(cap, 1 + math.ceil(2 * accepted))
        return budgets

    def _choose(self, bucket: int) -> bool:
        on, off = (bucket, True), (bucket, False)
        for choice in (on, off):
            if self._seen.get(choice, 0) < WARMUP_STEPS:
                return choice[1]
        best = self._rate[on] >= self._rate[off]
        return (not best) if self._steps % EXPLORE_EVERY == 0 else best

    def observe_step(self, emitted_tokens: int, seconds: float) -> None:
        """The decode step just finished: credit its throughput to the choice made for it."""
        if self._choice is None or seconds <= 0:
            return
        rate = emitted_tokens / seconds
        prev = self._rate.get(self._choice)
        self._rate[self._choice] = rate if prev is None else (1 - RATE_WEIGHT) * prev + RATE_WEIGHT * rate
        self._seen[self._choice] = self._seen.get(self._choice, 0) + 1
        self._choice = None

    def observe(self, seq_id: int, accepted: int) -> None:
        prev = self._accepted_ema.get(seq_id, float(accepted))
        self._accepted_ema[seq_id] = (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * accepted

    def forget(self, seq_id: int) -> None:
        self._accepted_ema.pop(seq_id, None)
