"""The overlap schedule (a decode step launched before the host has the previous step's
tokens) changes when the host does its work, never what comes out."""

from __future__ import annotations

import random

import pytest
from engine_probes import attention_slack, count_chained, draft_every_other_step

from rollout import Engine, SamplingParams


def random_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 30))] for _ in range(num)]


def mixed_run(engine: Engine, stop_token: int, repeats: int = 1) -> list[tuple]:
    """Greedy and sampled groups of different lengths, a stop token, arrivals while others
    decode, and an abort; returns every sample's tokens, logprobs, finish reason and versions.
    `repeats`: each prompt is its random tokens this many times over (something to draft from)."""
    prompts = [p * repeats for p in random_prompts(7, seed=21)]
    params = [
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, n=4, max_new_tokens=20, seed=5, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, n=3, max_new_tokens=9, seed=8, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, max_new_tokens=25, seed=9),
        SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),  # aborted midway
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
    ]
    reqs = [engine.add_request(p, sp, return_logprob=True) for p, sp in zip(prompts[:3], params[:3])]
    for step in range(60):
        if step in (4, 7, 11, 12):  # arrivals while others decode
            i = len(reqs)
            reqs.append(engine.add_request(prompts[i], params[i], return_logprob=True))
        if step == 18:
            engine.abort(reqs[5].rid)
        engine.step()
    while engine.has_work:
        engine.step()
    return [(s.output_ids, s.logprobs, s.finish_reason, s.weight_versions) for r in reqs for s in r.sequences]


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_overlap_gives_the_same_outputs_as_waiting_for_every_step(model_dir, spec):
    repeats = 1 if spec == "off" else 3  # prompts that repeat, so that drafts get accepted
    probe = Engine(model=str(model_dir), spec="off", device="cpu", overlap_schedule=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    stop_token = probe.generate([random_prompts(7, seed=21)[2] * repeats], greedy)[0][0].token_ids[6]
    runs = {}
    for overlap in (False, True):
        engine = Engine(model=str(model_dir), spec=spec, device="cpu", overlap_schedule=overlap)
        if spec == "ngram":
            draft_every_other_step(engine)
        chained = count_chained(engine)
        slack = attention_slack(engine)
        runs[overlap] = mixed_run(engine, stop_token, repeats)
        # a plain step's keys are bounded by the longest sequence, its own token and what the step
        # in flight may append, if one is (not twice the widest tree: the CPU's attention pads to it)
        in_flight = (1 + engine.runner.drafters.width if spec == "ngram" else 1) if overlap else 0
        assert len(slack) > 10 and max(slack) <= 1 + in_flight
        assert engine.pool.used_slots == 0 and not engine.has_work
        assert (chained[0] > 10) if overlap else chained[0] == 0
        if spec == "ngram":  # (a random model's drafts are rarely accepted: see test_speculation for that)
            assert engine.stats()["rollout/spec_draft_tokens"] > 10
            assert (chained[1] > 3) if overlap else chained[1] == 0
    reasons = [r[2] for r in runs[True]]
    assert reasons == [r[2] for r in runs[False]]
    assert "abort" in reasons and "stop" in reasons and "length" in reasons
    for (tokens, logprobs, reason, versions), (ref_tokens, ref_logprobs, _, _) in zip(runs[True], runs[False]):
        if reason == "abort":  # stopped "now": the token still on the device when abort came is dropped
            assert len(ref_tokens) - 1 <= len(tokens) <= len(ref_tokens)
            ref_tokens, ref_logprobs = ref_tokens[: len(tokens)], ref_logprobs[: len(tokens)]
        assert tokens == ref_tokens and versions == [0] * len(tokens)
        # batches differ by the sequences that stopped one step earlier, which moves float rounding
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_overlap_survives_preemption(model_dir, spec):
    prompts = [p * 2 for p in random_prompts(10, seed=11)]
    params = SamplingParams(temperature=0.8, max_new_tokens=16, seed=3, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        engine = Engine(model=str(model_dir), spec=spec, device="cpu", kv_cache_tokens=240, overlap_schedule=overlap)
        if spec == "ngram":
            draft_every_other_step(engine)
        outs[overlap] = [o[0].token_ids for o in engine.generate(prompts, params)]
        assert engine.scheduler.num_preempted > 0
        assert engine.pool.used_slots == 0
    assert outs[True] == outs[False]


@pytest.mark.parametrize("cut", ["abort", "preempt"])
def test_a_sequence_cut_off_while_its_verify_step_runs_keeps_none_of_its_tree(model_dir, cut):
    prompts = [p * 3 for p in random_prompts(3, seed=40)]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    reference = Engine(model=str(model_dir), spec="off", device="cpu", overlap_schedule=False).generate(prompts, params)
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu")
    draft_every_other_step(engine)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.loop.in_flight is None or not engine.loop.in_flight.draft_rows:
        engine.step()
    victim = reqs[0].sequences[0]
    assert victim in engine.loop.in_flight.batch.seqs  # its verify step runs
    if cut == "abort":
        engine.abort(reqs[0].rid)
    else:  # at the next schedule, as when the pool runs dry
        scheduler, schedule_decode = engine.scheduler, engine.scheduler._schedule_decode

        def preempting():
            scheduler._schedule_decode = schedule_decode
            scheduler.preempt(victim)
            return schedule_decode()

        scheduler._schedule_decode = preempting
    while engine.has_work:
        engine.step()
    assert engine.pool.used_slots == 0
    outputs = [r.sequences[0].output_ids for r in reqs]
    expected = [group[0].token_ids for group in reference]
    if cut == "abort":
        assert victim.finish_reason == "abort" and outputs[0] == expected[0][: len(outputs[0])]
        outputs, expected = outputs[1:], expected[1:]
    assert outputs == expected


def test_speculation_with_overlap_matches_without(model_dir):
    prompt = random_prompts(1, seed=4)[0] * 4  # repeats, so the drafter has something to match
    params = SamplingParams(temperature=0, n=4, max_new_tokens=40, ignore_eos=True)
    outs = {}
    for overlap in (False, True):
        engine = Engine(model=str(model_dir), spec="ngram", device="cpu", overlap_schedule=overlap)
        outs[overlap] = [(o.token_ids, o.logprobs) for o in engine.generate([prompt], params, return_logprob=True)[0]]
        assert engine.stats()["rollout/spec_verify_steps"] > 0
    assert outs[True] == outs[False]


def test_a_weight_update_completes_the_step_in_flight_under_the_old_version(model_dir):
    engine = Engine(model=str(model_dir), spec="off", device="cpu")
    req = engine.add_request(random_prompts(1, seed=30)[0], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    while engine.loop.in_flight is None:
        engine.step()
    seq = req.sequences[0]
    before = seq.num_output  # the step in flight holds one more token, drawn under version 0
    name, target = next(iter(engine.model.weight_targets().items()))
    engine.update_weights([(name, target.param.detach().clone())])  # "model.embed_tokens.weight", whole
    assert seq.num_output == before + 1 and seq.weight_versions == [0] * (before + 1)
    assert req in engine.step()  # the drained step's request is reported by the next step
    while not req.finished:
        engine.step()
    assert seq.weight_versions == [0] * (before + 1) + [1] * (20 - before - 1)


def test_on_the_cpu_the_budget_prices_a_step_at_its_own_time(model_dir):
    """On the CPU a step runs at its launch, before the step ahead of it completes, so the wall time between
    two completions is the next step's. Priced by it, a verify step cost what the plain step after it cost,
    the plain step before it paid for the drafts, and a rollout's last step, completed right after the one
    before it, cost ~0.1 ms, which the budget took as a bucket's plain cost (its least): drafting was judged
    against a plain step 2,000x too cheap."""
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu")
    draft_every_other_step(engine)
    priced, observe = [], engine.spec.observe

    def pricing(seqs, roots, trees, draft_rows, seconds, report=None):
        priced.append((draft_rows, seconds * 1e3))
        observe(seqs, roots, trees, draft_rows, seconds, report)

    engine.spec.observe = pricing
    engine.generate(random_prompts(4, seed=5), SamplingParams(temperature=1.0, n=2, max_new_tokens=10, seed=2,
                                                              ignore_eos=True))
    decode = [(r.draft_rows, r.device_ms) for r in engine.step_log if not r.prefill]
    assert any(rows for rows, _ in decode)
    assert engine.step_log[-1].wall_ms < engine.step_log[-1].device_ms  # (the last step's period)
    assert [rows for rows, _ in priced] == [rows for rows, _ in decode]
    assert [ms for _, ms in priced] == pytest.approx([ms for _, ms in decode], rel=1e-9)
