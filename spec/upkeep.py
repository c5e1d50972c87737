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
from dataclasses import dataclass

from rollout.sequence import Sequence
from spec.ngram import NgramDrafter

POLL_EVERY = 8  # updates applied between polls of the device's progress


@dataclass(eq=False)
class _Extend:
    seq: Sequence
    start: int  # seq.tokens[start:end] are new
    end: int


class DrafterUpkeep:
    def __init__(self, drafter: NgramDrafter):
        self.drafter = drafter
        self._queue: deque = deque()  # _Extend, or a callable lifecycle update
        self._stale: set[int] = set()  # seq_ids whose match position must be rebuilt
        self.dropped_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    def lifecycle(self, update: Callable[[], None]) -> None:
        self._queue.append(update)

    def finish(self, seq_id: int) -> None:
        """The sample is done: queue its removal from the drafter."""

        def remove() -> None:
            self._stale.discard(seq_id)
            self.drafter.remove_sequence(seq_id)

        self._queue.append(remove)

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        end = len(seq.tokens)
        self._queue.append(_Extend(seq, end - num_tokens, end))

    def apply(self, until: Callable[[], bool] | None = None) -> None:
        """Apply queued updates in order: all of them, or until `until()` says the device is done."""
        while self._queue:
            for _ in range(min(POLL_EVERY, len(self._queue))):
                self._apply(self._queue.popleft())
            if until is not None and until():
                return

    def drop_tokens(self) -> None:
        """After a step's shadow: drop the token updates that did not fit into it."""
        kept: deque = deque()
        for op in self._queue:
            if isinstance(op, _Extend):
                self._stale.add(op.seq.seq_id)
                self.dropped_tokens += op.end - op.start
            else:
                kept.append(op)
        self._queue = kept

    def _apply(self, op) -> None:
        if not isinstance(op, _Extend):
            op()
            return
        seq_id = op.seq.seq_id
        if seq_id in self._stale:
            self._stale.discard(seq_id)
            self.drafter.resync(seq_id, op.seq.tokens[: op.start])
        self.drafter.extend(seq_id, op.seq.tokens[op.start : op.end])
