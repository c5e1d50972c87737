"""Admission as SGLang admits: a group whose samples would together outgrow the KV pool is served
(its newest samples are preempted and recomputed as the pool runs dry), and only a request that
can never run is refused."""

from __future__ import annotations

import pytest

from rollout import Engine, SamplingParams

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]  # 12 tokens, as the request


def sampled(n: int, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def large(model_dir):
    return Engine(model=str(model_dir), spec="off", device="cpu", kv_cache_tokens=16384)


@pytest.fixture(scope="module")
def small(model_dir):
    return Engine(model=str(model_dir), spec="off", device="cpu", kv_cache_tokens=512)


def test_a_group_whose_worst_case_exceeds_the_pool_gets_the_tokens_of_a_large_pool(model_dir, large):
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu", kv_cache_tokens=2048)
    params = sampled(16, 192)  # 12 + 16 x 192 = 3,084 slots at worst, on a 2,048-slot pool
    got = [o.token_ids for o in engine.generate([PROMPT], params)[0]]
    assert engine.scheduler.num_preempted > 0  # the pool ran dry on the way
    assert got == [o.token_ids for o in large.generate([PROMPT], params)[0]]  # (and speculation changed nothing)
    assert engine.pool.used_slots == 0


def test_a_group_four_times_the_pool_finishes(small):
    outs = small.generate([PROMPT], sampled(64, 32))[0]  # 12 + 64 x 32 = 2,060 slots at worst
    assert [len(o.token_ids) for o in outs] == [32] * 64
    assert all(o.finish_reason == "length" for o in outs)
    assert small.pool.used_slots == 0 and not small.has_work


def test_many_oversized_groups_arriving_together_all_finish_and_leave_the_pool_empty(small):
    prompts = [[3 + k, *PROMPT[k:]] for k in range(6)]
    reqs = [small.add_request(p, sampled(8, 24 + 4 * k)) for k, p in enumerate(prompts)]  # 2.3x the pool at worst
    while small.has_work:
        small.step()
    assert all(r.finished for r in reqs)
    assert [[s.num_output for s in r.sequences] for r in reqs] == [[24 + 4 * k] * 8 for k in range(6)]
    assert small.pool.used_slots == 0


def test_a_sample_that_can_never_fit_is_refused_naming_the_limit(model_dir):
    engine = Engine(model=str(model_dir), spec="off", device="cpu", kv_cache_tokens=400,
                    max_running_seqs=512)  # (the context holds 1,024)
    with pytest.raises(ValueError, match=r"max_new_tokens: one sample needs up to prompt \+ max_new_tokens = 512 KV "
                                         r"slots, more than the pool holds \(400\)"):
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=500))
    with pytest.raises(ValueError, match=r"n: the prompt's 12 KV slots and one for each of 389 samples"):
        engine.add_request(PROMPT, SamplingParams(n=389, max_new_tokens=8))  # (389 rows: within --max-running-seqs)
    assert not engine.has_work
    assert len(engine.generate([PROMPT], SamplingParams(max_new_tokens=388, ignore_eos=True))[0][0].token_ids) == 388


def test_admission_keeps_room_for_what_running_samples_add_so_a_small_pool_seldom_preempts(model_dir, large):
    prompts = [[3 + k, *PROMPT[k:]] for k in range(8)]
    params = sampled(4, 48)  # 8 x 4 samples of 48 tokens: 2,000 slots at the end, on 400

    def run(conservativeness: float) -> tuple[list, int]:
        engine = Engine(model=str(model_dir), spec="off", device="cpu", kv_cache_tokens=400,
                        schedule_conservativeness=conservativeness)
        outs = [[o.token_ids for o in group] for group in engine.generate(prompts, params)]
        return outs, engine.scheduler.num_preempted

    greedy, thrash = run(0)  # admit whatever fits now
    planned, preempted = run(1)
    assert planned == greedy == [[o.token_ids for o in group] for group in large.generate(prompts, params)]
    assert preempted * 4 <= thrash, (preempted, thrash)


# ---------------- over HTTP ----------------
@pytest.fixture(scope="module")
def server(model_dir):
    from server_process import running_server

    with running_server(str(model_dir), "--kv-cache-tokens", "1000") as s:
        yield s


def test_the_server_serves_a_group_three_times_its_pool_and_refuses_only_what_can_never_fit(server, large):
    import requests

    params = {"n": 16, "temperature": 1.0, "max_new_tokens": 192, "seed": 7, "ignore_eos": True}
    r = requests.post(server.url + "/generate", json={"input_ids": PROMPT, "sampling_params": params}, timeout=300)
    assert r.status_code == 200, r.text
    assert [s["output_ids"] for s in r.json()] == [o.token_ids for o in large.generate([PROMPT], sampled(16, 192))[0]]
    r = requests.post(server.url + "/generate", timeout=30,
                      json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 990}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "sampling_params.max_new_tokens: one sample needs up to prompt + max_new_tokens = 1002 KV slots, more than "
        "the pool holds (1000); ask for at most 988 new tokens, or raise --kv-cache-tokens")


def test_many_groups_over_the_pool_arriving_together_are_all_answered_and_the_pool_empties(server):
    import requests
    from concurrent.futures import ThreadPoolExecutor

    def one(k: int) -> requests.Response:
        body = {"input_ids": [3 + k, *PROMPT], "sampling_params": {"n": 8, "temperature": 1.0, "max_new_tokens": 64 + k,
                                                                     "ignore_eos": True}}
        return requests.post(server.url + "/generate", json=body, timeout=300)

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))  # 12 x 8 samples of ~70 tokens: ~7,000 slots at worst, on 1,000
    assert [r.status_code for r in answers] == [200] * 12
    assert [[len(s["output_ids"]) for s in r.json()] for r in answers] == [[64 + k] * 8 for k in range(12)]
    stats = requests.get(server.url + "/get_server_info", timeout=10).json()["stats"]
    assert stats["rollout/kv_usage"] == 0 and stats["rollout/num_requests"] == 0
