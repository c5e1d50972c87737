"""Feeding the drafter without slowing the engine: its updates wait in a queue.

Every emitted token must reach the n-gram tries, which costs host time per token per
sequence (a few microseconds in Python). A step that does not draft has no use for that
work right away, and neither has a step that drafts: proposals look up the sequence's
newest tokens in the trie directly, and a trie one step behind drafts nearly as well. So
the engine applies the queue in the device's shadow: after launching a step and only
until the device finishes it.

Each step queues its batch, not its tokens: applying a sequence feeds it whatever it has
emitted since it was last fed, once its prompt's trie is built. Builds happen here too, a
chunk of the prompt between polls, since a whole one can take longer than the shadow (a
chat prompt of several hundred tokens takes milliseconds). When the host is the
bottleneck (a small model at a large batch) the shadow is too short, and a backlog would
only move the cost elsewhere, so a step's batch that did not fit into the shadow is
dropped, and a sequence that fell further behind than one step's tokens skips ahead: the
skipped n-grams are never counted, and its match position is rebuilt from its last tokens.
Drafts stay lossless (verification decides what is emitted); only the trie knows a little
less. A step with no shadow at all still builds one chunk of a prompt's trie, so that
where every step is host-bound each trie is whole after a bounded number of steps.
Lifecycle updates (a new prompt, a finished sample) are never dropped.

A step whose batch is too large to draft at all (the verify limit leaves no draft token
per sequence: 129 or more sequences by default) is not queued either. Its tokens would
serve only later steps, once the batch has shrunk, and its host has the least shadow to
spare: the chunk being fed when the device finishes runs past the end of the shadow. Once
the batch is small enough to draft, each sequence skips ahead as above. The cost is
history: a sample that finishes while the batch is that large leaves none of its tokens
for the next epoch of its prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from spec.ngram import NgramDrafter

if TYPE_CHECKING:  # rollout imports spec, not the other way round
    from rollout.sequence import Sequence

# Sequences fed between polls of the device's progress. The chunk that is running when the
# device finishes overshoots the shadow and delays the step after by half a chunk on average;
# a poll (an event query) costs a fraction of one sequence's feed (`bench/host_costs.py upkeep-poll`).
POLL_EVERY = 2
BUILD_CHUNK = 16  # prompt tokens counted into a trie between polls (~5 us each on an H100 host)


class DrafterUpkeep:
    def __init__(self, drafter: NgramDrafter, max_step_tokens: int):
        self.drafter = drafter
        self.max_step_tokens = max_step_tokens  # the most a sequence emits in one step
        self._queue: deque = deque()  # lifecycle callables, and [batch, next index] of the steps
        self.dropped_tokens = 0

    def __len__(self) -> int:
        return len(self._queue)

    def lifecycle(self, update: Callable[[], None]) -> None:
        """A new prompt or sample, or one done: applied in order with the steps, never dropped."""
        self._queue.append(update)

    def step(self, batch: list[Sequence]) -> None:
        """These sequences are about to get the step's tokens (queue it before they finish)."""
        self._queue.append([batch, 0])

    def finish(self, seq: Sequence) -> None:
        """The sample is done: after its queued steps, it leaves the drafter."""

        def remove() -> None:
            self.dropped_tokens += len(seq.tokens) - self.drafter.fed(seq.seq_id)
            self.drafter.remove_sequence(seq.seq_id)

        self._queue.append(remove)

    def apply(self, until: Callable[[], bool] | None = None) -> None:
        """Apply queued updates in order: all of them, or until `until()` says the device is done
        (lifecycle updates at the head of the queue are applied regardless)."""
        q = self._queue
        progressed = False
        while q:
            op = q[0]
            if callable(op):  # lifecycle updates go through shadow or not, so none piles up
                q.popleft()
                op()
            elif until is not None and until():  # checked first: a host-bound step has no shadow at all
                if not progressed:
                    self._build_a_chunk(op)
                return
            else:
                progressed = True
                batch, i = op
                end = min(i + POLL_EVERY, len(batch))
                while i < end and self.drafter.build(batch[i].seq_id, BUILD_CHUNK):
                    self._feed(batch[i])
                    i += 1
                op[1] = i  # (short of `end`: a chunk of a prompt's trie was built, poll before the next)
                if i == len(batch):
                    q.popleft()

    def _build_a_chunk(self, op: list) -> None:
        """A step with no shadow still builds one chunk of a prompt's trie, or where every step is
        host-bound (eager steps, no CUDA graphs) no trie would ever be whole and nothing drafted."""
        batch, i = op
        for seq in batch[i:]:
            if not self.drafter.ready(seq.seq_id):
                self.drafter.build(seq.seq_id, BUILD_CHUNK)
                return

    def drop_unfed_steps(self) -> None:
        """After a step's shadow: steps whose batch did not fit into it are not fed."""
        self._queue = deque(op for op in self._queue if callable(op))

    def _feed(self, seq: Sequence) -> None:
        seq_id, total = seq.seq_id, len(seq.tokens)
        fed = self.drafter.fed(seq_id)
        if fed == total:
            return
        start = max(fed, total - self.max_step_tokens)
        if start > fed:  # fell behind: skip ahead
            self.dropped_tokens += start - fed
            self.drafter.resync(seq_id, seq.tokens, start)
        self.drafter.extend(seq_id, seq.tokens[start:total])
