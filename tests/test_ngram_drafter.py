import numpy as np
import pytest

from spec.ngram import NgramConfig, NgramDrafter
from spec.tree import DraftTree

PROMPT = [100, 101, 102]
ANSWER = list(range(10, 30))


def drafted_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down, root token first."""
    paths = [(int(tree.tokens[0]),)]
    for i in range(1, len(tree.tokens)):
        paths.append(paths[tree.parents[i]] + (int(tree.tokens[i]),))
    return paths


def first_draft(tree: DraftTree) -> int | None:
    return int(tree.tokens[1]) if tree.num_drafts else None


def test_propose_never_exceeds_budget_and_siblings_distinct():
    rng = np.random.default_rng(0)
    d = NgramDrafter(NgramConfig(max_match=3, max_draft_depth=40))
    d.add_group("g", PROMPT)
    contexts = {}
    for s in range(4):
        d.add_sequence("g", s)
        contexts[s] = list(PROMPT)
    for _ in range(300):
        s = int(rng.integers(4))
        toks = rng.integers(6, size=int(rng.integers(1, 4))).tolist()
        d.extend(s, toks)
        contexts[s] += toks
        budget = int(rng.integers(-1, 80))
        tree = d.propose(s, contexts[s], budget)
        assert tree.num_drafts <= max(0, min(budget, 63))
        assert tree.tokens[0] == contexts[s][-1] and tree.source == "ngram"
        for kids in tree.children():
            assert len({int(tree.tokens[k]) for k in kids}) == len(kids)
    assert d.propose(0, contexts[0], 63).num_drafts == 63  # a rich trie fills the largest tree


def test_sequence_drafts_from_its_own_output():
    d = NgramDrafter()
    d.add_group("g", PROMPT)
    d.add_sequence("g", 0)
    assert d.propose(0, PROMPT, 8).num_drafts == 0  # nothing after the prompt yet
    output = ANSWER + [55, 56] + ANSWER[:3]
    d.extend(0, output)
    assert drafted_paths(d.propose(0, PROMPT + output, 4))[-1] == tuple(ANSWER[2:7])


@pytest.mark.parametrize("share", [True, False])
def test_siblings_outputs_feed_each_other(share):
    d = NgramDrafter(NgramConfig(share_siblings=share))
    d.add_group("g", PROMPT)
    d.add_sequence("g", 0)
    d.add_sequence("g", 1)
    d.extend(0, ANSWER)
    assert first_draft(d.propose(1, PROMPT, 8)) == (ANSWER[0] if share else None)  # from the prompt's end
    d.extend(1, ANSWER[:5])
    tree = d.propose(1, PROMPT + ANSWER[:5], 8)
    if share:
        assert drafted_paths(tree)[-1] == tuple(ANSWER[4:13])
    else:
        assert tree.num_drafts == 0


def test_history_survives_remove_group_and_is_reused():
    d = NgramDrafter()
    d.add_group("epoch0", PROMPT)
    for s in range(2):
        d.add_sequence("epoch0", s)
    d.extend(0, ANSWER)
    d.extend(1, [7, 8, 9])
    d.remove_sequence(0)
    nodes = d.memory_nodes()
    d.remove_group("epoch0")  # also removes sequence 1
    assert d.memory_nodes() == nodes
    with pytest.raises(KeyError):
        d.propose(1, PROMPT, 4)

    d.add_group("other", [5, 6, 7])
    d.add_sequence("other", 10)
    assert d.propose(10, [5, 6, 7], 8).num_drafts == 0  # another prompt does not see this history
    d.add_group("epoch1", PROMPT)
    d.add_sequence("epoch1", 20)
    tree = d.propose(20, PROMPT, 8)
    assert sorted(int(tree.tokens[k]) for k in tree.children()[0]) == sorted([ANSWER[0], 7])  # both earlier samples
    d.extend(20, ANSWER[:2])
    assert drafted_paths(d.propose(20, PROMPT + ANSWER[:2], 3))[-1] == tuple(ANSWER[1:5])


def test_prompt_is_counted_once_across_epochs():
    d = NgramDrafter()
    d.add_group("a", PROMPT)
    d.add_sequence("a", 0)
    d.propose(0, PROMPT, 4)  # builds the prompt's trie
    nodes = d.memory_nodes()
    d.remove_group("a")
    for group, seq_id in (("b", 1), ("c", 2)):  # the same prompt twice at once shares one trie
        d.add_group(group, PROMPT)
        d.add_sequence(group, seq_id)
        d.propose(seq_id, PROMPT, 4)
    assert d.memory_nodes() == nodes


def test_a_prompts_trie_is_built_when_a_sample_first_needs_it():
    d = NgramDrafter()
    d.add_group("a", PROMPT)
    d.add_sequence("a", 0)
    assert d.memory_nodes() == 0 and d.fed(0) == len(PROMPT)  # admission builds nothing
    assert not d.knows_prompt(PROMPT)
    d.remove_group("a")
    assert not d.knows_prompt(PROMPT)  # never built, so no history: it would hold the prompt only
    d.add_group("b", PROMPT)
    d.add_sequence("b", 1)
    d.add_sequence("b", 2)
    d.extend(1, ANSWER)  # the first feed builds the prompt's trie, then counts the sample
    assert d.memory_nodes() > 0 and d.knows_prompt(PROMPT)
    assert drafted_paths(d.propose(2, PROMPT, 3))[-1] == (PROMPT[-1], *ANSWER[:3])  # a sibling never fed drafts from it
    d.add_sequence("b", 3)
    d.resync(3, PROMPT + ANSWER[:6], len(PROMPT) + 6)  # a stream first used to skip ahead
    assert d.fed(3) == len(PROMPT) + 6
    d.extend(3, ANSWER[6:8])
    assert d.fed(3) == len(PROMPT) + 8
    d.remove_group("b")
    assert d.knows_prompt(PROMPT)


def test_a_prompts_trie_is_built_in_chunks_and_drafts_only_when_whole():
    rng = np.random.default_rng(1)
    prompt = rng.integers(50, size=40).tolist()
    whole, chunked = NgramDrafter(), NgramDrafter()
    for d in (whole, chunked):
        d.add_group("g", prompt)
        d.add_sequence("g", 0)
        d.add_sequence("g", 1)
    whole.extend(0, ANSWER)  # built at once by the first feed
    assert [chunked.build(0, 16), chunked.ready(1), chunked.build(1, 16)] == [False, False, False]
    assert 0 < chunked.memory_nodes() < whole.memory_nodes() and not chunked.knows_prompt(prompt)
    assert chunked.build(0, 16) and chunked.ready(1) and chunked.build(1, 16)  # 40 tokens: a third chunk
    chunked.extend(0, ANSWER)
    assert chunked.memory_nodes() == whole.memory_nodes()  # the same n-grams, counted once
    assert dict(chunked._live[tuple(prompt)].trie.items()) == dict(whole._live[tuple(prompt)].trie.items())
    assert drafted_paths(chunked.propose(1, prompt, 4)) == drafted_paths(whole.propose(1, prompt, 4))

    partial = NgramDrafter()
    partial.add_group("g", prompt)
    partial.add_sequence("g", 0)
    partial.build(0, 16)
    partial.remove_group("g")  # never ready: no history, and its nodes are given back
    assert partial.memory_nodes() == 0 and not partial.knows_prompt(prompt)
    assert not partial.ready(0)  # unknown sequences are not ready


def test_history_is_lru_bounded():
    d = NgramDrafter(NgramConfig(max_history_prompts=2))
    prompts = {p: [p, p + 1, p + 2] for p in (100, 200, 300)}
    for p, prompt in prompts.items():
        d.add_group(p, prompt)
        d.add_sequence(p, p)
        d.extend(p, [p + 50, p + 51])
        d.remove_group(p)
    # The oldest prompt (100) went when the third arrived; reuse 200 so that 300 is now oldest.
    for p in (200, 100, 400):
        d.add_group(p, prompts.get(p, [400, 401]))
        d.add_sequence(p, p + 1)
    assert first_draft(d.propose(201, prompts[200], 4)) == 250
    assert first_draft(d.propose(101, prompts[100], 4)) is None
    d.remove_group(200)
    d.remove_group(100)  # history: 300, 200, 100 -> 300 dropped
    d.add_group(300, prompts[300])
    d.add_sequence(300, 301)
    assert first_draft(d.propose(301, prompts[300], 4)) is None


def test_private_tries_are_freed_without_sharing():
    d = NgramDrafter(NgramConfig(share_siblings=False))
    d.add_group("g", PROMPT)
    for s in range(3):
        d.add_sequence("g", s)
        d.extend(s, ANSWER)
    assert d.memory_nodes() > 0
    d.remove_sequence(0)
    d.remove_group("g")
    assert d.memory_nodes() == 0


def test_unknown_and_duplicate_ids_raise_clear_errors():
    d = NgramDrafter()
    with pytest.raises(KeyError, match="unknown group"):
        d.add_sequence("nope", 0)
    with pytest.raises(KeyError, match="unknown sequence 3"):
        d.propose(3, PROMPT, 4)
    with pytest.raises(KeyError, match="unknown sequence 3"):
        d.extend(3, [1])
    with pytest.raises(KeyError, match="unknown sequence 3"):
        d.remove_sequence(3)
    with pytest.raises(KeyError, match="unknown group"):
        d.remove_group("nope")
    with pytest.raises(ValueError, match="empty"):
        d.add_group("g", [])
    d.add_group("g", PROMPT)
    d.add_sequence("g", 0)
    with pytest.raises(ValueError, match="already exists"):
        d.add_group("g", PROMPT)
    with pytest.raises(ValueError, match="already exists"):
        d.add_sequence("g", 0)
    d.remove_sequence(0)
    with pytest.raises(KeyError, match="already removed"):
        d.remove_sequence(0)
    with pytest.raises(ValueError, match="min_match"):
        NgramConfig(min_match=3, max_match=2)


def ngrams_of(stream: list[int], max_len: int) -> set[tuple[int, ...]]:
    return {tuple(stream[i : i + n]) for n in range(1, max_len + 1) for i in range(len(stream) - n + 1)}


@pytest.mark.parametrize("share", [True, False])
def test_memory_stays_under_bound_on_long_run_and_drafts_remain_valid(share):
    """Many prompts re-sampled over epochs, groups interleaved, under a small node bound: history is
    dropped and live tries pruned; every tree must stay a continuation of what that prompt's samples
    (or, without sharing, that sample alone) actually produced."""
    rng = np.random.default_rng(7 if share else 8)
    cfg = NgramConfig(max_match=3, max_draft_depth=5, max_trie_nodes=3000, max_history_prompts=6, share_siblings=share)
    d = NgramDrafter(cfg)
    prompts = [rng.integers(12, size=int(rng.integers(2, 20))).tolist() for _ in range(12)]
    seen: dict[int, set] = {p: set() for p in range(len(prompts))}  # n-grams produced under each prompt
    groups, contexts, next_id, peak, drafted_late = {}, {}, 0, 0, 0
    for step in range(3000):
        r = rng.random()
        if len(groups) < 4 and r < 0.05:
            p = int(rng.integers(len(prompts)))
            gid, next_id = next_id, next_id + 1
            d.add_group(gid, prompts[p])
            groups[gid] = (p, [])
            for _ in range(int(rng.integers(1, 5))):
                sid, next_id = next_id, next_id + 1
                d.add_sequence(gid, sid)
                groups[gid][1].append(sid)
                contexts[sid] = list(prompts[p])
        elif groups and r < 0.07:
            gid = list(groups)[int(rng.integers(len(groups)))]
            for sid in groups.pop(gid)[1]:
                contexts.pop(sid, None)
            d.remove_group(gid)
        elif contexts and r < 0.08:
            sid = list(contexts)[int(rng.integers(len(contexts)))]
            d.remove_sequence(sid)
            del contexts[sid]
            next(g for g in groups.values() if sid in g[1])[1].remove(sid)
        elif contexts:
            sid = list(contexts)[int(rng.integers(len(contexts)))]
            p = next(g[0] for g in groups.values() if sid in g[1])
            # Samples of one prompt mostly follow a shared pattern, as RL samples do.
            toks = [(contexts[sid][-1] * 5 + int(rng.integers(3))) % 40 for _ in range(int(rng.integers(1, 4)))]
            d.extend(sid, toks)
            contexts[sid] += toks
            own = ngrams_of(contexts[sid][-(len(toks) + cfg.max_depth) :], cfg.max_depth)
            seen[p] |= own
            tree = d.propose(sid, contexts[sid], int(rng.integers(1, 20)))
            allowed = seen[p] if share else ngrams_of(contexts[sid], cfg.max_depth)
            assert tree.tokens[0] == contexts[sid][-1]
            for path in drafted_paths(tree)[1:]:
                assert path in allowed or (share and path in ngrams_of(prompts[p], cfg.max_depth))
            drafted_late += step > 2000 and tree.num_drafts > 0
        assert d.memory_nodes() <= cfg.max_trie_nodes
        peak = max(peak, d.memory_nodes())
    assert peak > 0.9 * cfg.max_trie_nodes  # the bound was binding, so eviction ran
    assert drafted_late > 50  # and drafting still works after it


def test_upkeep_feeds_what_fits_skips_ahead_when_behind_and_never_drops_lifecycle():
    from types import SimpleNamespace

    from spec.upkeep import POLL_EVERY, DrafterUpkeep

    drafter = NgramDrafter(NgramConfig(max_match=2, max_draft_depth=2))
    upkeep = DrafterUpkeep(drafter, max_step_tokens=3)
    prompt = [1, 2, 3]
    upkeep.lifecycle(lambda: drafter.add_group("g", prompt))
    seqs = [SimpleNamespace(seq_id=i, tokens=list(prompt)) for i in range(2 * POLL_EVERY)]
    for s in seqs:
        upkeep.lifecycle(lambda s=s: drafter.add_sequence("g", s.seq_id))
    upkeep.apply()
    assert [drafter.fed(s.seq_id) for s in seqs] == [3] * len(seqs)

    def device_done_after(polls: int):  # a device that is busy for `polls` polls of the upkeep
        answers = iter([False] * polls)
        return lambda: next(answers, True)

    upkeep.step(seqs)
    upkeep.apply(until=device_done_after(0))  # no shadow at all (a host-bound step): nothing is fed
    upkeep.drop_unfed_steps()
    assert [drafter.fed(s.seq_id) for s in seqs] == [3] * len(seqs)
    for step in range(5):  # five steps of one token each; each shadow feeds the first POLL_EVERY
        upkeep.step(seqs)
        for s in seqs:
            s.tokens.append(10 + step)
        upkeep.apply(until=device_done_after(1))
        upkeep.drop_unfed_steps()
    fed = [drafter.fed(s.seq_id) for s in seqs]
    assert fed[:POLL_EVERY] == [8] * POLL_EVERY and fed[POLL_EVERY:] == [3] * POLL_EVERY
    assert len(upkeep) == 0

    upkeep.step(seqs)
    upkeep.lifecycle(lambda: drafter.remove_sequence(seqs[0].seq_id))
    upkeep.apply(until=device_done_after(0))
    upkeep.drop_unfed_steps()
    assert len(upkeep) == 1  # the unfed step is dropped, the removal is not
    upkeep.apply(until=device_done_after(0))  # a lifecycle update at the head needs no shadow
    assert len(upkeep) == 0
    with pytest.raises(KeyError):
        drafter.fed(seqs[0].seq_id)
    upkeep.step(seqs[1:])
    upkeep.apply()  # the lagging ones skip 2 of their 5 unfed tokens and take the last 3
    assert [drafter.fed(s.seq_id) for s in seqs[POLL_EVERY:]] == [8] * POLL_EVERY
    assert upkeep.dropped_tokens == 2 * POLL_EVERY
    # the skipped tokens' n-grams were never counted: (3, 10) only in the first POLL_EVERY samples' trie paths
    trie = drafter._live[tuple(prompt)].trie
    assert trie.count_of([3, 10]) == POLL_EVERY


def _upkeep_of_two_samples(prompt_chunks: int):
    """An upkeep with one prompt of `prompt_chunks` build chunks (the last one a single token)
    and two samples that have each emitted one token, none of it applied yet."""
    from types import SimpleNamespace

    from spec.upkeep import BUILD_CHUNK, DrafterUpkeep

    prompt = list(range(100, 100 + (prompt_chunks - 1) * BUILD_CHUNK + 1))
    drafter = NgramDrafter()
    upkeep = DrafterUpkeep(drafter, max_step_tokens=3)
    upkeep.lifecycle(lambda: drafter.add_group("g", prompt))
    seqs = [SimpleNamespace(seq_id=i, tokens=[*prompt, 7]) for i in range(2)]
    for s in seqs:
        upkeep.lifecycle(lambda s=s: drafter.add_sequence("g", s.seq_id))
    return prompt, drafter, upkeep, seqs


def test_upkeep_builds_a_long_prompts_trie_a_chunk_per_poll_before_feeding_its_samples():
    from spec.upkeep import BUILD_CHUNK

    prompt, drafter, upkeep, seqs = _upkeep_of_two_samples(prompt_chunks=4)
    upkeep.step(seqs)
    built = []
    for _ in range(3):  # a shadow of one poll builds one chunk, and the step is dropped after it
        polls = iter([False])
        upkeep.apply(until=lambda: next(polls, True))
        upkeep.drop_unfed_steps()
        built.append(drafter._live[tuple(prompt)].counted)
        upkeep.step(seqs)
    assert built == [BUILD_CHUNK, 2 * BUILD_CHUNK, 3 * BUILD_CHUNK] and not drafter.ready(0)
    assert [drafter.fed(s.seq_id) for s in seqs] == [len(prompt)] * 2  # nothing fed before the trie is whole
    upkeep.apply()
    assert drafter.ready(0) and [drafter.fed(s.seq_id) for s in seqs] == [len(prompt) + 1] * 2


def test_upkeep_without_any_shadow_still_builds_a_chunk_per_step_and_feeds_nothing():
    # where every step is host-bound (eager steps), tries must still become whole
    from spec.upkeep import BUILD_CHUNK

    prompt, drafter, upkeep, seqs = _upkeep_of_two_samples(prompt_chunks=3)
    built = []
    for _ in range(4):
        upkeep.step(seqs)
        upkeep.apply(until=lambda: True)
        upkeep.drop_unfed_steps()
        built.append(drafter._live[tuple(prompt)].counted)
    assert built == [BUILD_CHUNK, 2 * BUILD_CHUNK, len(prompt), len(prompt)] and drafter.ready(0)
    assert [drafter.fed(s.seq_id) for s in seqs] == [len(prompt)] * 2  # no feeding without a shadow
    assert len(upkeep) == 0


def test_drafts_from_the_context_even_when_its_newest_tokens_are_not_yet_fed():
    # the engine proposes before the last step's tokens reach the trie (spec/upkeep.py)
    d = NgramDrafter()
    d.add_group("g", PROMPT)
    d.add_sequence("g", 0)
    d.add_sequence("g", 1)
    d.extend(0, ANSWER)
    d.extend(1, ANSWER[:5])
    tree = d.propose(1, PROMPT + ANSWER[:7], 3)  # two tokens emitted but not yet fed
    assert int(tree.tokens[0]) == ANSWER[6]
    assert drafted_paths(tree)[-1] == tuple(ANSWER[6:10])
