"""The draft head's watch (spec/head_watch.py): switched off under a weight version whose drafts
it no longer predicts, probed while off, back on after probes that pay or a push of its weights."""

from __future__ import annotations

from spec.head_watch import MIN_CHAINS, PROBE_EVERY, PROBE_STEPS, HeadWatch


def test_a_head_accepted_too_rarely_is_switched_off_and_probed():
    w = HeadWatch(min_accept=0.2)
    w.on_weights(1, head_pushed=False)
    w.observe(MIN_CHAINS - 1, 0)
    assert w.on  # (too few drafts to decide)
    w.observe(1, 0)
    assert not w.on and w.switched_off == 1
    active = [w.active() for _ in range(2 * PROBE_EVERY)]
    assert sum(active) == 2 * PROBE_STEPS and not any(active[: PROBE_EVERY - PROBE_STEPS])
    w.observe(MIN_CHAINS, MIN_CHAINS // 2)  # the probes' drafts pay again
    assert w.on and w.switched_on == 1 and w.active()
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
