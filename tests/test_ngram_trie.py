from collections import Counter

import numpy as np
import pytest

from spec.ngram_trie import NgramTrie, NodeBudget


def ngram_counts(prompt: list[int], outputs: list[list[int]], max_depth: int) -> Counter:
    """Brute force: the prompt's n-grams once, plus each output's n-grams that end inside the output
    (an output continues the prompt, so its n-grams may start in it)."""
    counts = Counter()
    for stream, start in [(prompt, 0)] + [(prompt + out, len(prompt)) for out in outputs]:
        for end in range(start + 1, len(stream) + 1):
            for n in range(1, min(max_depth, end) + 1):
                counts[tuple(stream[end - n : end])] += 1
    return counts


def fill(rng, trie: NgramTrie, prompt: list[int], num_streams: int, length: int, vocab: int) -> list[list[int]]:
    """Streams forked from the prompt, grown in a random interleaving, 1-3 tokens at a time."""
    root = trie.open_stream()
    trie.extend(root, prompt)
    handles = [trie.open_stream(fork_of=root) for _ in range(num_streams)]
    outputs: list[list[int]] = [[] for _ in handles]
    while any(len(o) < length for o in outputs):
        i = int(rng.choice([i for i, o in enumerate(outputs) if len(o) < length]))
        toks = rng.integers(vocab, size=int(rng.integers(1, 4))).tolist()
        trie.extend(handles[i], toks)
        outputs[i] += toks
    return outputs


@pytest.mark.parametrize("seed", range(5))
def test_trie_counts_match_bruteforce_ngram_counts(seed):
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(2, 7))
    trie = NgramTrie(depth, NodeBudget(10**6))
    prompt = rng.integers(4, size=int(rng.integers(1, 12))).tolist()
    outputs = fill(rng, trie, prompt, num_streams=4, length=40, vocab=4)
    expected = ngram_counts(prompt, outputs, depth)
    assert dict(trie.items()) == expected
    assert trie.num_nodes == len(expected) == trie.budget.used
    assert trie.count_of(outputs[0][-2:]) == expected[tuple(outputs[0][-2:])]


def path_prob(counts: Counter, context: tuple, path: tuple) -> float:
    """Product over the path of count(child) / summed counts of the child and its siblings."""
    prob, prefix = 1.0, context
    for t in path:
        total = sum(c for g, c in counts.items() if len(g) == len(prefix) + 1 and g[:-1] == prefix)
        prob *= counts[prefix + (t,)] / total
        prefix += (t,)
    return prob


def test_longest_suffix_match_is_used():
    trie = NgramTrie(8, NodeBudget(1000))
    a, b, query = trie.open_stream(), trie.open_stream(), trie.open_stream()
    trie.extend(a, [1, 2, 3, 9])
    trie.extend(b, [3, 7] * 5)
    trie.extend(query, [1, 2, 3])
    node = trie.match([1, 2, 3], min_match=1, max_match=3)
    assert trie.draft(node, 3, budget=1).tokens.tolist() == [3, 9]  # "1 2 3" -> 9
    node = trie.match([1, 2, 3], min_match=1, max_match=1)
    assert trie.draft(node, 3, budget=1).tokens.tolist() == [3, 7]  # "3" -> 7 five times, 9 once
    assert trie.match([1, 2, 3], min_match=4, max_match=6) is None  # no 4-gram ending the query was continued


@pytest.mark.parametrize("seed", range(8))
def test_draft_tree_is_best_first_by_path_probability(seed):
    rng = np.random.default_rng(seed)
    depth, min_match, max_match = 6, 1, 3
    trie = NgramTrie(depth, NodeBudget(10**6))
    prompt = rng.integers(5, size=6).tolist()
    outputs = fill(rng, trie, prompt, num_streams=3, length=30, vocab=5)
    counts = ngram_counts(prompt, outputs, depth)
    query = trie.open_stream()
    context = tuple(rng.integers(5, size=4).tolist())
    trie.extend(query, context)
    counts += ngram_counts([], [list(context)], depth)
    m = next(m for m in range(max_match, min_match - 1, -1) if any(g[:-1] == context[-m:] for g in counts))
    suffix = context[-m:]
    # Every continuation the trie can draft from the match, with its probability.
    candidates = {g[m:]: path_prob(counts, suffix, g[m:]) for g in counts if len(g) > m and g[:m] == suffix}
    for budget in [1, 3, 8, 20]:
        tree = trie.draft(trie.match(context, min_match, max_match), context[-1], budget)
        assert tree.num_drafts == min(budget, len(candidates))
        paths = [()]
        for i in range(1, len(tree.tokens)):
            paths.append(paths[tree.parents[i]] + (int(tree.tokens[i]),))
        got = sorted((candidates[p] for p in paths[1:]), reverse=True)
        best = sorted(candidates.values(), reverse=True)[: tree.num_drafts]
        assert np.allclose(got, best, rtol=1e-12)


def test_draft_tree_branches_when_continuations_disagree():
    trie = NgramTrie(6, NodeBudget(1000))
    for seen in [[1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 6]]:
        trie.extend(trie.open_stream(), seen)
    query = trie.open_stream()
    trie.extend(query, [1])
    tree = trie.draft(trie.match([1], 1, 1), 1, budget=4)
    # 2 (p=2/3), 3 and 4 (2/3 each, their paths continue surely), then 5 (1/3): both branches.
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 2, 0]


def test_budget_caps_node_creation_and_counts_stay_sound():
    rng = np.random.default_rng(0)
    budget = NodeBudget(50)
    trie = NgramTrie(4, budget)
    prompt = [0, 1]
    outputs = fill(rng, trie, prompt, num_streams=2, length=60, vocab=6)
    expected = ngram_counts(prompt, outputs, 4)
    stored = dict(trie.items())
    assert trie.num_nodes == budget.used == len(stored) == 50
    assert all(0 < c <= expected[g] for g, c in stored.items())


def test_prune_evicts_rarest_longest_first_and_keeps_cursors_valid():
    rng = np.random.default_rng(1)
    depth = 5
    trie = NgramTrie(depth, NodeBudget(10**6))
    prompt = [0, 1, 2]
    root = trie.open_stream()
    trie.extend(root, prompt)
    streams = [trie.open_stream(fork_of=root) for _ in range(3)]
    outputs = [[] for _ in streams]
    for to_free in [10, 100, 300, 10**6]:
        for h, out in zip(streams, outputs):
            toks = rng.integers(8, size=25).tolist()
            trie.extend(h, toks)
            out += toks
        before = dict(trie.items())
        freed = trie.prune(to_free)
        after = dict(trie.items())
        assert trie.num_nodes == len(after) == len(before) - freed == trie.budget.used
        # Kept regardless: the n-grams cursors stand on (suffixes of each stream) and their prefixes.
        on_cursor = {tuple(s[len(s) - k : len(s) - k + j]) for s in [prompt] + [prompt + o for o in outputs]
                     for k in range(1, depth + 1) for j in range(1, k + 1)}
        evictable = set(before) - on_cursor
        assert freed == min(to_free, len(evictable))
        rank = lambda g: (before[g], -len(g))  # noqa: E731
        evicted, spared = set(before) - set(after), set(after) - on_cursor
        assert evicted <= evictable
        assert not spared or max(map(rank, evicted)) <= min(map(rank, spared))
        assert all(after[g] == before[g] for g in after)
    expected = ngram_counts(prompt, outputs, depth)
    assert all(0 < c <= expected[g] for g, c in trie.items())  # nothing invented; evicted ones recount
    for h, out in zip(streams, outputs):  # cursors still spell their streams' suffixes
        trie.extend(h, [7])
        s = prompt + out + [7]
        assert all(trie.count_of(s[-n:]) >= 1 for n in range(1, depth + 1))


def test_closed_streams_are_unknown():
    trie = NgramTrie(3, NodeBudget(100))
    h = trie.open_stream()
    trie.close_stream(h)
    with pytest.raises(KeyError, match="no open stream"):
        trie.extend(h, [1])


@pytest.mark.parametrize("seed", range(5))
def test_resync_skips_tokens_without_counting_them(seed):
    """After a gap, a stream counts an n-gram ending in the new tokens iff it lies after the
    gap or its part before lies in the longest suffix of the context the trie already knew."""
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(2, 6))
    trie = NgramTrie(depth, NodeBudget(10**6))
    before, skipped, after = (rng.integers(3, size=k).tolist() for k in (30, 5, 20))
    s = trie.open_stream()
    trie.extend(s, before)
    known = Counter(dict(trie.items()))
    trie.resync(s, before + skipped)
    trie.extend(s, after)

    context = before + skipped
    m = 0  # the longest known suffix of the context (every shorter one is known too)
    while m < depth and known[tuple(context[len(context) - m - 1 :])]:
        m += 1
    expected = Counter(known)
    full = context + after
    for j in range(len(after)):
        end = len(context) + j + 1
        for n in range(1, min(depth, m + j + 1) + 1):
            expected[tuple(full[end - n : end])] += 1
    assert dict(trie.items()) == dict(expected)
