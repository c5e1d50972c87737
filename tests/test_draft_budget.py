"""The draft budget: drafting is chosen from measured step costs and expected acceptance."""

import random
from types import SimpleNamespace

import pytest

from spec.budget import COST_WINDOW, FIRST_LOOK, MAX_PROBE_EVERY, MIN_OBSERVED, MIN_VALUE, PROBE_EVERY, DraftBudget


def seqs(n: int, first: int = 0):
    return [SimpleNamespace(seq_id=first + i) for i in range(n)]


def measured(budget: DraftBudget, num_seqs: int, num_drafts: int, seconds: float) -> None:
    for _ in range(COST_WINDOW):
        budget.observe_step(num_seqs, num_drafts, seconds)


def test_fixed_budget_drafts_the_cap_and_the_cap_follows_the_verify_limit():
    budget = DraftBudget(max_draft_tokens=8, max_verify_tokens=64, adaptive=False)
    assert budget.for_batch(seqs(2)) == {0: 8, 1: 8}
    assert budget.per_sequence_cap(16) == 3  # 16 x (1 + 3) = 64 verified tokens
    assert budget.for_batch(seqs(64)) == {}


def test_decode_is_measured_first_then_unmeasured_verify_shapes_are_tried():
    budget = DraftBudget(8, 256)
    for _ in range(MIN_OBSERVED):
        assert budget.for_batch(seqs(1)) == {}  # no decode cost known at this batch size yet
        budget.observe_step(1, 0, 1e-3)
    # a new sequence starts at the all-sequence chance of 1/2 per token: tokens worth .5, .25, ...
    # down to MIN_VALUE, all assumed as cheap as decoding until measured
    assert budget.for_batch(seqs(1)) == {0: 5}


def test_dear_verify_steps_are_not_chosen_and_cheap_ones_are():
    budget = DraftBudget(8, 256)
    measured(budget, 4, 0, 1e-3)
    for s in range(4):
        for _ in range(10):
            budget.observe(s, 1, rejected=True)  # one draft token accepted per step, the next rejected
    for drafts in range(1, 21):  # up to 4 x 5 drafts (worth .5, .25, ... each): three decode steps
        measured(budget, 4, drafts, 3e-3)
    assert budget.for_batch(seqs(4)) == {}  # 4 + 3.9 expected tokens in 3 ms < 4 tokens in 1 ms
    for drafts in range(1, 21):
        measured(budget, 4, drafts, 1.2e-3)
    assert budget.for_batch(seqs(4)) == {0: 5, 1: 5, 2: 5, 3: 5}


def test_failing_sequences_pause_and_are_probed_again():
    budget = DraftBudget(8, 256)
    measured(budget, 2, 0, 1e-3)
    for _ in range(20):
        budget.observe(0, 2, rejected=False)
        budget.observe(1, 0, rejected=True)
    for drafts in range(1, 17):
        measured(budget, 2, drafts, 1.3e-3)
    plans = [budget.for_batch(seqs(2)) for _ in range(PROBE_EVERY)]
    assert all(p.get(0) == 8 for p in plans)  # every draft token accepted so far: the deepest draft
    assert sum(1 in p for p in plans) == 1  # only the probe step offers the failing sequence
    budget.forget(1)
    assert 1 in budget.for_batch(seqs(2))  # a new sequence of that id starts from the all-sequence counts


def test_draft_tokens_are_ranked_by_their_chance_of_acceptance():
    budget = DraftBudget(8, 256)
    measured(budget, 3, 0, 1e-3)
    for _ in range(30):
        budget.observe(0, 8, rejected=False)  # chance ~1: eight tokens worth ~1 each
        budget.observe(1, 1, rejected=True)  # chance 1/2: worth .5, .25, .125, ...
        budget.observe(2, 1, rejected=True)
    # verifying up to 16 tokens costs as decoding; 32 tokens cost twice as much
    for drafts in range(1, 14):
        measured(budget, 3, drafts, 1e-3)
    for drafts in range(14, 30):
        measured(budget, 3, drafts, 2e-3)
    plan = budget.for_batch(seqs(3))
    assert plan == {0: 8, 1: 3, 2: 2}  # the 13 best of 18 tokens: 3 + 13 = 16, still the cheap shape


def test_acceptance_moves_how_deep_a_sequence_drafts():
    budget = DraftBudget(8, 256)
    measured(budget, 1, 0, 1e-3)
    for drafts in range(1, 9):
        measured(budget, 1, drafts, 1.3e-3)  # a verify step costs 1.3 decode steps, whatever its depth
    assert budget.accept_chance(0) == 0.5  # not yet verified: the all-sequence counts
    assert budget.for_batch(seqs(1)) == {0: 5}  # 1.97 tokens in 1.3 ms > 1 in 1 ms
    for _ in range(3):
        budget.observe(0, 8, rejected=False)
    assert budget.for_batch(seqs(1)) == {0: 8}
    for _ in range(12):
        budget.observe(0, 0, rejected=True)
    assert budget.accept_chance(0) < 0.1
    assert budget.for_batch(seqs(1)) == {}  # under 1.3 tokens per verify step: plain decoding wins


def test_a_sequence_offered_a_first_look_drafts_once_even_when_drafting_looks_dear():
    budget = DraftBudget(8, 256)
    measured(budget, 2, 0, 1e-3)
    for _ in range(50):
        budget.observe(0, 0, rejected=True)  # a failing sequence pulls the all-sequence counts down
    for drafts in range(1, 17):
        measured(budget, 2, drafts, 5e-3)  # and verify steps are dear
    assert budget.for_batch([seqs(1)[0], seqs(1, first=7)[0]]) == {}  # a newcomer of a new prompt: no look
    budget.offer_first_look(8)  # its prompt was rolled out before
    assert budget.for_batch([seqs(1)[0], seqs(1, first=8)[0]]) == {8: FIRST_LOOK}  # the newcomer looks once
    assert budget.for_batch([seqs(1)[0], seqs(1, first=8)[0]]) == {}  # and only once, result or not
    budget.observe(8, 2, rejected=False)  # its drafts were accepted: from now on its own counts count
    for drafts in range(1, 17):
        measured(budget, 2, drafts, 1.2e-3)
    assert 8 in budget.for_batch([seqs(1)[0], seqs(1, first=8)[0]])


def test_drafting_steps_that_fall_short_of_their_prediction_stop_drafting_at_their_batch_size():
    budget = DraftBudget(8, 256)
    for n in (2, 8):
        measured(budget, n, 0, 1e-3)
        for drafts in range(1, 8 * n + 1):
            measured(budget, n, drafts, 1.2e-3)
    assert budget.for_batch(seqs(2)) == {0: 5, 1: 5}  # a = 1/2: ~2.9 tokens per sequence in 1.2 ms
    predicted = budget.predicted_rate
    assert predicted == pytest.approx(2 * (1 + 0.5 + 0.25 + 0.125 + 0.0625 + 0.03125) / 1.2e-3)
    for _ in range(8):  # each of them emitted one token per sequence, and took 2 ms
        budget.observe_drafting(2, 2, 2e-3, predicted)
    plans = [budget.for_batch(seqs(2)) for _ in range(MAX_PROBE_EVERY)]
    assert sum(bool(p) for p in plans) == 1  # but for the probe step (probes backed off: see below)
    assert budget.for_batch(seqs(8, first=10))  # another batch-size bucket is not affected
    for _ in range(8):  # probes that realize what they predict bring it back
        budget.observe_drafting(2, 2 * 2.9375, 1.2e-3, predicted)
    assert budget.for_batch(seqs(2)) == {0: 5, 1: 5}


def test_the_plan_is_the_best_of_all_prefixes_of_the_ranked_draft_tokens():
    """The budget evaluates only each step shape's longest prefix; a plain search over every
    prefix (step shapes: power-of-two buckets of the tokens verified) must find no better one."""
    rng = random.Random(0)
    for case in range(200):
        n = rng.choice([1, 2, 3, 8, 31, 64, 100])
        budget = DraftBudget(8, rng.choice([64, 256, 512]))
        cap = budget.per_sequence_cap(n)
        measured(budget, n, 0, 1e-3)
        shape_cost = {}
        for drafts in range(1, n * cap + 1):
            bucket = (n + drafts - 1).bit_length()
            shape_cost.setdefault(bucket, rng.uniform(0.8e-3, 3e-3))
            measured(budget, n, drafts, shape_cost[bucket])
        chances = []
        for s in range(n):
            accepted, rejected = rng.randrange(0, 9), rng.random() < 0.7
            for _ in range(10):
                budget.observe(s, accepted, rejected)
            chances.append(budget.accept_chance(s))
        plan = budget.for_batch(seqs(n))  # a new budget's first step is no probe step
        values = sorted((c**j for c in chances for j in range(1, cap + 1) if c**j >= MIN_VALUE), reverse=True)
        rates = [n / 1e-3] + [
            (n + sum(values[:k])) / shape_cost[(n + k - 1).bit_length()] for k in range(1, len(values) + 1)
        ]
        best = max(range(len(rates)), key=rates.__getitem__)
        assert sum(plan.values()) == best, case


def test_a_plan_that_drafts_nothing_stands_until_what_it_was_made_from_changes(monkeypatch):
    budget = DraftBudget(8, 256)
    for num_seqs in (3, 6):
        measured(budget, num_seqs, 0, 1e-3)
        for drafts in range(1, 8 * num_seqs + 1):
            measured(budget, num_seqs, drafts, 3e-3)  # verify steps three times as dear as decoding: nothing pays
    plans = []
    best_plan = budget._best_plan
    monkeypatch.setattr(budget, "_best_plan", lambda *a: plans.append(a) or best_plan(*a))

    def planned(batch) -> bool:
        before = len(plans)
        assert budget.for_batch(batch) == {}
        return len(plans) > before

    assert planned(seqs(6))  # the first step (not a probe)
    assert not planned(seqs(6)) and not planned(seqs(5))  # the same batch, or one with a sequence less
    assert planned(seqs(7))  # a sequence joined
    budget.observe(0, 0, rejected=True)
    assert planned(seqs(7))  # a verify step's acceptance
    budget.observe_step(7, 3, 3e-3)
    assert planned(seqs(7))  # a verify step's cost
    budget.observe_step(7, 0, 1e-3)
    assert not planned(seqs(7))  # a decode step's cost: the probes follow it
    assert planned(seqs(3))  # another batch-size bucket
    while budget._steps % PROBE_EVERY != PROBE_EVERY - 1:
        assert not planned(seqs(3))
    assert planned(seqs(3))  # the probe step


def test_probes_back_off_while_drafting_falls_short_of_plain_decoding_and_return_when_it_pays():
    budget = DraftBudget(8, 256)
    measured(budget, 4, 0, 1e-3)
    for drafts in range(1, 33):
        measured(budget, 4, drafts, 1.5e-3)
    for s in range(4):  # paused sequences: only probes draft
        for _ in range(20):
            budget.observe(s, 0, rejected=True)
    probes = []
    for _ in range(1000):
        if budget.for_batch(seqs(4)):
            probes.append(budget._steps)
            budget.observe_drafting(4, 4, 3e-3, budget.predicted_rate)  # 4 tokens in 3 ms < 4 in 1 ms
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # each interval doubles after a probe that fell short (the next probe comes on the next step
    # that the doubled interval divides, so the first gap after a change may be shorter)
    assert probes[0] == PROBE_EVERY and gaps[:6] == [PROBE_EVERY << i for i in range(5)] + [MAX_PROBE_EVERY]
    assert budget._probes(16) == (budget._steps % PROBE_EVERY == 0)  # other buckets keep their own
    budget.observe_drafting(4, 12, 1.5e-3, 1.0)  # 12 tokens in 1.5 ms against 4 in 1 ms: drafting paid
    last = budget._steps
    while not budget.for_batch(seqs(4)):
        pass
    assert budget._steps - last <= PROBE_EVERY  # probes come at the first interval again
