"""The draft head's watch and sleep cycle (spec/head_watch.py): switched off under a weight
version whose drafts it no longer predicts, back on after probes that pay or a push of its
weights; asleep while it is not verified or switched off, awake again for new prompts."""

from __future__ import annotations

import pytest

from spec.head_watch import IDLE_STEPS, INFORMED_AFTER, MIN_CHAINS, SLEEP_STEPS, HeadCycle, HeadWatch


def test_a_head_accepted_too_rarely_is_switched_off_and_on_after_probes_that_pay():
    w = HeadWatch(min_accept=0.2)
    w.on_weights(1, head_pushed=False)
    w.observe(MIN_CHAINS - 1, 0)
    assert w.on  # (too few drafts to decide)
    w.observe(1, 0)
    assert not w.on and w.switched_off == 1
    w.observe(MIN_CHAINS, MIN_CHAINS // 2)  # the probes' drafts pay again
    assert w.on and w.switched_on == 1
    assert w.stats()["rollout/spec_head_on"] == 1.0 and len(w.transitions) == 2


def test_a_push_of_the_heads_weights_switches_it_on_and_counts_start_over():
    w = HeadWatch(min_accept=0.2)
    w.observe(MIN_CHAINS, 1)
    assert not w.on
    w.on_weights(2, head_pushed=False)
    assert not w.on and w.chains == 0
    w.on_weights(3, head_pushed=True)
    assert w.on and w.version == 3 and "pushed" in w.transitions[-1]
    w.observe(MIN_CHAINS, MIN_CHAINS // 4)  # (0.25: pays)
    assert w.on and w.stats()["rollout/spec_head_version_first_accept"] == 0.25


def inform(c: HeadCycle) -> None:
    for _ in range(INFORMED_AFTER):
        c.evaluated()


def test_a_head_not_verified_sleeps_and_wakes_for_new_prompts_after_a_while():
    c = HeadCycle()
    assert all(c.step(0) for _ in range(3 * IDLE_STEPS))  # (the budget has no estimates yet: nothing counts)
    inform(c)
    assert all(c.step(0) for _ in range(IDLE_STEPS // 2))
    c.verified()  # (its chains were verified: idle from here)
    assert [c.step(0) for _ in range(IDLE_STEPS + 3)] == [True] * IDLE_STEPS + [False] * 3
    assert c.sleeps == 1 and not c.admit(0)  # (too soon)
    for _ in range(SLEEP_STEPS):
        c.step(0)
    assert c.admit(0) and all(c.step(0) for _ in range(2 * IDLE_STEPS))  # (awake, and uninformed again)
    inform(c)
    assert not all(c.step(0) for _ in range(IDLE_STEPS + 1)) and c.sleeps == 2


def test_a_switched_off_head_sleeps_and_a_push_of_its_weights_wakes_it_at_the_next_admission():
    c = HeadCycle()
    assert c.step(0) and not c.step(1)  # the watch switched it off
    c.head_pushed()
    assert c.admit(1) and c.step(1)  # (a probe: the watch is still off, the switch-off is not new)
    assert not c.step(2)


def test_a_head_whose_drafts_are_a_smaller_share_of_the_tokens_than_its_work_of_the_time_sleeps():
    """Over PAY_WINDOW informed steps, a head that costs 10% of the steps' time (a pass of 0.1 ms
    in 1 ms steps, more with its trees) sleeps if its drafts are under that share of the tokens,
    and stays awake above it; without measured costs (no CUDA graphs) nothing is weighed."""
    from spec.head_watch import PAY_WINDOW

    def run(head_tokens: int, costs=None) -> HeadCycle:
        c = HeadCycle(costs={1: (1e-4, 3e-4), 64: (2e-4, 5e-4)} if costs is None else costs)
        inform(c)
        for k in range(PAY_WINDOW):
            c.step(0)
            c.verified()
            c.ran(1, tree=k % 4 == 0, seconds=1e-3, tokens=20, head_tokens=head_tokens)
        return c

    paid = run(head_tokens=4)  # 20% of the tokens for 10% + 1/4 of 30% = 17.5% of the time
    assert paid.awake and paid.last_shares == pytest.approx((0.2, 0.175)) and paid.stats()["rollout/spec_head_token_share"] == 0.2
    lost = run(head_tokens=3)  # 15%
    assert not lost.awake and lost.sleeps == 1
    assert run(head_tokens=0, costs={}).awake  # (nothing measured: only the idle rule)
    lost.asleep = SLEEP_STEPS
    assert lost.admit(0) and lost.window.steps == 0  # (a fresh window for the probe)


def test_a_large_batch_weighs_the_head_after_a_few_steps_and_each_probe_that_never_paid_doubles_the_sleep():
    """A window closes after PAY_TOKENS tokens (at least MIN_PAY_STEPS steps) where a batch emits
    many a step, so a probe at 512 sequences costs a few steps rather than PAY_WINDOW; each
    wake-up in a row in which the head never paid sleeps twice as long, up to 2**MAX_DOUBLINGS
    times SLEEP_STEPS, and one that paid resets it."""
    from spec.head_watch import MAX_DOUBLINGS, MIN_PAY_STEPS, PAY_TOKENS, PAY_WINDOW

    def window(c: HeadCycle, head_tokens: int, tokens: int = 600) -> int:
        """Steps of b512 until the head is weighed, each emitting `tokens`."""
        inform(c)
        for k in range(1, 1000):
            c.step(0)
            c.verified()
            before = c.last_shares
            c.ran(512, tree=True, seconds=4.7e-3, tokens=tokens, head_tokens=head_tokens)
            if c.last_shares is not before:
                return k
        raise AssertionError("never weighed")

    costs = {512: (4e-4, 1e-3)}  # 30% of a 4.7 ms step with its tree
    assert window(HeadCycle(costs=costs), head_tokens=0, tokens=3) == PAY_WINDOW  # (few tokens a step: the whole window)
    c = HeadCycle(costs=costs)

    def wake() -> None:
        c.asleep = c.sleep_steps
        assert c.admit(0)

    assert MIN_PAY_STEPS * 600 > PAY_TOKENS and window(c, head_tokens=60) == MIN_PAY_STEPS and not c.awake
    sleeps = [c.sleep_steps]
    for _ in range(MAX_DOUBLINGS + 1):
        wake()
        window(c, head_tokens=60)  # 10% of the tokens for 30% of the time: asleep again
        sleeps.append(c.sleep_steps)
    assert sleeps == [SLEEP_STEPS << min(k, MAX_DOUBLINGS) for k in range(MAX_DOUBLINGS + 2)]
    wake()
    window(c, head_tokens=300)  # half the tokens: it paid, and stays awake
    assert c.awake and c.sleep_steps == sleeps[-1]
    window(c, head_tokens=0)
    assert not c.awake and c.sleep_steps == SLEEP_STEPS and c.stats()["rollout/spec_head_sleep_steps"] == SLEEP_STEPS
    for _ in range(2):
        wake()
        window(c, head_tokens=0)
    assert c.sleep_steps == 2 * SLEEP_STEPS
    c.head_pushed()  # (a new head: the old one's probes do not count against it)
    assert c.sleep_steps == SLEEP_STEPS and c.admit(0)
