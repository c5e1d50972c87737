"""Speculation on the device: spec on equals spec off through preemption and weight updates, every
token is indexed the step it is made, history is bounded and drafts for the next epoch, the budget
chooses widths from costs and acceptance, and the acceptance it reads off returned trees is exact."""

from __future__ import annotations

import numpy as np
import pytest

from rollout import Engine, SamplingParams, SpecConfig
from rollout.tools.datasets import chat_prompt_ids
from spec.budget import REFRESH_EVERY, SHADOW_EVERY, DraftBudget
from spec.speculator import Speculator, _Trees

QUESTIONS = [
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list, then the same for the product.",
    "Count from one to twenty, separated by commas.",
]
FIXED = SpecConfig(method="ngram", adaptive=False)


@pytest.fixture(scope="module")
def prompts(default_engine):
    return [chat_prompt_ids(default_engine.tokenizer, q) for q in QUESTIONS]


def outputs(engine, prompts, params):
    return [o for group in engine.generate(prompts, params, return_logprob=True) for o in group]


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0) <= 1e-5


def test_greedy_spec_on_equals_spec_off_through_preemption(default_model_dir, default_engine, prompts):
    params = SamplingParams(temperature=0, n=2, max_new_tokens=32, ignore_eos=True)
    small = dict(device="cpu", kv_cache_tokens=180)  # the pool runs dry: sequences are preempted and recomputed
    off = Engine(model=str(default_model_dir), spec="off", **small)
    on = Engine(model=str(default_model_dir), spec=FIXED, **small)
    same(outputs(off, prompts[:2], params), outputs(on, prompts[:2], params))
    assert on.scheduler.num_preempted > 0 and on.stats()["rollout/spec_accepted_tokens"] > 0
    assert on.pool.used_slots == 0


def test_greedy_spec_on_equals_spec_off_with_a_weight_update_in_the_middle(default_model_dir, prompts):
    params = SamplingParams(temperature=0, n=2, max_new_tokens=28, ignore_eos=True)
    runs = []
    for spec in ("off", FIXED):
        engine = Engine(model=str(default_model_dir), spec=spec, device="cpu")
        reqs = [engine.add_request(p, params, return_logprob=True) for p in prompts[:2]]
        for _ in range(8):
            engine.step()
        name, target = "model.norm.weight", engine.model.weight_targets()["model.norm.weight"]
        engine.update_weights([(name, target.view().clone() * 1.05)])  # running sequences are recomputed
        while engine.has_work:
            engine.step()
        runs.append([engine.output(s) for r in reqs for s in r.sequences])
        assert {v for o in runs[-1] for v in o.weight_versions} == {0, 1}
    off, on = runs
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    # each run switched versions after its own number of tokens: compare where both used the same weights
    both = [(x, y) for a, b in zip(off, on) for x, y, u, v in zip(a.logprobs, b.logprobs, a.weight_versions, b.weight_versions)
            if u == v]
    assert len(both) > 60 and max(abs(x - y) for x, y in both) <= 1e-5


def test_every_emitted_token_is_indexed_as_it_is_made(model_dir):
    engine = Engine(model=str(model_dir), spec=FIXED, device="cpu")
    prompts = [[5, 9, 13] * 4, [7, 8] * 5, [21, 22, 23, 24]]
    reqs = [engine.add_request(p, SamplingParams(temperature=0.8, n=3, max_new_tokens=40, seed=s))
            for s, p in enumerate(prompts)]
    seqs = [s for r in reqs for s in r.sequences]
    while engine.has_work:
        engine.step()
        found, total = engine.indexed([s for s in seqs if not s.finished])  # running rows, against the host's tokens
        assert found == total
    found, total = engine.indexed(seqs)  # finished ones, in their history rows
    assert found == total == sum(s.num_output for s in seqs) > 0


def test_history_is_bounded_and_drafts_the_next_epoch(model_dir):
    spec = SpecConfig(method="ngram", adaptive=False, history_rows=6, history_per_prompt=4)
    engine = Engine(model=str(model_dir), spec=spec, device="cpu")
    prompts = [[5, 9, 13] * 4, [7, 8] * 5, [21, 22, 23, 24]]
    params = SamplingParams(temperature=0.7, n=4, max_new_tokens=32, seed=7, ignore_eos=True)
    first = outputs(engine, prompts, params)
    assert engine.spec.index.history_rows_used == 6  # 12 samples finished, 6 rows: the oldest went
    engine.reset_stats()
    second = outputs(engine, prompts[2:], params)  # the newest epoch of this prompt is still there
    assert engine.spec.index.history_rows_used <= 6
    # same seeds, same tokens (counter-based draws): the history's drafts are what gets emitted
    assert [o.token_ids for o in second] == [o.token_ids for o in first[8:]]
    stats = engine.stats()
    assert stats["rollout/spec_accepted_tokens"] > 0.6 * stats["rollout/output_tokens"]  # most tokens were drafts
    assert stats["rollout/spec_accept_length"] > 3
    assert stats["rollout/spec_history_rows"] <= 6 and stats["rollout/spec_index_bytes"] > 0


def test_the_budget_drafts_only_when_measured_acceptance_pays_for_measured_costs():
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=512)
    assert budget.widths == [0, 1, 2, 4, 8]
    assert budget.plan(16, 10_000).width == 0  # a bucket's first steps measure plain decoding
    for _ in range(5):
        budget.observe_step(16, 0, 0.010, 0.004)
    assert budget.plan(16, 10_000).width == 0  # nothing known to be accepted
    budget.observe_acceptance(np.array([[0, 1, 2, 3, 3]] * 16, dtype=float))
    assert budget.acc.tolist() == pytest.approx([0, 0.3, 0.6, 0.9, 0.9])  # evaluations move it a share of the way
    budget.acc[:] = [0, 1, 2, 3, 3]  # (as after many such evaluations)
    assert budget.plan(16, 10_000).width == 4  # untried widths add nothing: the most accepted wins
    for w, extra in ((1, 0.001), (2, 0.002), (4, 0.030), (8, 0.070)):
        for _ in range(5):
            budget.observe_step(16, w, 0.010 + extra, 0.004)
    assert budget.plan(16, 10_000).width == 2  # (1 + 2) / 12 ms beats (1 + 1) / 11 ms and (1 + 3) / 40 ms
    for _ in range(5):  # the contexts grew: plain steps cost more, drafting adds what it did
        budget.observe_step(16, 0, 0.100, 0.004)
    assert budget.plan(16, 10_000).width == 4  # (1 + 3) / 130 ms now beats (1 + 2) / 102 ms
    for _ in range(5):  # the host lags plain steps: what the device adds is free up to its time...
        budget.observe_step(16, 0, 0.100, 0.200)
    assert budget.plan(16, 10_000).width == 4  # (1 + 3) / 130 ms (the host's 4 ms measured at width 4)
    for _ in range(5):  # ... but a width whose host time outgrows its gain loses
        budget.observe_step(16, 4, 0.130, 0.300)
    assert budget.plan(16, 10_000).width == 2  # (1 + 2) / 102 ms beats (1 + 3) / 300 ms and (1 + 0) / 200 ms
    assert budget.plan(128, 10_000).width == 0 and budget.plan(16, 40).width == 1  # 16 x 3 nodes need 48 slots
    widths = [budget.plan(16, 10_000).width for _ in range(4 * REFRESH_EVERY)]
    assert widths.count(0) == 4  # while drafting, a plain step now and then keeps the plain cost current
    fixed = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, adaptive=False)
    assert fixed.plan(16, 10_000).width == 8 and fixed.plan(64, 10_000).width == 4
    shadows = [fixed.plan(16, 10_000).shadow for _ in range(4 * SHADOW_EVERY)]
    assert sum(shadows) == 4


def test_trees_are_scored_by_the_tokens_the_sequence_emitted_after_them(default_model_dir):
    spec = Speculator(SpecConfig(method="ngram", max_draft_tokens=4), Engine(model=str(default_model_dir), spec="off",
                                                                               device="cpu").table)
    # root 9 -> 5 -> 6 -> 7 (nodes 1, 2, 4) and root -> 8 (node 3); the sequence went on 5 6 3
    tokens = np.array([[9, 5, 6, 8, 7]])
    parents = np.array([[-1, 0, 1, 0, 2]])

    class Seq:
        tokens = [1, 2, 9, 5, 6, 3]

    score = spec._score(_Trees([Seq()], np.array([3]), tokens, parents))
    assert score.tolist() == [[0, 1, 2, 2]]  # widths 0, 1, 2, 4 (node 4 guessed 7, not 3)
