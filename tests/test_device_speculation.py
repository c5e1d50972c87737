"""Speculation on the device: spec on equals spec off through preemption and weight updates, every
token is indexed the step it is made, history is bounded and drafts for the next epoch, the budget
chooses a step's draft rows from costs and acceptance, the acceptance it reads off returned trees
is exact, and the device keeps the drafts the host expects."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels.draft_rows import lay_out_drafts_ref
from kernels.ngram_draft import PADDING
from rollout import Engine, SamplingParams, SpecConfig
from rollout.tools.datasets import chat_prompt_ids
from spec.budget import ACCEPT_WEIGHT, FRACTIONS, MEASURED_AFTER, REFRESH_EVERY, SHADOW_EVERY, SHADOW_MOST, DraftBudget
from spec.speculator import _Trees, kept_drafts, score_trees

QUESTIONS = [
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list, then the same for the product.",
    "Count from one to twenty, separated by commas.",
]
FIXED = SpecConfig(method="ngram", adaptive=False)
FEW_ROWS = SpecConfig(method="ngram", adaptive=False, max_verify_tokens=8)  # 4 sequences, 4 drafts: the batch's best


@pytest.fixture(scope="module")
def prompts(default_engine):
    return [chat_prompt_ids(default_engine.tokenizer, q) for q in QUESTIONS]


def outputs(engine, prompts, params):
    return [o for group in engine.generate(prompts, params, return_logprob=True) for o in group]


def same(a, b, atol: float = 1e-5) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert max((abs(u - v) for u, v in zip(x.logprobs, y.logprobs)), default=0) <= atol


PREEMPTING = SamplingParams(temperature=0, n=2, max_new_tokens=32, ignore_eos=True)
# the pool runs dry (admission keeps no room for growth): sequences are preempted and recomputed
SMALL_POOL = dict(device="cpu", kv_cache_tokens=180, schedule_conservativeness=0)


@pytest.fixture(scope="module")
def off_through_preemption(default_model_dir, prompts):
    return outputs(Engine(model=str(default_model_dir), spec="off", **SMALL_POOL), prompts[:2], PREEMPTING)


@pytest.mark.parametrize("spec", [FIXED, FEW_ROWS], ids=["every-draft", "best-drafts"])
def test_greedy_spec_on_equals_spec_off_through_preemption(default_model_dir, off_through_preemption, prompts, spec):
    on = Engine(model=str(default_model_dir), spec=spec, **SMALL_POOL)
    same(off_through_preemption, outputs(on, prompts[:2], PREEMPTING))
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
        found, total = engine.table.indexed([s for s in seqs if not s.finished])  # running rows, against the host's tokens
        assert found == total
    found, total = engine.table.indexed(seqs)  # finished ones, in their history rows
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


def test_coupled_chains_the_budget_can_count_on_are_verified_at_once_while_they_pay_for_their_rows():
    """Coupled chains (`sure` drafts, ranked first) are weighed as accepted without waiting for the
    estimates, and still against the measured costs: where a row costs what a step does, none."""
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, max_rows=512)
    for _ in range(5):
        budget.observe_step(16, 0, 0.010)
    assert budget.plan(16, 10_000, draining=True).draft_rows == 0  # nothing estimated
    assert budget.plan(16, 10_000, draining=True, sure=16 * 8 * 0.9).draft_rows == 128  # every chain whole
    for rows in (2, 4, 8, 16, 32, 64, 128):  # measured: a row costs as much as a plain step's sequence, and more
        for _ in range(5):
            budget.observe_step(16, rows, 0.010 + rows * 0.002)
    assert budget.plan(16, 10_000, draining=True, sure=16 * 8 * 0.9).draft_rows == 0


def test_the_speculator_counts_on_coupled_chains_at_their_measured_acceptance():
    """What the budget is told it can count on (`sure`) follows the coupled drafts' acceptance as
    verified, a running mean over the last few hundred, from 0.9 before any was verified."""
    from types import SimpleNamespace

    from spec.budget import StepPlan
    from spec.speculator import Speculator
    from spec.step import StepReport
    from spec.token_table import TokenTable

    spec = Speculator(SpecConfig(method="ngram"), TokenTable(16, 8, 64, torch.device("cpu")), coupled=True)
    told = []
    spec.budget.plan = lambda *args, sure=0.0, **kw: told.append(sure) or StepPlan(0, False, False)
    def step(coupled_drafts=None):
        by_source = {} if coupled_drafts is None else {"coupled": SimpleNamespace(drafted=coupled_drafts[0],
                                                                                   accepted=coupled_drafts[1])}
        spec.observe([], None, None, 0, 1e-3, StepReport(by_source, coupled=10))

    step()  # (10 sequences follow their earlier rollouts)
    spec.plan(16, 10_000, draining=True)
    step((0, 0))  # (a step without coupled drafts tells nothing)
    spec.plan(16, 10_000, draining=True)
    for _ in range(20):  # chains that part from their earlier rollouts: a quarter accepted
        step((64, 16))
    spec.plan(16, 10_000, draining=True)
    full = 10 * spec.depth
    assert told[:2] == [pytest.approx(0.9 * full)] * 2
    assert told[2] == pytest.approx(0.25 * full, rel=0.02)


def test_the_budget_verifies_drafts_only_when_measured_acceptance_pays_for_measured_costs():
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, max_rows=512)
    assert budget.capacities(16) == [0, 2, 4, 8, 16, 32, 64, 128]
    assert budget.capacities(1) == [0, 1, 2, 4, 8] and budget.capacities(256) == [0, 32, 64, 128, 256]  # <= 512 rows
    assert budget.plan(16, 10_000).draft_rows == 0  # a bucket's first steps measure plain decoding
    for _ in range(5):
        budget.observe_step(16, 0, 0.010)
    assert budget.plan(16, 10_000).draft_rows == 0  # nothing known to be accepted
    acc = [0.1, 0.2, 0.4, 0.8, 1.2, 1.5, 1.6]  # accepted drafts per sequence, 1/8 ... 8 draft rows per sequence
    budget.observe_acceptance(16, np.array([acc] * 16), np.arange(16))
    assert budget.acc[16].tolist() == pytest.approx([0.3 * a for a in acc])  # evaluations move it a share of the way
    budget.acc[16][:] = acc  # (as after many such evaluations)
    # no row measured yet: a tenth of a plain step per sequence, 62.5 us; (1 + 1.2) / 12 ms is the best
    assert budget.plan(16, 10_000).draft_rows == 32
    for _ in range(5):
        budget.observe_step(16, 32, 0.018)  # a row adds 0.25 ms
    assert budget.plan(16, 10_000).draft_rows == 16  # (1 + 0.8) / 14 ms beats (1 + 1.2) / 18 ms
    for _ in range(5):  # the contexts grew: plain steps cost more, a row adds what it did
        budget.observe_step(16, 0, 0.100)
    assert budget.plan(16, 10_000).draft_rows == 64  # (1 + 1.5) / 116 ms
    # other work lands on some plain steps (a median would say 300 ms): drafting is priced
    # against the least, and 64 rows that add 128 ms are measured as such
    for seconds in (0.100, 0.300, 0.100, 0.300, 0.300):
        budget.observe_step(16, 0, seconds)
    for _ in range(MEASURED_AFTER):
        budget.observe_step(16, 64, 0.228)
    # (1 + 1.2) / 108 ms, measured, beats (1 + 1.5) / 228 ms and 1 / 100 ms; the line through
    # (32, 8 ms) and (64, 128 ms) now charges 1.65 ms a row where nothing was measured
    assert budget.plan(16, 10_000).draft_rows == 32
    assert budget.plan(128, 10_000).draft_rows == 0 and budget.plan(16, 40).draft_rows == 16  # 16 + 16 slots fit
    rows = [budget.plan(16, 10_000).draft_rows for _ in range(4 * REFRESH_EVERY)]
    assert rows.count(0) == 4  # while drafting, a plain step now and then keeps the plain cost current
    # drafting has a fixed part too: 8 rows add 3 ms, 64 rows 4.4 ms (2.8 ms + 0.025 ms a row)
    overhead = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, max_rows=512)
    for _ in range(5):
        overhead.observe_step(64, 0, 0.010)
    for rows, seconds in ((8, 0.013), (64, 0.0144), (8, 0.013), (64, 0.0144)):
        overhead.observe_step(64, rows, seconds)
    overhead.acc[64] = np.array([0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert overhead.plan(64, 10_000).draft_rows == 0  # (1 + 0.4) / 14.4 ms, the best, loses to 1 / 10 ms
    overhead.acc[64] = np.array([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert overhead.plan(64, 10_000).draft_rows == 64  # (1 + 0.5) / 14.4 ms wins
    # what a row adds is fitted across buckets, but a bucket's own steps overrule the line
    tail = DraftBudget(max_draft_tokens=8, max_verify_tokens=4096, max_rows=512)
    for b in (16, 128):
        for _ in range(5):
            tail.observe_step(b, 0, 0.010)
    for _ in range(4):
        tail.observe_step(16, 16, 0.011)  # 16 rows add 1 ms at 16 sequences
    tail.acc = {b: np.array([0.15, 0.18, 0.3, 0.4, 0.5, 0.6, 0.7]) for b in (16, 128)}
    assert tail.plan(128, 10_000).draft_rows == 16  # the line: (1 + 0.15) / 11 ms beats 1 / 10 ms
    for _ in range(MEASURED_AFTER):
        assert tail.plan(128, 10_000).draft_rows == 16
        tail.observe_step(128, 16, 0.013)  # ... but there they add 3 ms
    assert tail.plan(128, 10_000).draft_rows == 0 and tail.plan(16, 10_000).draft_rows == 16
    # host-bound steps at 512 sequences, one plain period in two carrying other work: drafting
    # that makes every period 4 ms loses to the 2-ms plain steps (a median of 8 ms would take it)
    host_bound = DraftBudget(max_draft_tokens=8, max_verify_tokens=4096, max_rows=512)
    for seconds in (0.008, 0.002, 0.008, 0.002, 0.008):
        host_bound.observe_step(512, 0, seconds)
    for _ in range(MEASURED_AFTER):
        host_bound.observe_step(512, 512, 0.004)
    host_bound.acc[512] = np.array([0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.0])
    assert host_bound.plan(512, 10_000).draft_rows == 0  # (1 + 0.5) / 4 ms loses to 1 / 2 ms


def test_a_verify_step_corrects_the_acceptance_of_the_fraction_it_drafted_at():
    """Estimates learnt at another temperature (0.4 drafts a sequence at 1/8) keep a bucket drafting
    that the trees, back every 64 steps while nothing pays, would correct slowly; its verify
    steps say what its drafts do now."""
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=4096, max_rows=512)
    for _ in range(5):
        budget.observe_step(256, 0, 0.002)
    for _ in range(MEASURED_AFTER):
        budget.observe_step(256, 32, 0.0025)  # 32 rows add 0.5 ms
    budget.acc[256] = np.array([0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7])
    assert budget.plan(256, 10_000).draft_rows == 32  # (1 + 0.4) / 2.5 ms beats 1 / 2 ms
    budget.observe_verified(250, 32, 5)  # 0.02 accepted a sequence
    assert budget.acc[256][0] == pytest.approx(0.4 + ACCEPT_WEIGHT * (5 / 250 - 0.4))
    assert budget.acc[256][1:].tolist() == [0.45, 0.5, 0.55, 0.6, 0.65, 0.7]  # (the fractions not verified)
    budget.observe_verified(250, 32, 5)
    assert budget.plan(256, 10_000).draft_rows == 0
    before = budget.acc[256].copy()
    budget.observe_verified(250, 33, 5)  # rows no fraction gives: nothing to say
    assert budget.acc[256].tolist() == before.tolist()
    budget.observe_verified(500, 64, 256)  # a bucket not yet evaluated starts from what it borrows
    assert budget.acc[512][0] == pytest.approx(0.125 + ACCEPT_WEIGHT * (256 / 500 - 0.125))


def test_acceptance_is_estimated_per_batch_bucket_and_borrowed_within_what_a_fraction_can_confirm():
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=512 + 64, max_rows=512)  # 64 draft rows at 512 sequences
    assert budget.accepted_at(512).tolist() == [0.0] * len(FRACTIONS)  # nothing evaluated yet
    # the tail: 2 sequences, each of which gets a whole draft even at 1/8 per sequence, half accepted
    tail = [0.5, 0.5, 0.5, 0.5, 1.0, 2.0, 3.0]
    for _ in range(30):
        budget.observe_acceptance(2, np.array([tail] * 2), np.arange(2))
    assert budget.accepted_at(2).tolist() == pytest.approx(tail, abs=1e-3)
    # 512 sequences borrow it, at most the drafts a fraction gives each of them: 64 rows confirm
    # 0.125 drafts per sequence at most
    assert budget.accepted_at(512).tolist() == pytest.approx([0.125, 0.25, 0.5, 0.5, 1.0, 2.0, 3.0], abs=1e-3)
    for _ in range(5):
        budget.observe_step(512, 0, 0.002)
    for _ in range(MEASURED_AFTER):
        budget.observe_step(512, 64, 0.0024)  # drafting's fixed part: a fifth of the step
    assert budget.plan(512, 10_000).draft_rows == 0  # (1 + 0.5) / 2.4 ms would win, (1 + 0.125) / 2.4 ms loses
    budget.observe_acceptance(512, np.array([[0.05, 0.1, 0.2, 0.3, 0.4, 0.45, 0.5]] * 128), np.arange(128))
    assert budget.accepted_at(512)[0] == pytest.approx(0.125 + 0.3 * (0.05 - 0.125))  # from the borrowed estimate
    assert budget.accepted_at(2).tolist() == pytest.approx(tail, abs=1e-3)  # its own, untouched
    fixed = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, max_rows=512, adaptive=False)
    assert fixed.plan(16, 10_000).draft_rows == 128 and fixed.plan(64, 10_000).draft_rows == 256
    shadows = [fixed.plan(16, 10_000).shadow for _ in range(4 * SHADOW_EVERY)]
    assert sum(shadows) == 4


def test_trees_come_back_less_often_while_no_draft_pays_and_as_often_as_before_once_one_does():
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=1024, max_rows=512)
    for _ in range(5):
        budget.observe_step(512, 0, 0.002)
    for _ in range(MEASURED_AFTER):
        budget.observe_step(512, 64, 0.00205)  # 64 rows pay from 0.025 drafts per sequence
    shadows = []
    for _ in range(400):  # nothing accepted: no step drafts
        assert budget.shadow_next == (plan := budget.plan(512, 10_000)).shadow  # (shadow_next said so a step ahead)
        assert plan.draft_rows == 0
        shadows.append(plan.shadow)
    gaps = np.diff(np.flatnonzero(shadows)).tolist()
    assert gaps[:4] == [16, 32, 64, 64] and set(gaps[4:]) == {SHADOW_MOST}
    budget.shadow_often()  # (a woken head waits on evaluations)
    assert any(budget.plan(512, 10_000).shadow for _ in range(SHADOW_EVERY))
    budget.acc[512] = np.array(FRACTIONS) / 2  # half of every draft accepted
    plans = [budget.plan(512, 10_000) for _ in range(SHADOW_MOST)]
    assert plans[0].draft_rows > 0
    shadows = [p.shadow for p in plans]
    assert np.diff(np.flatnonzero(shadows)).tolist() == [SHADOW_EVERY] * (sum(shadows) - 1)


def test_trees_are_scored_by_the_tokens_their_sequences_emitted_among_the_drafts_a_step_would_keep():
    # A: root 9 -> 5 -> 6 -> 7 (nodes 1, 2, 4) and root -> 8 (node 3); it went on 5 6 3
    # B: root 3 -> 4 -> 4 (nodes 1, 2); it went on 4 0 4; its drafts have the highest keys
    # C: nothing drafted (padding: token 0 at depth 1); it went on 0 0 0, which matches no padding
    tokens = np.array([[9, 5, 6, 8, 7], [3, 4, 4, 0, 0], [5, 0, 0, 0, 0]])
    depths = np.array([[0, 1, 2, 1, 3], [0, 1, 2, 1, 1], [0, 1, 1, 1, 1]])
    ancestors = np.array([[1, 0b11, 0b111, 0b1001, 0b10111], [1, 0b11, 0b111, 0b1001, 0b10001],
                          [1, 0b11, 0b101, 0b1001, 0b10001]])
    keys = np.array([[-1, 400, 300, 200, 100], [-1, 900, 800, -1, -1], [-1, -1, -1, -1, -1]])
    seqs = [SimpleNamespace(tokens=t, row=r, finish_reason=f)
            for t, r, f in (([1, 2, 9, 5, 6, 3], 4, None), ([3, 4, 0, 4], 0, None), ([5, 0, 0, 0], 7, "stop"))]
    score, rows = score_trees(_Trees(seqs, np.array([3, 1, 1]), tokens, depths, ancestors, keys))
    # draft rows for 3 sequences at 1/8 ... 8 per sequence: 1, 1, 2, 3, 6, 12, 12 (of 12 drafts), B's first
    assert score.tolist() == [[0, 0, 0, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1], [0] * 7]
    assert rows.tolist() == [4, 0, -1]  # (C has finished: no rate of its own to keep)


def test_a_draining_batch_drafts_only_for_what_its_slowest_sequences_accept():
    """Nothing waits to be admitted: the batch ends with its slowest sequences, so drafts accepted by
    a few fast ones do not pay for a step that costs more."""
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=512, max_rows=64)
    for _ in range(5):
        budget.observe_step(16, 0, 0.010)
    for _ in range(MEASURED_AFTER):
        budget.observe_step(16, 16, 0.012)  # 16 rows add 2 ms: they pay from 0.2 drafts per sequence
    fast, slow = np.full(len(FRACTIONS), 2.0), np.zeros(len(FRACTIONS))
    rows = np.arange(16) + 30
    for _ in range(60):  # 2 of 16 sequences accept 2 drafts a step: 0.25 on average
        budget.observe_acceptance(16, np.array([fast] * 2 + [slow] * 14), rows)
    assert budget.acc[16][3] == pytest.approx(0.25, abs=1e-3)
    assert budget.slowest.tolist() == pytest.approx([0.0] * len(FRACTIONS), abs=1e-3)
    assert budget.plan(16, 10_000).draft_rows > 0  # more tokens per second: pays while requests wait
    assert budget.plan(16, 10_000, draining=True).draft_rows == 0  # the batch would not end sooner
    for row in rows[2:]:  # the slow ones finish
        budget.forget(int(row))
    assert budget.slowest.tolist() == pytest.approx([0.0] * len(FRACTIONS), abs=1e-3)  # (until the next evaluation)
    budget.observe_acceptance(2, np.array([fast] * 2), rows[:2])
    assert budget.slowest.tolist() == pytest.approx(fast.tolist(), abs=1e-2)
    budget.acc[16][:] = 0.25  # (the bucket's estimate, as before)
    assert budget.plan(16, 10_000, draining=True).draft_rows > 0
    budget.observe_acceptance(16, np.array([fast]), np.array([-1]))  # a sequence that stopped: no rate kept
    assert np.isnan(budget._seq_acc[:, 0]).sum() == 62


@pytest.mark.parametrize("seed", range(5))
def test_the_device_keeps_the_best_drafts_of_the_batch_as_the_host_replays_it(seed):
    """kernels/draft_rows.py on random trees: each tree keeps its first few drafts, the batch the
    `capacity` with the highest keys (as spec.speculator.kept_drafts replays it), and the rows lay
    every kept node out once, sequence by sequence, root first."""
    s, n = 6, 9
    trees = random_trees(torch.Generator().manual_seed(seed), s, n)
    tokens, parents, depths, ancestors, keys, kv, out_pos = trees
    node = torch.arange(n)
    drafts = (parents[:, 1:] >= 0).sum(dim=1)
    for capacity in (0, 1, 3, 7, s * (n - 1)):
        slots = torch.arange(s + capacity) + 100
        got = lay_out_drafts_ref(*trees, slots, capacity)
        counts = got.counts
        assert counts.tolist() == (1 + kept_drafts(keys.numpy(), [capacity])[0]).tolist()
        assert int(counts.sum()) - s == min(capacity, int(drafts.sum()))
        assert ((got.parents[:, 1:] >= 0) == (node[1:] < counts[:, None])).all()  # the first few, a tree
        has_row = node < counts[:, None]
        flat = torch.arange(s * n).view(s, n)
        rows = got.node_of_row[got.node_of_row < s * n]
        assert sorted(rows.tolist()) == flat[has_row].tolist()  # every kept node once
        assert torch.equal(got.node_of_row[got.row_of_node[has_row]], flat[has_row])
        assert torch.equal(got.tokens[got.row_of_node[has_row]], tokens[has_row])
        assert torch.equal(got.positions[got.row_of_node[has_row]], (kv[:, None] + depths)[has_row])
        assert torch.equal(got.seq[got.row_of_node[has_row]], (flat // n)[has_row])
        assert torch.equal(got.slots[has_row], slots[got.row_of_node[has_row]])
        assert got.qo_indptr.tolist() == [0] + torch.cumsum(counts, 0).tolist()


def random_trees(gen: torch.Generator, s: int, n: int) -> tuple[torch.Tensor, ...]:
    """Trees as the drafter returns them (tokens, parents, depths, ancestors, keys [S, N]; each
    tree's drafts are nodes 1..d, keys never growing with rank), and each root's kv and output
    positions [S]."""
    drafts = torch.randint(0, n, (s,), generator=gen)
    node = torch.arange(n)
    parents = torch.where(node < drafts[:, None] + 1, (node - 1 - torch.randint(0, 2, (s, n), generator=gen)).clamp(min=0), PADDING)
    parents[:, 0] = -1
    depths = torch.zeros(s, n, dtype=torch.long)
    ancestors = torch.zeros(s, n, dtype=torch.long)
    ancestors[:, 0] = 1
    for j in range(1, n):
        p = parents[:, j].clamp(min=0)
        real = parents[:, j] >= 0
        depths[:, j] = torch.where(real, depths[torch.arange(s), p] + 1, 0)
        ancestors[:, j] = torch.where(real, ancestors[torch.arange(s), p] | (1 << j), 0)
    keys = torch.randint(0, 5, (s, n), generator=gen).sort(dim=1, descending=True).values  # ties across trees
    keys = torch.where(parents >= 0, keys, -1)
    tokens = torch.randint(0, 1000, (s, n), generator=gen)
    kv = torch.randint(0, 500, (s,), generator=gen)
    return tokens, parents, depths, ancestors, keys, kv, kv + torch.randint(-50, 0, (s,), generator=gen)
