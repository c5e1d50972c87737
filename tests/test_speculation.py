"""Speculation is lossless, helps where it should, and reports what it did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine_probes import count_chained, draft_every_other_step
from rollout import Engine, SamplingParams, SpecConfig
from rollout.datasets import arithmetic_tasks, chat_prompt_ids
from rollout.sampler import SamplingTensors, sample, sequence_key
from rollout.wandb_log import WandbLogger
from spec.budget import PROBE_EVERY as PROBE_EVERY_STEPS
from spec.tree import DraftTree
from spec.verify import accept_paths
from wandb_records import history

QUESTIONS = [
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list, then the same for the product.",
    arithmetic_tasks(1, seed=3)[0].question,
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def spec_engine(default_model_dir):
    return Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")


@pytest.fixture(scope="module")
def prompts(default_engine):
    return [chat_prompt_ids(default_engine.tokenizer, q) for q in QUESTIONS]


def run(engine, prompts, params):
    return [o for group in engine.generate(prompts, params, return_logprob=True) for o in group]


def test_spec_on_matches_spec_off_greedy_with_groups_and_stop_strings(default_engine, spec_engine, prompts):
    params = [
        SamplingParams(temperature=0, max_new_tokens=40),
        SamplingParams(temperature=0, max_new_tokens=40, n=2),
        SamplingParams(temperature=0, max_new_tokens=40, stop=["\n\n", "5"]),
        SamplingParams(temperature=0, max_new_tokens=40, stop=[","], n=2),
    ]
    off, on = run(default_engine, prompts, params), run(spec_engine, prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    for a, b in zip(off, on):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    drafted = sum(o.spec["draft_tokens"] for o in on)
    accepted = sum(o.spec["accepted_tokens"] for o in on)
    assert drafted > 0 and accepted > 0  # not vacuous: drafts were made and taken


def test_a_verify_step_says_whether_a_draft_was_rejected_or_the_drafts_ran_out(spec_engine, prompts):
    """The budget counts rejected draft tokens: `rejected` must mean that the node the accepted
    tokens lead to has children in the tree, followed here by token rather than by layout index."""
    emit_trees, seen = spec_engine.runner._emit_trees, []

    def recorded(step, *results):
        out = emit_trees(step, *results)
        seen.extend((step.trees[e.seq.seq_id], e) for e in out if e.drafted)
        return out

    spec_engine.runner._emit_trees = recorded
    try:
        run(spec_engine, prompts, SamplingParams(temperature=0, max_new_tokens=40))
    finally:
        spec_engine.runner._emit_trees = emit_trees
    outcomes = set()
    for tree, e in seen:
        kids, node = tree.children(), 0
        for token in e.tokens[: e.accepted]:
            node = next(k for k in kids[node] if tree.tokens[k] == token)
        assert e.rejected == bool(kids[node])
        outcomes.add(e.rejected)
    assert outcomes == {True, False}  # both cases occurred


def test_sampled_outputs_spec_on_equal_spec_off_for_every_seed(default_engine, spec_engine, prompts):
    """With counter-based randomness each token is drawn with the same key either way, so the
    first-k-token distributions agree because the draws agree, seed by seed."""
    params = SamplingParams(n=8, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=11)
    off, on = run(default_engine, prompts[:2], params), run(spec_engine, prompts[:2], params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert len({tuple(o.token_ids[:4]) for o in off}) > 4  # really sampling
    assert sum(o.spec["accepted_tokens"] for o in on) > 0


def test_a_decode_step_chained_after_a_verify_step_changes_no_output(default_engine, default_model_dir, prompts):
    """The overlap schedule launches a decode step before the verify step it follows is collected:
    its input token, position and KV slot come from the accepted paths found on the device."""
    engine = Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")
    draft_every_other_step(engine)
    chained = count_chained(engine)
    greedy = [SamplingParams(temperature=0, max_new_tokens=40, n=2), SamplingParams(temperature=0, max_new_tokens=40, stop=[","])]
    sampled = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=16, seed=5)
    for params, some in ((greedy * 2, prompts), (sampled, prompts[:2])):
        off, on = run(default_engine, some, params), run(engine, some, params)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
        for a, b in zip(off, on):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert chained[1] > 10 and engine.stats()["rollout/spec_accepted_tokens"] > 10
    assert engine.pool.used_slots == 0


def node_logits(prefix: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed toy target model: logits after `prefix`, different for every prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(vocab, generator=g) * 1.5


def test_tree_verification_emits_exactly_the_target_distribution():
    """Monte Carlo over 200k keys: the first two tokens emitted through a draft tree (plus the
    next plain step when the walk stops at the root) follow p(x) p(y | x) of the target."""
    vocab, trials = 5, 200_000
    # root -> {1, 3}; 1 -> {0}; 3 -> {2, 4}
    tree = DraftTree(np.array([7, 1, 3, 0, 2, 4]), np.array([-1, 0, 0, 1, 2, 2]))
    prefixes = [(), (1,), (3,), (1, 0), (3, 2), (3, 4)]
    depths = tree.depths()
    keys = torch.tensor([sequence_key(99, i) for i in range(trials)], dtype=torch.int64)

    def draw(logits_rows: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
        n = len(logits_rows)
        st = SamplingTensors(
            temperature=torch.full((n,), 0.8), top_k=torch.full((n,), -1, dtype=torch.int64),
            top_p=torch.ones(n), min_p=torch.zeros(n), keys=keys[:n], positions=positions,
            all_greedy=False, any_truncation=False,
        )
        return sample(logits_rows, st)[0].numpy()

    targets = np.stack(
        [draw(node_logits(p, vocab).expand(trials, vocab), torch.full((trials,), int(d))) for p, d in zip(prefixes, depths)],
        axis=1,
    )  # [trials, nodes]
    first, second = np.empty(trials, np.int64), np.full(trials, -1, np.int64)
    for t in range(trials):
        path, bonus = accept_path(tree, targets[t])
        emitted = [int(x) for x in tree.tokens[path[1:]]] + [bonus]
        first[t] = emitted[0]
        if len(emitted) > 1:
            second[t] = emitted[1]
    stopped = second < 0  # the walk emitted only the bonus: the next plain step draws at position 1
    cont = torch.stack([node_logits((int(x),), vocab) for x in first[stopped]])
    second[stopped] = draw_at(cont, keys[stopped], position=1)

    p1 = torch.softmax(node_logits((), vocab) / 0.8, -1).double()
    expected = np.array([[p1[x] * torch.softmax(node_logits((x,), vocab) / 0.8, -1).double()[y] for y in range(vocab)]
                         for x in range(vocab)]).ravel() * trials
    observed = np.bincount(first * vocab + second, minlength=vocab * vocab)
    expected *= observed.sum() / expected.sum()  # float32 softmax sums to 1 only within rounding
    assert chisquare(observed, expected).pvalue > 0.001


def draw_at(logits_rows: torch.Tensor, keys: torch.Tensor, position: int) -> np.ndarray:
    n = len(logits_rows)
    st = SamplingTensors(
        temperature=torch.full((n,), 0.8), top_k=torch.full((n,), -1, dtype=torch.int64), top_p=torch.ones(n),
        min_p=torch.zeros(n), keys=keys, positions=torch.full((n,), position), all_greedy=False, any_truncation=False,
    )
    return sample(logits_rows, st)[0].numpy()


def accept_path(tree: DraftTree, targets: np.ndarray) -> tuple[list[int], int]:
    """The walk for one tree laid out alone: (accepted nodes, root first; bonus token)."""
    (path,) = accept_paths(tree.parents.astype(np.int64), tree.tokens, np.asarray(targets), [0])
    return path, int(targets[path[-1]])


def test_greedy_walk_accepts_the_longest_matching_path():
    tree = DraftTree(np.array([7, 1, 3, 0, 2, 4]), np.array([-1, 0, 0, 1, 2, 2]))
    path, bonus = accept_path(tree, np.array([3, 9, 4, 9, 9, 8]))  # root draws 3, node 2 draws 4, node 5 draws 8
    assert path == [0, 2, 5] and bonus == 8
    path, bonus = accept_path(tree, np.array([2, 0, 0, 0, 0, 0]))
    assert path == [0] and bonus == 2


def test_step_wide_walk_matches_a_plain_walk_of_each_tree():
    rng = np.random.default_rng(3)
    trees, drawn = [], []
    for _ in range(40):
        n = int(rng.integers(1, 12))
        parents = [-1] + [int(rng.integers(i)) for i in range(1, n)]
        tokens = [int(rng.integers(4))]
        for i in range(1, n):  # siblings carry distinct tokens
            taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
            tokens.append(next(t for t in rng.permutation(12).tolist() if t not in taken))
        trees.append(DraftTree(np.array(tokens), np.array(parents)))
        drawn.append(rng.integers(4, size=n))  # few values, so that drafts often match
    offsets = np.cumsum([0] + [len(t.tokens) for t in trees])
    parents = np.concatenate([np.where(t.parents >= 0, t.parents + o, -1) for t, o in zip(trees, offsets)])
    paths = accept_paths(parents, np.concatenate([t.tokens for t in trees]), np.concatenate(drawn), offsets[:-1].tolist())
    for tree, targets, offset, path in zip(trees, drawn, offsets, paths):  # against a plain walk of each tree
        children, walk = tree.children(), [0]
        while (nxt := next((c for c in children[walk[-1]] if tree.tokens[c] == targets[walk[-1]]), None)) is not None:
            walk.append(nxt)
        assert (np.array(path) - offset).tolist() == walk


def test_sibling_sharing_raises_accept_length(default_model_dir, capsys):
    task = arithmetic_tasks(1, seed=0)[0]
    lengths = {}
    for share in (True, False):
        eng = Engine(model=str(default_model_dir), device="cpu",
                     spec=SpecConfig(method="ngram", share_siblings=share, adaptive=False), kv_cache_tokens=8192)
        prompt = chat_prompt_ids(eng.tokenizer, task.question)
        eng.generate([prompt], SamplingParams(n=8, temperature=0.7, max_new_tokens=48, seed=5))
        lengths[share] = eng.stats()["rollout/spec_accept_length"]
    with capsys.disabled():
        print(f"\naccept length, 8 samples at T=0.7: with sibling sharing {lengths[True]:.3f}, "
              f"without {lengths[False]:.3f}")
    assert lengths[True] > lengths[False]


def test_acceptance_statistics_reach_stats_and_wandb(spec_engine, prompts, tmp_path):
    spec_engine.reset_stats()
    outs = run(spec_engine, prompts[:2], SamplingParams(temperature=0, max_new_tokens=24))
    stats = spec_engine.stats()
    assert stats["rollout/spec_draft_tokens"] == sum(o.spec["draft_tokens"] for o in outs) > 0
    assert stats["rollout/spec_draft_tokens/ngram"] == stats["rollout/spec_draft_tokens"]
    assert 0 < stats["rollout/spec_accept_rate"] <= 1 and stats["rollout/spec_accept_length"] >= 1
    logger = WandbLogger("rollout-test", directory=tmp_path)
    logger.log(stats, step=1)
    logger.finish()
    (row,) = history(logger.run_dir)
    for key in ["rollout/spec_accept_rate", "rollout/spec_accept_length", "rollout/spec_draft_tokens",
                "rollout/spec_accept_rate/ngram", "rollout/spec_draft_tokens/ngram", "rollout/tokens_per_s",
                "rollout/weight_version", "rollout/weight_sync_s"]:
        assert row[key] == pytest.approx(stats[key])


class _ShortShadow:
    """A CPU step's result posing as an asynchronous device that is done at the second poll."""

    overlaps_host = True

    def __init__(self, result):
        self.wait = result.wait
        self.polls = 0

    def done(self) -> bool:
        self.polls += 1
        return self.polls > 1


def test_trie_upkeep_stays_in_the_device_shadow_and_changes_no_output(default_engine, default_model_dir, prompts):
    """A shadow too short for the upkeep: sequences that fall more than a step behind skip
    tokens (the step does not wait), and drafts from the poorer trie still give spec-off's tokens."""
    engine = Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")
    launch = engine.runner.launch

    def short_shadow_launch(batch, trees, after=None):
        step = launch(batch, trees, after)
        step.result = _ShortShadow(step.result)  # room for one poll's worth of updates
        return step

    for_batch, calls = engine.budget.for_batch, []

    def every_twelfth_step_drafts(seqs):  # the other steps leave the upkeep to their shadow
        calls.append(1)
        return for_batch(seqs) if len(calls) % 12 == 0 else {}

    engine.runner.launch = short_shadow_launch
    engine.budget.for_batch = every_twelfth_step_drafts
    params = SamplingParams(temperature=0, max_new_tokens=40, n=8)  # 16 sequences: 8 fit a shadow
    on, off = run(engine, prompts[:2], params), run(default_engine, prompts[:2], params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for a, b in zip(on, off):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    st = engine.stats()
    assert st["rollout/drafter_dropped_tokens"] > 0 and st["rollout/drafter_shadow_s"] > 0
    assert st["rollout/spec_draft_tokens"] > 0  # drafts were verified after tokens were skipped
    assert len(engine.upkeep) == 0  # idle: nothing left queued


def test_a_batch_too_large_to_draft_is_not_fed_and_smaller_ones_skip_ahead(default_model_dir, prompts):
    """Verify room for no draft token per sequence (16 sequences, 16 verify tokens): the tries
    count none of those steps' tokens; once one request is left, its samples skip ahead and
    are fed again."""
    engine = Engine(model=str(default_model_dir), device="cpu",
                    spec=SpecConfig(method="ngram", max_verify_tokens=16))
    short, long = (SamplingParams(temperature=0.8, max_new_tokens=k, n=8, seed=1, ignore_eos=True) for k in (6, 24))
    reqs = [engine.add_request(prompts[0], short), engine.add_request(prompts[1], long)]
    while not reqs[0].finished:
        engine.step()
    engine.drain()
    for seq in reqs[1].sequences:
        assert engine.drafter.fed(seq.seq_id) == len(prompts[1])  # 16 sequences ran: nothing fed
    while engine.has_work:
        engine.step()
    assert all(len(s.output_ids) == 24 for s in reqs[1].sequences)
    assert engine.stats()["rollout/drafter_dropped_tokens"] > 0  # skipped ahead once 8 were left


def test_a_sequence_drafts_only_once_its_prompts_trie_is_built_in_the_shadow(default_engine, default_model_dir, prompts):
    """Each shadow builds one chunk of the prompt's trie; until it is whole no step drafts or
    counts as drafting (the overlap is not drained for it), and the drafts after it still give
    spec-off's tokens."""
    from spec.upkeep import BUILD_CHUNK

    engine = Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")
    launch, drafted = engine.runner.launch, []

    def short_shadow_launch(batch, trees, after=None):
        drafted.append(bool(trees))
        step = launch(batch, trees, after)
        step.result = _ShortShadow(step.result)  # room for one poll's worth of updates
        return step

    engine.runner.launch = short_shadow_launch
    params = SamplingParams(temperature=0, max_new_tokens=24, n=2)
    on, off = run(engine, prompts[1:2], params), run(default_engine, prompts[1:2], params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    chunks = -(-len(prompts[1]) // BUILD_CHUNK)
    assert not any(drafted[: chunks + 1]) and any(drafted)  # the prefill, then one chunk per shadow
    assert engine.stats()["rollout/draft_steps"] <= len(drafted) - chunks - 1  # those steps planned nothing


def test_a_planned_sequence_without_a_match_counts_as_a_failed_draft(default_model_dir, prompts):
    """Planning a draft drains the overlap pipeline, so a sequence the trie has nothing for is
    charged like a rejected draft (its chance falls with every such plan), and the step like a
    drafting step that emitted one token per sequence (its batch size's calibration falls): it is
    soon no longer planned (but for probes), instead of keeping the prior forever."""

    engine = Engine(model=str(default_model_dir), spec="ngram", device="cpu")
    engine.drafter.propose = lambda seq_id, context, budget: DraftTree.root_only(int(context[-1]))
    planned, chances = [], []

    def for_batch(seqs, plan=engine.budget.for_batch):
        chances.append(engine.budget.accept_chance(seqs[0].seq_id))
        planned.append(plan(seqs))
        return planned[-1]

    engine.budget.for_batch = for_batch
    run(engine, prompts[:1], SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True))
    assert chances == sorted(chances, reverse=True)  # every plan without a tree lowers it
    last = planned[-2 * PROBE_EVERY_STEPS:]
    assert sum(bool(plan) for plan in last) <= 2  # paused, but for probes
    assert chances[-1] < chances[0]
    st = engine.stats()
    assert st["rollout/spec_draft_tokens"] == 0
    # (a plan made while the sequence's last step was in flight is dropped when that step stops it)
    assert 0 < st["rollout/draft_steps"] == st["rollout/empty_draft_steps"] <= sum(bool(plan) for plan in planned)


def test_only_a_prompt_rolled_out_before_is_offered_a_first_look(default_model_dir, prompts):
    engine = Engine(model=str(default_model_dir), spec="ngram", device="cpu")
    params = SamplingParams(temperature=0, max_new_tokens=8, n=2)
    first = engine.add_request(prompts[0], params)
    assert not engine.budget._first_look  # a new prompt: the all-sequence average speaks for it
    while not first.finished:
        engine.step()
    again, other = engine.add_request(prompts[0], params), engine.add_request(prompts[1], params)
    assert engine.budget._first_look == {seq.seq_id for seq in again.sequences}
    while not (again.finished and other.finished):
        engine.step()
    assert not engine.budget._first_look
