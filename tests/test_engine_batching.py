"""Continuous batching, prompt sharing, preemption and seeding, on a tiny random Llama."""

from __future__ import annotations

import dataclasses
import random

import pytest

from rollout import Engine, SamplingParams
from rollout.engine.memory import MemoryStateError

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model=str(model_dir), spec="off", device="cpu")


def random_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(num)]


def run_alone(engine, prompt, params=GREEDY):
    return engine.generate([prompt], params)[0][0].token_ids


def test_requests_joining_a_running_batch_get_the_same_tokens_as_alone(engine):
    prompts = random_prompts(6, seed=3)
    reqs = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    for i, p in enumerate(prompts[2:]):
        for _ in range(3 + i):  # later requests arrive while earlier ones decode
            engine.step()
        reqs.append(engine.add_request(p, GREEDY))
    while not all(r.finished for r in reqs):
        engine.step()
    for p, r in zip(prompts, reqs):
        assert r.sequences[0].output_ids == run_alone(engine, p)


def test_n_samples_share_the_prompt_kv(engine):
    prompt = random_prompts(1, seed=4)[0] * 3  # a long-ish prompt, so sharing is visible
    used_before = engine.pool.used_slots
    req = engine.add_request(prompt, SamplingParams(n=8, temperature=1.0, max_new_tokens=5, seed=1))
    engine.step()  # prefill: the prompt is computed once
    assert engine.pool.used_slots - used_before == len(prompt)
    engine.step()  # one decode step: each sample adds the KV of its first token
    assert engine.pool.used_slots - used_before == len(prompt) + 8
    while not req.finished:
        engine.step()
    assert engine.pool.used_slots == used_before


def test_samples_of_a_group_are_independent_and_reproducible(engine):
    prompt = random_prompts(1, seed=5)[0]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=8, seed=123, ignore_eos=True)
    group = [o.token_ids for o in engine.generate([prompt], params)[0]]
    assert len({tuple(t) for t in group}) == 8
    again = [o.token_ids for o in engine.generate([prompt], params)[0]]
    assert again == group


def test_same_seed_same_tokens_different_seed_different_tokens(engine):
    prompt = random_prompts(1, seed=6)[0]
    sample = lambda seed: run_alone(engine, prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed))
    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampled_tokens_do_not_depend_on_batch_composition(engine):
    prompts = random_prompts(4, seed=9)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, seed=42, ignore_eos=True)
    together = [o[0].token_ids for o in engine.generate(prompts, params)]
    assert together == [run_alone(engine, p, params) for p in prompts]


def test_preemption_under_a_small_pool_completes_every_request_correctly(model_dir, engine):
    prompts = random_prompts(10, seed=11)
    expected = [run_alone(engine, p) for p in prompts]
    small = Engine(model=str(model_dir), spec="off", device="cpu", kv_cache_tokens=120)
    outs = small.generate(prompts, GREEDY)
    assert small.scheduler.num_preempted > 0
    assert [o[0].token_ids for o in outs] == expected
    assert small.pool.used_slots == 0


def test_chunked_prefill_matches_one_shot_prefill(model_dir, engine):
    prompt = random_prompts(1, seed=12)[0] * 4
    chunked = Engine(model=str(model_dir), spec="off", device="cpu", max_prefill_tokens=7)
    assert chunked.generate([prompt], GREEDY)[0][0].token_ids == run_alone(engine, prompt)


def test_abort_returns_partial_output_and_frees_kv(engine):
    req = engine.add_request(random_prompts(1, seed=13)[0], SamplingParams(n=2, max_new_tokens=50, seed=0))
    for _ in range(4):
        engine.step()
    assert engine.abort(req.rid)
    updated = engine.step()
    assert req in updated and req.finished
    assert all(s.finish_reason == "abort" and s.num_output > 0 for s in req.sequences)
    assert engine.pool.used_slots == 0


def test_admissions_wait_for_a_share_of_free_rows_but_not_forever(model_dir):
    """With 16 rows a new prompt waits for 2 free rows, or at most MAX_ADMIT_WAIT steps;
    its tokens are those it gets alone."""
    from rollout.engine.scheduler import MAX_ADMIT_WAIT

    engine = Engine(model=str(model_dir), spec="off", device="cpu", max_running_seqs=16)
    assert engine.scheduler.admit_rows == 2
    long = SamplingParams(temperature=0, max_new_tokens=MAX_ADMIT_WAIT + 8, ignore_eos=True)
    prompt, newcomer = random_prompts(2, seed=11)

    def steps_until_admitted(n_running: int) -> int:
        engine.add_request(prompt, dataclasses.replace(long, n=n_running))
        engine.step()  # the first request prefills and starts decoding
        req = engine.add_request(newcomer, GREEDY)
        steps = 0
        while req.sequences[0].num_cached == 0:
            engine.step()
            steps += 1
        while engine.has_work:
            engine.step()
        assert req.sequences[0].output_ids == run_alone(engine, newcomer)
        return steps

    assert steps_until_admitted(14) == 1  # 2 rows free: admitted at once
    assert steps_until_admitted(15) == MAX_ADMIT_WAIT + 1  # 1 row free: waits, then goes anyway


@pytest.mark.parametrize("spec", ["off", "ngram", "auto"])
def test_after_kv_exhaustion_an_idle_engine_holds_no_kv_and_releases_its_memory(spec, model_dir):
    """`auto` on the default model is the hybrid with its shipped draft head, whose scratch slots
    once stayed allocated: an idle engine reported 3% of its pool used (25% of a small one) and
    refused release_memory, which a colocated trainer calls before every training phase."""
    model = "default" if spec == "auto" else str(model_dir)
    engine = Engine(model=model, spec=spec, device="cpu", kv_cache_tokens=320, max_running_seqs=16)
    assert engine.pool.used_slots == 0
    prompts = [[5 + i, 9, 13, 17, 21, 25] for i in range(4)]
    engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=1))
    stats = engine.stats()
    assert stats["rollout/num_preempted"] > 0  # the pool ran dry on the way
    assert stats["rollout/kv_usage"] == 0 and stats["rollout/num_running"] == 0
    assert engine.release_memory(["kv_cache"])["released"] == ["kv_cache"]
    engine.resume_memory(["kv_cache"])
    assert len(engine.generate([[5, 6, 7]], GREEDY)[0][0].token_ids) == 16


def test_engines_sharing_one_model_give_their_own_tokens_and_keep_its_weights(model_dir):
    """A benchmark keeps an engine per speculation mode; on one GPU they serve one model object
    (share_weights_with), or a model of 61 GB could not be held twice: each gives the tokens an
    engine of its own gives, neither lets the shared weights go, and engines that would treat the
    weights differently are refused."""
    first = Engine(model=str(model_dir), spec="off", device="cpu")
    ngram = Engine(model=str(model_dir), spec="ngram", device="cpu", share_weights_with=first)
    own = Engine(model=str(model_dir), spec="ngram", device="cpu")
    assert ngram.model is first.model and own.model is not first.model
    prompts = random_prompts(4, seed=11)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=5)
    tokens = lambda e: [[s.token_ids for s in out] for out in e.generate(prompts, params)]  # noqa: E731
    assert tokens(ngram) == tokens(own) == tokens(first)
    with pytest.raises(MemoryStateError, match="share_weights_with"):
        ngram.release_memory(["weights"])
    with pytest.raises(ValueError, match="differ in dtype"):
        Engine(model=str(model_dir), spec="off", device="cpu", dtype="bfloat16", share_weights_with=first)
