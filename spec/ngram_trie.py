"""Counts of token n-grams in a trie, grown one token at a time, drafted from best-first.

A node stands for the n-gram spelled by its path from the root; its count is how often
that n-gram occurred. Each stream fed to the trie (a prompt, a sample's output) has a
cursor: the nodes of its current suffixes of 0..max_depth tokens, `cursor[k]` being the
node of the last k tokens. Appending a token moves every entry one step down, so
insertion costs O(max_depth), and the cursor doubles as the suffix match for drafting.
A stream may start as a fork of another (every sample starts from its prompt's cursor),
so the prompt is inserted once while each sample counts its own continuation of it.

Memory: all tries share a `NodeBudget` that refuses creation at its limit, so the bound
holds whatever the owner does; the owner frees room at safe points between insertions
with `prune`, which drops the rarest, longest n-grams but never a node a cursor stands
on (nor its prefixes), so cursors stay valid and no n-gram is ever invented.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from spec.tree import DraftTree

ROOT = 0


class NodeBudget:
    """Trie nodes alive across every trie that shares it; tries create none beyond the limit."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the trie node budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0

    def release(self, n: int) -> None:
        self.used -= n


class NgramTrie:
    def __init__(self, max_depth: int, budget: NodeBudget):
        if max_depth < 2:
            raise ValueError(f"an n-gram trie needs max_depth >= 2 to draft anything, got {max_depth}")
        self.max_depth = max_depth
        self.budget = budget
        # Per node; a freed node has count 0 and waits in `_free` for reuse.
        self.kids: list[dict[int, int] | None] = [None]  # token -> child node; None for a leaf
        self.count: list[int] = [0]
        self.parent: list[int] = [-1]
        self.token: list[int] = [-1]  # the last token of the node's n-gram
        self.depth: list[int] = [0]  # the n-gram's length
        self._free: list[int] = []
        self.num_nodes = 0  # the root is not counted
        self._cursors: dict[int, list[int]] = {}
        self._next_stream = 0

    # ---- streams ----
    def open_stream(self, fork_of: int | None = None) -> int:
        """A new stream, empty or continuing where stream `fork_of` stands; returns its handle."""
        handle = self._next_stream
        self._next_stream += 1
        self._cursors[handle] = [ROOT] if fork_of is None else list(self._cursor(fork_of))
        return handle

    def close_stream(self, stream: int) -> None:
        self._cursor(stream)
        del self._cursors[stream]

    def extend(self, stream: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to the stream, counting every n-gram (up to max_depth) they end."""
        cur = self._cursor(stream)
        # The hot path of the drafter (max_depth steps per token): locals, and no allocation per token.
        kids, count, budget, max_depth = self.kids, self.count, self.budget, self.max_depth
        parent, token, depth, free = self.parent, self.token, self.depth, self._free
        created = 0
        for t in tokens:
            t = int(t)
            n = min(len(cur), max_depth)
            if budget.used + n <= budget.limit:
                # The cursor moves in place, longest suffix first (cur[k + 1] is written after it was
                # read): no list per token, so the cyclic GC runs far less often. New nodes are made
                # inline (as `_new_node` does): most tokens of a new text make max_depth of them.
                if n == len(cur):
                    cur.append(ROOT)
                made = 0
                for k in range(n - 1, -1, -1):
                    node = cur[k]
                    d = kids[node]
                    if d is None:
                        d = kids[node] = {}
                        child = None
                    else:
                        child = d.get(t)
                    if child is not None:
                        count[child] += 1
                    else:
                        if free:
                            child = free.pop()
                            count[child], parent[child], token[child], depth[child] = 1, node, t, depth[node] + 1
                        else:
                            child = len(count)
                            kids.append(None)
                            count.append(1)
                            parent.append(node)
                            token.append(t)
                            depth.append(depth[node] + 1)
                        d[t] = child
                        made += 1
                    cur[k + 1] = child
                budget.used += made
                created += made
                continue
            nxt = [ROOT]  # near the node limit: shorter suffixes first, the longer ones go uncounted
            for node in cur[:n]:
                d = kids[node]
                child = None if d is None else d.get(t)
                if child is not None:
                    count[child] += 1
                else:
                    if budget.used >= budget.limit:
                        break
                    child = self._new_node(node, t)
                    created += 1
                nxt.append(child)
            cur[:] = nxt
        self.num_nodes += created

    def _new_node(self, parent: int, token: int) -> int:
        self.budget.used += 1
        depth = self.depth[parent] + 1
        if self._free:
            child = self._free.pop()
            self.count[child], self.parent[child], self.token[child], self.depth[child] = 1, parent, token, depth
        else:
            child = len(self.count)
            self.kids.append(None)
            self.count.append(1)
            self.parent.append(parent)
            self.token.append(token)
            self.depth.append(depth)
        d = self.kids[parent]
        if d is None:
            d = self.kids[parent] = {}
        d[token] = child
        return child

    def resync(self, stream: int, tail: Sequence[int]) -> None:
        """Move the stream's cursor to stand after `tail`, counting nothing (tokens before it
        were skipped). Every stored n-gram's suffixes are stored too, so the walk stops at the
        first suffix length that is missing."""
        self._cursor(stream)
        cur = [ROOT]
        for k in range(1, min(len(tail), self.max_depth) + 1):
            node = ROOT
            for t in tail[-k:]:
                d = self.kids[node]
                node = None if d is None else d.get(int(t))
                if node is None:
                    break
            if node is None:
                break
            cur.append(node)
        self._cursors[stream] = cur

    def _cursor(self, stream: int) -> list[int]:
        try:
            return self._cursors[stream]
        except KeyError:
            raise KeyError(f"n-gram trie: no open stream {stream}") from None

    # ---- lookup and drafting ----
    def count_of(self, ngram: Sequence[int]) -> int:
        """How often `ngram` was counted (0 if absent, evicted, or longer than max_depth)."""
        node = ROOT
        for t in ngram:
            d = self.kids[node]
            node = None if d is None else d.get(int(t))
            if node is None:
                return 0
        return self.count[node] if node != ROOT else 0

    def items(self) -> Iterator[tuple[tuple[int, ...], int]]:
        """Every stored n-gram with its count, depth first."""
        stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
        while stack:
            node, path = stack.pop()
            for t, child in (self.kids[node] or {}).items():
                yield path + (t,), self.count[child]
                stack.append((child, path + (t,)))

    def match(self, context: Sequence[int], min_match: int, max_match: int) -> int | None:
        """The node of the longest suffix of `context` (max_match down to min_match tokens) that was ever continued.

        The suffix is looked up from the root rather than read off a stream's cursor, so a
        sequence can draft before its newest tokens are counted (see spec/upkeep.py).
        """
        kids = self.kids
        for m in range(min(max_match, len(context)), min_match - 1, -1):
            node = ROOT
            for token in context[len(context) - m :]:
                children = kids[node]
                node = children.get(token) if children else None
                if node is None:
                    break
            if node is not None and kids[node]:
                return node
        return None

    def draft(self, node: int, root_token: int, budget: int, source: str = "ngram") -> DraftTree:
        """Best-first expansion below `node`: the `budget` continuations of highest path probability.

        A child's probability is its count over the summed counts of its siblings (how often
        the parent n-gram was seen continued); a path's is the product along it, the estimate
        of how likely verification gets that far. Factors are <= 1, so a node never outranks
        its ancestors and the chosen nodes always form a tree.
        """
        kids, count = self.kids, self.count
        tokens, parents = [root_token], [-1]
        # (-path prob, tiebreak, trie node, parent in the tree, token)
        frontier: list[tuple[float, int, int, int, int]] = []
        order = 0
        trie_node, tree_node, prob = node, 0, 1.0
        while True:
            d = kids[trie_node]
            room = budget + 1 - len(tokens)
            if d and room > 0:
                total = sum(map(count.__getitem__, d.values()))
                ranked = d.items() if len(d) <= room else heapq.nlargest(room, d.items(), key=lambda kv: count[kv[1]])
                for tok, child in ranked:
                    heapq.heappush(frontier, (-prob * count[child] / total, order, child, tree_node, tok))
                    order += 1
            if not frontier or len(tokens) > budget:
                break
            neg_p, _, trie_node, parent, tok = heapq.heappop(frontier)
            tokens.append(tok)
            parents.append(parent)
            tree_node, prob = len(tokens) - 1, -neg_p
        return DraftTree(tokens, parents, source)

    # ---- eviction ----
    def prune(self, to_free: int) -> int:
        """Free `to_free` nodes, or all evictable ones if fewer: the rarest n-grams first and,
        among equally rare ones, the longest (a shorter suffix still drafts the same continuation).
        Nodes cursors stand on, and their prefixes, are kept. Returns the number of nodes freed.

        An n-gram is never rarer than its extensions (the samples forked from a prompt aside,
        but the prompt's cursor is kept), so in this order every node comes after its
        descendants: evicting a prefix of it only ever cuts leaves, and the counts left stay exact.
        """
        keep = self._protected()
        kids, count, depth, parent, token = self.kids, self.count, self.depth, self.parent, self.token
        width = self.max_depth + 1
        victims = [i for i, c in enumerate(count) if c and i not in keep]
        victims.sort(key=lambda i: count[i] * width - depth[i])
        freed = 0
        for node in victims[:to_free]:
            if not count[node]:  # went with an ancestor; only if the order above were broken
                continue
            siblings = kids[parent[node]]
            del siblings[token[node]]
            if not siblings:
                kids[parent[node]] = None
            freed += self._free_subtree(node)
        self.num_nodes -= freed
        self.budget.release(freed)
        return freed

    def _protected(self) -> set[int]:
        keep: set[int] = set()
        for cur in self._cursors.values():
            for node in cur:
                while node not in keep and node >= 0:
                    keep.add(node)
                    node = self.parent[node]
        return keep

    def _free_subtree(self, top: int) -> int:
        stack, n = [top], 0
        while stack:
            node = stack.pop()
            if self.kids[node]:
                stack.extend(self.kids[node].values())
            self.kids[node] = None
            self.count[node] = 0
            self.parent[node] = -1
            self._free.append(node)
            n += 1
        return n
