"""The n-gram drafter: one trie per distinct prompt, fed by everything sampled from it.

A prompt's trie holds the prompt, the outputs of all samples of every request for that
prompt as they grow (siblings draft from each other, and each sample from itself), and,
once its requests finish, stays as history for the next epoch of the same prompt (RL
re-samples its prompts). None of this depends on the model's weights, so drafts stay
valid across weight updates. A sample matches the suffix of its own context (prompt and
its own output) against the trie and drafts the likeliest continuations as a tree.

A prompt's trie is built when one of its samples first needs it, to be fed or to draft,
and the upkeep builds it a chunk of the prompt at a time (`build`) in the device's shadow
(spec/upkeep.py). Counting a prompt costs ~5 us per token on an H100 host, 0.4-0.6 ms
for one of ~94 tokens and several ms for a long chat prompt: built whole at admission it
would stall the first step of a large batch (64 prompts: 28-41 ms), and built whole when a
step first drafts it would stall that step (one drafting step at 256 sequences took 8 ms).
So a sample drafts only once its prompt's trie is `ready`; where the batch is too large to
draft, the trie is not built, and a host with no shadow builds one chunk per step. A
request that finishes before its trie was complete leaves no history: the trie would have
held (part of) the prompt only.

Memory: all tries share one node budget, which refuses creation at its limit. Before
each insertion that might hit it, room is made down to a low-water mark: first the least
recently used history tries are dropped whole, then the largest live tries lose up to
half their nodes, the rarest and longest n-grams first, never the nodes a sample's
cursor stands on, so no cursor goes stale.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kernels.attention import MAX_TREE_TOKENS
from spec.ngram_trie import NgramTrie, NodeBudget
from spec.tree import DraftTree

LOW_WATER = 0.95  # eviction frees down to this share of the node budget: rare, short pauses


@dataclass
class NgramConfig:
    min_match: int = 1  # shortest context suffix drafted from
    max_match: int = 6  # longest context suffix tried first
    max_draft_depth: int = 8  # deepest draft below a full-length match
    max_trie_nodes: int = 2_000_000  # across all prompts' tries, live and history
    max_history_prompts: int = 4096  # finished prompts whose tries are kept for the next epoch (LRU)
    share_siblings: bool = True  # off: each sample drafts only from its prompt and its own output; no history

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            got = f"min_match={self.min_match}, max_match={self.max_match}"
            raise ValueError(f"n-gram matching needs 1 <= min_match <= max_match, got {got}")
        if self.max_draft_depth < 1 or self.max_trie_nodes < 1 or self.max_history_prompts < 0:
            raise ValueError("n-gram max_draft_depth and max_trie_nodes must be positive, max_history_prompts >= 0")

    @property
    def max_depth(self) -> int:
        """Longest n-gram stored: a full match plus a full draft."""
        return self.max_match + self.max_draft_depth


@dataclass(eq=False)
class _PromptTrie:
    prompt: tuple[int, ...]
    trie: NgramTrie | None = None  # built when a sample first needs it
    prompt_stream: int = -1  # stands after the prompt's counted tokens; samples fork from it
    counted: int = 0  # prompt tokens in the trie so far: the trie is ready when all are
    live_groups: int = 0

    @property
    def ready(self) -> bool:
        return self.counted == len(self.prompt)


@dataclass(eq=False)
class _Stream:
    group_id: Hashable
    entry: _PromptTrie  # shared by the prompt's samples, or private to this one
    handle: int | None  # the stream in the entry's trie, opened when first needed
    private: bool  # owns its trie (no sibling sharing)
    fed: int  # tokens of the sequence (prompt included) the stream stands after


@dataclass(eq=False)
class _Group:
    prompt: tuple[int, ...]
    entry: _PromptTrie | None  # None without sibling sharing
    seq_ids: set[int] = field(default_factory=set)


class NgramDrafter:
    source = "ngram"

    def __init__(self, cfg: NgramConfig | None = None):
        self.cfg = cfg or NgramConfig()
        self.budget = NodeBudget(self.cfg.max_trie_nodes)
        self._live: dict[tuple[int, ...], _PromptTrie] = {}
        self._history: OrderedDict[tuple[int, ...], _PromptTrie] = OrderedDict()  # least recently used first
        self._groups: dict[Hashable, _Group] = {}
        self._streams: dict[int, _Stream] = {}
        # After a prune that found too little to free, tokens to insert before trying again
        # (or until a cursor closes), so a budget full of protected nodes is not rescanned per token.
        self._prune_wait = 0

    # ---- lifecycle ----
    def add_group(self, group_id: Hashable, prompt: Sequence[int]) -> None:
        """A new request for `prompt`; its trie is reused if the prompt is live or in history."""
        if group_id in self._groups:
            raise ValueError(f"n-gram drafter: group {group_id!r} already exists; remove it first")
        key = _prompt_key(prompt)
        if not key:
            raise ValueError("n-gram drafter: the prompt is empty")
        entry = None
        if self.cfg.share_siblings:
            entry = self._live.get(key) or self._history.pop(key, None) or _PromptTrie(key)
            self._live[key] = entry
            entry.live_groups += 1
        self._groups[group_id] = _Group(key, entry)

    def knows_prompt(self, prompt: Sequence[int]) -> bool:
        """Whether samples of this prompt are in a trie already (live, or history of an earlier epoch)."""
        key = _prompt_key(prompt)
        if not self.cfg.share_siblings:
            return False
        entry = self._live.get(key) or self._history.get(key)
        return entry is not None and entry.ready

    def add_sequence(self, group_id: Hashable, seq_id: int) -> None:
        """A sample of the group; its context starts as the prompt."""
        group = self._group(group_id)
        if seq_id in self._streams:
            raise ValueError(f"n-gram drafter: sequence {seq_id} already exists; remove it first")
        entry = group.entry or _PromptTrie(group.prompt)
        self._streams[seq_id] = _Stream(group_id, entry, None, private=group.entry is None, fed=len(group.prompt))
        group.seq_ids.add(seq_id)

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """`tokens` were appended to the sequence's output (one, or several after accepted drafts)."""
        s = self._stream(seq_id)
        if not len(tokens):
            return
        trie = self._open(s)
        self._prune_wait -= len(tokens)
        self._make_room(len(tokens))
        trie.extend(s.handle, tokens)
        s.fed += len(tokens)

    def fed(self, seq_id: int) -> int:
        """How many of the sequence's tokens (prompt included) its stream stands after."""
        return self._stream(seq_id).fed

    def resync(self, seq_id: int, tokens: Sequence[int], upto: int) -> None:
        """Tokens were skipped: stand after `tokens[:upto]` (prompt and output) again."""
        s = self._stream(seq_id)
        self._open(s).resync(s.handle, tokens[max(0, upto - self.cfg.max_depth) : upto])
        s.fed = upto

    def remove_sequence(self, seq_id: int) -> None:
        """The sample finished or was aborted; with sharing, its output stays in the prompt's trie."""
        s = self._stream(seq_id)
        del self._streams[seq_id]
        self._groups[s.group_id].seq_ids.discard(seq_id)
        self._prune_wait = 0  # its cursor no longer protects anything
        trie = s.entry.trie
        if trie is None:
            return
        if s.private:  # a private trie dies with its sample
            self.budget.release(trie.num_nodes)
        elif s.handle is not None:
            trie.close_stream(s.handle)

    def remove_group(self, group_id: Hashable) -> None:
        """The request is done (its remaining samples are removed); the prompt's trie stays as history."""
        group = self._group(group_id)
        for seq_id in list(group.seq_ids):
            self.remove_sequence(seq_id)
        del self._groups[group_id]
        entry = group.entry
        if entry is None:
            return
        entry.live_groups -= 1
        if entry.live_groups == 0:
            del self._live[group.prompt]
            if not entry.ready:  # no sample was counted: it would hold (part of) the prompt only
                if entry.trie is not None:
                    self.budget.release(entry.trie.num_nodes)
                return
            self._history[group.prompt] = entry
            while len(self._history) > self.cfg.max_history_prompts:
                self._drop_oldest_history()

    def build(self, seq_id: int, max_tokens: int) -> bool:
        """Count up to `max_tokens` more tokens of the sequence's prompt into its trie; returns
        whether the trie is `ready` (at once, and counting nothing, if it was)."""
        return self._build(self._stream(seq_id).entry, max_tokens)

    def _build(self, entry: _PromptTrie, max_tokens: int) -> bool:
        if entry.ready:
            return True
        if entry.trie is None:
            entry.trie = NgramTrie(self.cfg.max_depth, self.budget)
            entry.prompt_stream = entry.trie.open_stream()
        end = min(len(entry.prompt), entry.counted + max_tokens)
        self._make_room(end - entry.counted)
        entry.trie.extend(entry.prompt_stream, entry.prompt[entry.counted : end])
        entry.counted = end
        return entry.ready

    # ---- drafting ----
    def ready(self, seq_id: int) -> bool:
        """Whether the sequence can draft without building its prompt's trie (False if unknown)."""
        s = self._streams.get(seq_id)
        return s is not None and s.entry.ready

    def propose(self, seq_id: int, context: Sequence[int], budget: int) -> DraftTree:
        """At most `budget` drafts (capped at 63) after `context`, the sequence's tokens so far (prompt
        included; only the last max_match are read); root-only if nothing matches."""
        trie = self._open(self._stream(seq_id))
        budget = min(budget, MAX_TREE_TOKENS - 1)
        node = trie.match(context, self.cfg.min_match, self.cfg.max_match) if budget > 0 else None
        if node is None:
            return DraftTree.root_only(int(context[-1]), self.source)
        return trie.draft(node, int(context[-1]), budget, self.source)

    def clear_history(self) -> None:
        """Forget finished prompts (benchmarks use it so runs do not draft from earlier runs)."""
        while self._history:
            self._drop_oldest_history()

    def memory_nodes(self) -> int:
        """Trie nodes alive across all prompts, live and history; never above cfg.max_trie_nodes."""
        return self.budget.used

    def _open(self, s: _Stream) -> NgramTrie:
        """The stream's trie, with the stream open in it: what is left of the prompt's build is done now."""
        entry = s.entry
        if not entry.ready:
            self._build(entry, len(entry.prompt))
        if s.handle is None:
            s.handle = entry.trie.open_stream(fork_of=entry.prompt_stream)
        return entry.trie

    # ---- memory ----
    def _make_room(self, num_tokens: int) -> None:
        """Before inserting `num_tokens`, free enough that they cannot hit the budget's limit."""
        b = self.budget
        need = num_tokens * self.cfg.max_depth
        if b.used + need <= b.limit:
            return
        target = max(0, min(int(b.limit * LOW_WATER), b.limit - need))
        while b.used > target and self._history:
            self._drop_oldest_history()
        if b.used > target and self._prune_wait <= 0:
            self._prune_live(b.used - target)

    def _prune_live(self, to_free: int) -> None:
        """Halve live tries, largest first, until `to_free` nodes are freed. A prune scans its whole
        trie, so this bounds the pause by the tries touched; the largest has the most to spare, and
        taking at most half never wipes a prompt's data while smaller tries keep theirs."""
        tries = [e.trie for e in self._live.values()] + [s.entry.trie for s in self._streams.values() if s.private]
        tries = [t for t in tries if t is not None]
        for trie in sorted(tries, key=lambda t: t.num_nodes, reverse=True):
            to_free -= trie.prune(min(to_free, max(1, trie.num_nodes // 2)))
            if to_free <= 0:
                return
        self._prune_wait = max(1, int(self.budget.limit * (1 - LOW_WATER)) // self.cfg.max_depth)

    def _drop_oldest_history(self) -> None:
        _, entry = self._history.popitem(last=False)
        self.budget.release(entry.trie.num_nodes)

    def _group(self, group_id: Hashable) -> _Group:
        try:
            return self._groups[group_id]
        except KeyError:
            raise KeyError(f"n-gram drafter: unknown group {group_id!r} (never added, or already removed)") from None

    def _stream(self, seq_id: int) -> _Stream:
        try:
            return self._streams[seq_id]
        except KeyError:
            raise KeyError(f"n-gram drafter: unknown sequence {seq_id} (never added, or already removed)") from None


def _prompt_key(prompt: Sequence[int]) -> tuple[int, ...]:
    """The key of a prompt's trie (token ids of any integer type)."""
    return tuple(int(t) for t in prompt)
