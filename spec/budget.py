"""How many draft tokens each sequence may propose in a step.

Two limits. Globally, a step verifies at most `max_verify_tokens` tokens: as the batch
grows each sequence's share shrinks, and once a share falls below one draft token,
speculation is off and a step costs exactly a plain decode step. Per sequence, the
budget follows recent acceptance (an exponential average of accepted drafts per step):
a sequence whose drafts keep failing drafts little, so it spends little verify compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from rollout.sequence import Sequence

EMA_WEIGHT = 0.3  # weight of the newest step in the running acceptance average


class DraftBudget:
    def __init__(self, max_draft_tokens: int, max_verify_tokens: int):
        self.max_draft_tokens = max_draft_tokens
        self.max_verify_tokens = max_verify_tokens
        self._accepted_ema: dict[int, float] = {}

    def per_sequence_cap(self, batch_size: int) -> int:
        return max(0, min(self.max_draft_tokens, self.max_verify_tokens // max(batch_size, 1) - 1))

    def for_batch(self, seqs: Iterable[Sequence]) -> dict[int, int]:
        seqs = list(seqs)
        cap = self.per_sequence_cap(len(seqs))
        if cap == 0:
            return {}
        budgets = {}
        for seq in seqs:
            # New sequences start at the cap; afterwards draft about twice what was recently accepted.
            accepted = self._accepted_ema.get(seq.seq_id, cap)
            budgets[seq.seq_id] = min(cap, 2 + math.ceil(2 * accepted))
        return budgets

    def observe(self, seq_id: int, accepted: int) -> None:
        prev = self._accepted_ema.get(seq_id, float(accepted))
        self._accepted_ema[seq_id] = (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * accepted

    def forget(self, seq_id: int) -> None:
        self._accepted_ema.pop(seq_id, None)
