"""Feeding the drafter without slowing the engine: its updates wait in a queue.

Every emitted token must reach the n-gram tries, which costs host time per token per
sequence (a few microseconds in Python). A step that does not draft has no use for that
work right away, so the engine applies the queue in the device's shadow: after launching
a step and only until the device finishes it. A step that drafts first applies the whole
queue (its proposals match against the newest tokens), and that cost is charged to
drafting by the budget.

When the host is the bottleneck (a small model at a large batch) the shadow is too short,
and a backlog would only move the cost elsewhere. So tokens that did not fit into one
step's shadow are dropped: their n-grams are never counted, and the sequence's match
position is rebuilt from its last tokens before it is fed again. Drafts stay lossless
(verification decides what is emitted); only the trie knows a little less. Lifecycle
updates (a new prompt, a finished sample) are never dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rollout.sequence import Sequence
from spec.ngram import NgramDrafter

POLL_EVERY = 8  # updates applied between polls of the device's progress


class DrafterUpkeep:
    def __init__(self, drafter: NgramDrafter):
        self.drafter = drafter
        # Callables (lifecycle updates) and (sequence, start, end) tuples: seq.tokens[start:end]
        # are new. Tuples, not objects: one is queued per sequence per step.
        self._queue: deque = deque()
        self.dropped_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    def lifecycle(self, update: Callable[[], None]) -> None:
        """A new prompt or sample, or one done: applied in order with the tokens, never dropped."""
        self._queue.append(update)

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        end = len(seq.tokens)
        self._queue.append((seq, end - num_tokens, end))

    def apply(self, until: Callable[[], bool] | None = None) -> None:
        """Apply queued updates in order: all of them, or until `until()` says the device is done."""
        while self._queue:
            for _ in range(min(POLL_EVERY, len(self._queue))):
                op = self._queue.popleft()
                if callable(op):
                    op()
                else:
                    seq, start, end = op
                    if self.drafter.fed(seq.seq_id) != start:  # earlier tokens were dropped
                        self.drafter.resync(seq.seq_id, seq.tokens[:start])
                    self.drafter.extend(seq.seq_id, seq.tokens[start:end])
            if until is not None and until():
                return

    def drop_tokens(self) -> None:
        """After a step's shadow: drop the token updates that did not fit into it."""
        kept: deque = deque()
        for op in self._queue:
            if callable(op):
                kept.append(op)
            else:
                self.dropped_tokens += op[2] - op[1]
        self._queue = kept
