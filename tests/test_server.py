"""`rollout serve` on a tiny random Llama: SGLang-native /generate, errors, keys, aborts, metrics."""

from __future__ import annotations

import json
import time

import pytest
import requests
from server_process import running_server

from rollout import Engine, SamplingParams, SpecConfig

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
META_FIELDS = {
    "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
    "output_token_weight_versions", "spec_verify_ct", "spec_accept_length", "spec_draft_token_num",
    "spec_accept_token_num", "spec_by_source",
}  # fmt: skip
PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21]


@pytest.fixture(scope="module")
def server(model_dir):
    # a fixed draft budget: the adaptive one follows step timings, so its drafts differ run to run
    with running_server(str(model_dir), "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--spec-no-adaptive") as s:
        yield s


@pytest.fixture(scope="module")
def engine(model_dir):
    """The in-process engine the server must agree with (the server's settings)."""
    return Engine(model=str(model_dir), device="cpu", spec=SpecConfig(method="auto", adaptive=False))


def generate(server, body, headers=USER, timeout=120, **kw):
    return requests.post(server.url + "/generate", json=body, headers=headers, timeout=timeout, **kw)


def engine_stats(server) -> dict:
    return requests.get(server.url + "/get_server_info", headers=USER, timeout=30).json()["stats"]


def sse_events(response) -> list:
    events = [line.removeprefix(b"data: ") for line in response.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_generate_with_n4_and_logprobs_has_the_design_fields_and_equals_engine_generate(server, engine):
    params = {"n": 4, "temperature": 1.0, "max_new_tokens": 12, "seed": 7, "ignore_eos": True}
    r = generate(server, {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True})
    assert r.status_code == 200, r.text
    results = r.json()
    assert isinstance(results, list) and len(results) == 4
    expected = engine.generate([PROMPT], SamplingParams(**params), return_logprob=True)[0]
    for res, exp in zip(results, expected):
        assert set(res) == {"text", "output_ids", "meta_info"}
        meta = res["meta_info"]
        assert set(meta) == META_FIELDS | {"output_token_logprobs"}
        assert res["output_ids"] == exp.token_ids
        assert res["text"] == exp.text
        assert [t for _, t, _ in meta["output_token_logprobs"]] == exp.token_ids
        assert all(x is None for _, _, x in meta["output_token_logprobs"])
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(exp.logprobs, abs=1e-5)
        assert meta["finish_reason"] == {"type": "length", "length": 12, "matched": None, "message": None}
        assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 12
        assert meta["weight_version"] == "0" and meta["output_token_weight_versions"] == ["0"] * 12
        assert meta["spec_verify_ct"] == exp.spec["verify_steps"] and meta["spec_draft_token_num"] == exp.spec["draft_tokens"]
        assert meta["spec_accept_token_num"] == exp.spec["accepted_tokens"]
        assert meta["spec_accept_length"] == pytest.approx(12 / exp.spec["verify_steps"])
        assert meta["cached_tokens"] == exp.cached_tokens == (0 if res is results[0] else len(PROMPT))
    assert len({r["meta_info"]["id"] for r in results}) == 1  # one request, four samples
    assert len({tuple(r["output_ids"]) for r in results}) == 4


def test_single_prompt_gives_an_object_and_a_stop_token_gives_stop_with_matched(server, engine):
    greedy = {"temperature": 0, "max_new_tokens": 8}
    first = generate(server, {"input_ids": PROMPT, "sampling_params": greedy}).json()
    assert isinstance(first, dict) and "output_token_logprobs" not in first["meta_info"]
    stop_at = first["output_ids"][3]
    r = generate(server, {"input_ids": PROMPT, "sampling_params": {**greedy, "stop_token_ids": [stop_at]}}).json()
    cut = first["output_ids"].index(stop_at) + 1
    assert r["output_ids"] == first["output_ids"][:cut]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at, "message": None}


def test_text_prompts_are_tokenized_like_the_engine_does(server, engine):
    params = {"temperature": 0, "max_new_tokens": 6}
    r = generate(server, {"text": "7 8 9 10", "sampling_params": params}).json()
    exp = engine.generate(["7 8 9 10"], SamplingParams(**params))[0][0]
    assert (r["output_ids"], r["text"], r["meta_info"]["prompt_tokens"]) == (exp.token_ids, exp.text, exp.prompt_tokens)


def test_a_batch_with_n_is_a_flat_prompt_major_list_carrying_the_given_rids(server, engine):
    prompts = [PROMPT, [30, 31, 32], [40, 41]]
    params = {"n": 2, "temperature": 1.0, "max_new_tokens": 5, "seed": 3, "ignore_eos": True}
    r = generate(server, {"input_ids": prompts, "sampling_params": params, "rid": ["a", "b", "c"]})
    results = r.json()
    assert [x["meta_info"]["id"] for x in results] == ["a", "a", "b", "b", "c", "c"]
    expected = engine.generate(prompts, SamplingParams(**params))
    assert [x["output_ids"] for x in results] == [o.token_ids for group in expected for o in group]


def test_streaming_yields_the_same_tokens_and_text_as_non_streaming(server):
    # long enough that the front end cannot receive everything in one engine message (it coalesces
    # what arrived while it was busy), so the stream has several chunks per sample: at 64 tokens a
    # front end starved of the CPU by other work once took a whole sample in one chunk
    body = {"input_ids": [PROMPT, [50, 51]], "sampling_params": {"n": 2, "max_new_tokens": 192, "seed": 11, "ignore_eos": True}}
    plain = generate(server, body).json()
    with generate(server, {**body, "stream": True}, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r)
    last = {}
    for c in chunks:  # cumulative chunks (SGLang's default): each extends the previous one of its sample
        prev = last.get(c["index"], {"output_ids": []})
        assert c["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        last[c["index"]] = c
    assert len(chunks) > len(last)  # it did stream
    assert [last[i]["output_ids"] for i in range(4)] == [p["output_ids"] for p in plain]
    assert [last[i]["text"] for i in range(4)] == [p["text"] for p in plain]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(4))


BAD_INPUTS = [
    ("malformed JSON", b'{"text": "1 2"', "not valid JSON"),
    ("not an object", b"[1, 2]", "JSON object"),
    ("invalid UTF-8", b'{"text": "\xff\xfe 1 2"}', "UTF-8"),
    ("lone surrogate", b'{"text": "\\ud800"}', "text"),
    ("empty body", b"", "empty"),
    ("unknown field", {"text": "1 2", "prompt": "x"}, "prompt"),
    ("unknown sampling field", {"text": "1 2", "sampling_params": {"temp": 1}}, "sampling_params.temp"),
    ("wrong type", {"text": "1 2", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("wrong type of flag", {"text": "1 2", "return_logprob": "yes"}, "return_logprob"),
    ("negative temperature", {"text": "1 2", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("empty prompt", {"text": ""}, "text"),
    ("empty ids", {"input_ids": []}, "input_ids"),
    ("no prompt", {"sampling_params": {}}, "text"),
    ("both prompts", {"text": "1", "input_ids": [1]}, "input_ids"),
    ("id out of vocabulary", {"input_ids": [5, 10**6]}, "input_ids"),
    ("id not an integer", {"input_ids": [5, 1.5]}, "input_ids"),
    ("prompt longer than the context", {"input_ids": [5] * 2000}, "context"),
    ("max_new_tokens 0", {"text": "1 2", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("max_new_tokens huge", {"text": "1 2", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ("n 0", {"text": "1 2", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("rid list for one prompt", {"text": "1 2", "rid": ["a", "b"]}, "rid"),
    ("duplicate rids", {"text": ["1", "2"], "rid": ["a", "a"]}, "rid"),
]


@pytest.mark.parametrize("body,needle", [(b, n) for _, b, n in BAD_INPUTS], ids=[name for name, _, _ in BAD_INPUTS])
def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, body, needle):
    if isinstance(body, dict):
        r = generate(server, body)
    else:
        r = requests.post(server.url + "/generate", data=body, headers={**USER, "Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert needle in error["message"], error
    ok = generate(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) <= 2


def test_a_body_over_the_size_limit_gets_413(server):
    r = requests.post(server.url + "/generate", data=b" " * (65 << 20), headers=USER, timeout=60)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_generation_routes_need_the_api_key_and_accept_the_admin_key(server):
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert generate(server, body, headers={}).status_code == 401
    assert generate(server, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert generate(server, body, headers=ADMIN).status_code == 200
    assert requests.get(server.url + "/health", timeout=10).status_code == 200  # probes need no key


def test_control_routes_answer_401_without_the_admin_key_and_change_nothing(server):
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}, "rid": "keep-me"}
    with generate(server, {**long, "stream": True}, stream=True) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))  # it is running
        for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
            for body in ({"rid": "keep-me"}, {"abort_all": True}):
                denied = requests.post(server.url + "/abort_request", json=body, headers=headers, timeout=10)
                assert denied.status_code == 401, denied.text
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(events[-1]["output_ids"]) == 64


def test_abort_request_with_the_admin_key_returns_partial_output_finished_by_abort(server):
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}, "rid": "stop-me"}
    with generate(server, {**long, "stream": True}, stream=True) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        ok = requests.post(server.url + "/abort_request", json={"rid": "stop-me"}, headers=ADMIN, timeout=10)
        assert ok.status_code == 200 and ok.json() == {"aborted": ["stop-me"]}
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(events[-1]["output_ids"]) < 800


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_frees_its_kv(server):
    before = engine_stats(server)
    assert before["rollout/kv_usage"] == 0
    long = {"input_ids": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 900, "ignore_eos": True}, "stream": True}
    with generate(server, long, stream=True) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        deadline = time.monotonic() + 20
        while engine_stats(server)["rollout/kv_usage"] == 0:  # (the server info may be a moment old)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while (stats := engine_stats(server))["rollout/num_requests"] or stats["rollout/kv_usage"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["rollout/output_tokens"] - before["rollout/output_tokens"] < 2 * 900


def test_a_client_that_disconnects_before_a_plain_answer_aborts_its_request(server):
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with pytest.raises(requests.ReadTimeout):
        generate(server, long, headers=USER, timeout=(5, 0.5))
    deadline = time.monotonic() + 20
    while (stats := engine_stats(server))["rollout/num_requests"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_metrics_are_prometheus_text_named_after_the_engine_stats(server):
    generate(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    r = requests.get(server.url + "/metrics", headers=USER, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("rollout_spec_accept_rate", "rollout_spec_accept_length", "rollout_spec_draft_tokens",
                 "rollout_tokens_per_s", "rollout_weight_version", "rollout_kv_usage", "rollout_queue_depth",
                 "rollout_requests_in_flight", "rollout_engine_up"):  # fmt: skip
        assert name in values, name
    assert values["rollout_requests_total"] >= 1 and values["rollout_generation_tokens_total"] >= 3
    assert values['rollout_samples_finished_total{finish_reason="length"}'] >= 1
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 401


def test_info_routes_describe_the_model_and_never_show_the_keys(server):
    model = requests.get(server.url + "/get_model_info", headers=USER, timeout=10).json()
    assert model["is_generation"] and model["max_model_len"] == 1024
    info = requests.get(server.url + "/get_server_info", headers=USER, timeout=10).text
    assert API_KEY not in info and ADMIN_KEY not in info
    assert json.loads(info)["weight_version"] == "0"
