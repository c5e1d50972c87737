"""`rollout serve` as a drop-in for trainers written for SGLang (slime, AReaL), and a server that
bad requests cannot take down: a fuzz table, hopeless requests, /health under load, proxies."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import save_file
from server_process import running_server
from tiny_models import VOCAB

PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21]
ORDINARY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def server(model_dir):
    # No keys: control routes answer loopback clients that came through no proxy.
    with running_server(str(model_dir), "--max-running-seqs", "64", "--kv-cache-tokens", "8192") as s:
        yield s


def post(server, path, body=None, timeout=60, **kw):
    return requests.post(server.url + path, json=body, timeout=timeout, **kw)


def engine_pid(server) -> int:
    return requests.get(server.url + "/get_server_info", timeout=30).json()["engine_pid"]


def in_flight(server) -> int:
    return requests.get(server.url + "/v1/loads?include=core,disagg,queues", timeout=10).json()["loads"][0]["num_total_reqs"]


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------- the trainers' own request bodies ----------------
def test_slimes_rollout_body_succeeds_with_the_fields_slime_reads(server):
    # slime/rollout/sglang_rollout.py: GenerateState.sampling_params, the deterministic-inference seed, and the payload
    sampling_params = dict(
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=24, stop=None, stop_token_ids=None,
        skip_special_tokens=True, no_stop_trim=True, spaces_between_special_tokens=False, sampling_seed=42,
    )  # fmt: skip
    r = post(server, "/generate", {"sampling_params": sampling_params, "return_logprob": True, "input_ids": PROMPT})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    tokens = [t for _, t, _ in meta["output_token_logprobs"]]  # slime: item[1] tokens, item[0] logprobs
    assert tokens == out["output_ids"] and len(tokens) == meta["completion_tokens"] >= 1
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    for key in ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_tokens",
                "cached_tokens", "prompt_tokens", "weight_version"):  # Sample.SpecInfo / PrefixCacheInfo / update_from_meta_info
        assert key in meta, key
    assert meta["prompt_tokens"] == len(PROMPT) and meta["cached_tokens"] == 0
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    same = post(server, "/generate", {"sampling_params": sampling_params, "return_logprob": True, "input_ids": PROMPT})
    assert same.json()["output_ids"] == out["output_ids"]  # sampling_seed is the seed


def test_slimes_eval_body_with_penalties_and_min_new_tokens_succeeds(server):
    # slime eval_rollout_single_dataset: no_stop_trim, repetition_penalty, min_new_tokens
    sampling_params = dict(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop=["\n\n"],
                           stop_token_ids=[2], skip_special_tokens=False, no_stop_trim=True,
                           spaces_between_special_tokens=False, repetition_penalty=1.1, min_new_tokens=6)
    r = post(server, "/generate", {"sampling_params": sampling_params, "return_logprob": True, "text": "5 9 13"})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) >= 6


def test_areals_body_succeeds_and_its_finish_reason_has_a_message(server):
    # areal/engine/sglang_remote.py RemoteSGLangEngine.agenerate (GenerationHyperparameters defaults: top_k 1e8)
    sample_params = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 12, "temperature": 1.0,
                     "stop_token_ids": [2], "frequency_penalty": 0.5}
    payload = {"input_ids": PROMPT, "image_data": None, "sampling_params": sample_params, "return_logprob": True,
               "stream": False}
    r = post(server, "/generate", payload)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert "message" in meta["finish_reason"] and meta["finish_reason"]["type"] in ("stop", "length")
    assert [x[1] for x in meta["output_token_logprobs"]] == r.json()["output_ids"]


def test_a_request_aborted_before_prefill_says_so_as_sglang_does(server):
    assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, server, "/generate", {**ORDINARY, "rid": "held-one"})
            wait_until(lambda: requests.get(server.url + "/get_server_info", timeout=10).json()["weight_sync"]["held_requests"] == 1,
                       "the request to be held")
            assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
            assert post(server, "/continue_generation", {}).status_code == 200
            finish = held.result(30).json()["meta_info"]["finish_reason"]
    finally:
        post(server, "/continue_generation", {})
    assert finish == {"type": "abort", "matched": None, "message": "Abort before prefill"}


def test_the_routes_slime_and_areal_call_answer(server):
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert requests.get(server.url + "/flush_cache", timeout=10).status_code == 200  # idle
    assert post(server, "/flush_cache").status_code == 200
    assert in_flight(server) == 0
    assert requests.post(server.url + "/pause_generation", timeout=10).status_code == 200  # AReaL: no body
    assert post(server, "/continue_generation", {}).status_code == 200
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, server, "/generate", long)
        wait_until(lambda: in_flight(server) == 1, "the request to show in /v1/loads")
        busy = requests.get(server.url + "/flush_cache", timeout=10)
        assert busy.status_code == 400 and "in flight" in busy.json()["error"]["message"]
        assert post(server, "/abort_request", {"abort_all": True}).status_code == 200  # slime's abort_servers_until_idle
        assert running.result(30).json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: in_flight(server) == 0, "the server to be idle")
    assert post(server, "/destroy_weights_update_group", {"group_name": "never-made"}).status_code == 404


def test_update_weights_from_disk_takes_areals_payload_and_load_format(server, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    before = requests.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"]
    version = str(int(before) + 1)
    r = post(server, "/update_weights_from_disk", dict(model_path=str(tmp_path), abort_all_requests=True,
                                                      load_format=None, weight_version=version))
    assert r.status_code == 200, r.text
    assert requests.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"] == version
    bad = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "load_format": "gguf"})
    assert bad.status_code == 400 and "load_format" in bad.json()["error"]["message"]


def test_release_and_resume_memory_hold_requests_then_serve_them(server):
    before = post(server, "/generate", ORDINARY).json()["output_ids"]
    r = post(server, "/release_memory_occupation", {})  # slime: no tags, everything
    assert r.status_code == 200, r.text
    assert set(r.json()["released"]) >= {"weights", "kv_cache"}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, server, "/generate", ORDINARY)
        time.sleep(0.5)
        assert not waiting.done()  # nothing runs while the memory is the trainer's
        assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}).json()["released"] == ["kv_cache"]
        time.sleep(0.3)
        assert not waiting.done()
        assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}).json()["released"] == []
        assert waiting.result(30).json()["output_ids"] == before
    bad = post(server, "/release_memory_occupation", {"tags": ["gpu"]})
    assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]


def test_stream_interval_sends_a_chunk_per_interval_tokens(server):
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True, "stream_interval": 8, "temperature": 0}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths[-1] == 20 and all(b - a >= 8 for a, b in zip(lengths, lengths[1:-1]))


def test_top_logprobs_num_on_generate(server):
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    meta = post(server, "/generate", body).json()["meta_info"]
    assert len(meta["output_top_logprobs"]) == 5
    for (lp, token, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == token and top[0][0] == pytest.approx(lp, abs=1e-5)  # greedy: the argmax
        assert text == str(token) == top[0][2]  # the tiny model's tokenizer spells token i as "i"


# ---------------- bad input ----------------
def _garbage_checkpoints(root):
    """Directories whose safetensors file is garbage, truncated, or claims a huge header."""
    dirs = {}
    for name, data in {
        "garbage": os.urandom(2000),
        "truncated": None,
        "oversized": struct.pack("<Q", 10**12) + b"{}",
    }.items():
        d = root / name
        d.mkdir()
        if data is None:
            save_file({"model.norm.weight": torch.randn(64)}, str(d / "model.safetensors"))
            data = (d / "model.safetensors").read_bytes()[:-100]
        (d / "model.safetensors").write_bytes(data)
        dirs[name] = str(d)
    return dirs


def _fuzz_table(tmp_path) -> list[tuple[str, str, object]]:
    """(path, what, body) of malformed requests; a body of bytes is sent raw."""
    g = "/generate"
    base = {"input_ids": [5, 6, 7]}
    cases: list[tuple[str, str, object]] = [
        (g, "malformed JSON", b'{"text": "1 2"'), (g, "not an object", b"[1, 2]"), (g, "a string", b'"hi"'),
        (g, "invalid UTF-8", b'{"text": "\xff\xfe"}'), (g, "lone surrogate text", b'{"text": "\\udc80"}'),
        (g, "lone surrogate in stop", b'{"input_ids": [5], "sampling_params": {"stop": "\\udc80"}}'),
        (g, "lone surrogate in stop list", b'{"input_ids": [5], "sampling_params": {"stop": ["a", "\\ud800"]}}'),
        (g, "lone surrogate rid", b'{"input_ids": [5], "rid": "\\udc80"}'),
        (g, "lone surrogate field name", b'{"input_ids": [5], "\\udc80": 1}'),
        (g, "empty body", b""), (g, "deep nesting", b"[" * 100000 + b"]" * 100000),
        (g, "unknown field", {**base, "prompt": "x"}), (g, "regex", {**base, "sampling_params": {"regex": "a+"}}),
        (g, "json_schema", {**base, "sampling_params": {"json_schema": "{}"}}),
        (g, "ebnf", {**base, "sampling_params": {"ebnf": "x"}}),
        (g, "image", {**base, "image_data": "http://x/y.png"}), (g, "lora", {**base, "lora_path": "lora_1"}),
        (g, "routed experts", {**base, "return_routed_experts": True}),
        (g, "prompt logprobs", {**base, "logprob_start_len": 0}),
        (g, "top_logprobs_num huge", {**base, "return_logprob": True, "top_logprobs_num": 10**6}),
        (g, "both prompts", {"text": "1", "input_ids": [1]}), (g, "no prompt", {}),
        (g, "empty ids", {"input_ids": []}), (g, "nested empty ids", {"input_ids": [[]]}),
        (g, "id out of vocabulary", {"input_ids": [5, VOCAB]}), (g, "negative id", {"input_ids": [-1]}),
        (g, "id 2**63", {"input_ids": [2**63]}), (g, "float id", {"input_ids": [1.5]}), (g, "bool id", {"input_ids": [True]}),
        (g, "prompt too long", {"input_ids": [5] * 2000}), (g, "rid list for one prompt", {**base, "rid": ["a", "b"]}),
        (g, "duplicate rids", {"input_ids": [[5], [6]], "rid": ["a", "a"]}), (g, "rid too long", {**base, "rid": "x" * 1000}),
        (g, "stream not a flag", {**base, "stream": "yes"}), (g, "return_logprob 1", {**base, "return_logprob": 1}),
    ]  # fmt: skip
    bad_sampling = {
        "n": [0, -1, 10_000, 65, 2**63, 10**20, 1.5, "8"], "max_new_tokens": [0, -5, 10**12, 2**63, "64"],
        "min_new_tokens": [-1, 10**6], "top_k": [2**63, 10**20, -2, 1.5], "top_p": [0, 1.5, -1, "1"],
        "min_p": [-0.1, 2], "temperature": [-1, "hot", float("nan")], "frequency_penalty": [3, -3],
        "presence_penalty": [2.5], "repetition_penalty": [0, -1, 3], "stop_token_ids": [[10**20], [-1], [VOCAB], "2"],
        "seed": [2**64, 1.5], "sampling_seed": [2**64], "logit_bias": [{"x": 1}, {"5": 1000}, {str(VOCAB): 1}, [1]],
        "stop": [[""], 5, [1]], "ignore_eos": ["yes"], "no_stop_trim": [1], "stream_interval": [0],
        "custom_params": [5], "temp": [1],
    }  # fmt: skip
    for field, values in bad_sampling.items():
        for v in values:
            if v is None:
                continue
            cases.append((g, f"sampling_params.{field}={v!r:.30}", {**base, "sampling_params": {field: v}}))
    cases += [(g, "seed and sampling_seed differ", {**base, "sampling_params": {"seed": 1, "sampling_seed": 2}}),
              (g, "max_new_tokens over the context", {**base, "sampling_params": {"max_new_tokens": 1022}})]
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases += [
        (chat, "no messages", {"model": "x"}), (chat, "empty messages", {"messages": []}),
        (chat, "bad role", {"messages": [{"role": "wizard", "content": "hi"}]}),
        (chat, "lone surrogate content", b'{"messages": [{"role": "user", "content": "\\udc80"}]}'),
        (chat, "top_logprobs 21", {"messages": msgs, "logprobs": True, "top_logprobs": 21}),
        (chat, "top_logprobs without logprobs", {"messages": msgs, "top_logprobs": 2}),
        (chat, "n huge", {"messages": msgs, "n": 10_000}), (chat, "max_tokens 0", {"messages": msgs, "max_tokens": 0}),
        (chat, "response_format json", {"messages": msgs, "response_format": {"type": "json_object"}}),
        (chat, "tools", {"messages": msgs, "tools": [{"type": "function"}]}),
        (cmpl, "no prompt", {"model": "x"}), (cmpl, "logprobs 50", {"prompt": "hi", "logprobs": 50}),
        (cmpl, "prompt of dicts", {"prompt": [{"a": 1}]}), (cmpl, "echo", {"prompt": "hi", "echo": True}),
        (cmpl, "best_of", {"prompt": "hi", "best_of": 3}), (cmpl, "top_k 2**63", {"prompt": "hi", "top_k": 2**63}),
        (cmpl, "temperature string", {"prompt": "hi", "temperature": "0"}),
    ]  # fmt: skip
    ckpt = _garbage_checkpoints(tmp_path)
    upd = "/update_weights_from_distributed"
    cases += [
        ("/update_weights_from_disk", f"{name} safetensors", {"model_path": path}) for name, path in ckpt.items()
    ] + [
        ("/update_weights_from_disk", "missing directory", {"model_path": str(tmp_path / "nope")}),
        ("/update_weights_from_disk", "no model_path", {}),
        ("/update_weights_from_disk", "weight_version 2**64", {"model_path": ckpt["garbage"], "weight_version": 2**64}),
        ("/update_weights_from_disk", "flush_cache not a flag", {"model_path": ckpt["garbage"], "flush_cache": "no"}),
        (upd, "no group", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}),
        (upd, "missing shapes", {"names": ["a"], "dtypes": ["float32"]}),
        ("/init_weights_update_group", "bad port", {"master_address": "127.0.0.1", "master_port": 10**9,
                                                   "rank_offset": 1, "world_size": 2}),
        ("/init_weights_update_group", "rank 0", {"master_address": "127.0.0.1", "master_port": 1234,
                                                 "rank_offset": 0, "world_size": 2}),
        ("/init_weights_update_group", "port not a number", {"master_address": "h", "master_port": "x",
                                                            "rank_offset": 1, "world_size": 2}),
        ("/update_weights_from_tensor", "on a CPU engine", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                           "shapes": [[64]], "handles": [{}]}),
        ("/pause_generation", "bad mode", {"mode": "nap"}), ("/abort_request", "no rid", {}),
        ("/abort_request", "rid a number", {"rid": 5}), ("/release_memory_occupation", "tags a string", {"tags": "kv_cache"}),
        ("/resume_memory_occupation", "unknown tag", {"tags": ["gpu"]}), ("/flush_cache", "unknown field", {"x": 1}),
    ]  # fmt: skip
    return cases


def test_a_hundred_malformed_requests_each_get_a_4xx_fast_and_the_engine_process_lives(server, tmp_path):
    pid = engine_pid(server)
    cases = _fuzz_table(tmp_path)
    assert len(cases) >= 100
    for path, what, body in cases:
        t0 = time.monotonic()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()  # (NaN goes out as NaN)
        r = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=5)
        assert 400 <= r.status_code < 500, (path, what, r.status_code, r.text[:300])
        assert r.json()["error"]["message"], (path, what)
        assert time.monotonic() - t0 < 5, (path, what)
    ok = post(server, "/generate", ORDINARY)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
    assert engine_pid(server) == pid
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_a_tiny_temperature_is_greedy_with_finite_logprobs(server):
    body = {**ORDINARY, "return_logprob": True}
    greedy = post(server, "/generate", body).json()
    tiny = post(server, "/generate", {**body, "sampling_params": {**ORDINARY["sampling_params"], "temperature": 1e-30}}).json()
    assert tiny["output_ids"] == greedy["output_ids"]
    assert all(-1e9 < lp <= 0 for lp, _, _ in tiny["meta_info"]["output_token_logprobs"])


def test_hopeless_requests_do_not_delay_an_ordinary_one(server):
    hopeless = [
        {"input_ids": [5], "sampling_params": {"n": 10_000}},
        {"input_ids": [5], "sampling_params": {"top_k": 2**63}},
        {"input_ids": [5], "sampling_params": {"top_k": 10**20}},
        {"input_ids": [5], "sampling_params": {"stop_token_ids": [10**20]}},
        {"input_ids": [5], "sampling_params": {"n": 65}},
        {"input_ids": [5], "sampling_params": {"max_new_tokens": 10**9}},
        {"input_ids": [5] * 5000},
        {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 100}},
        {"input_ids": [5], "sampling_params": {"seed": 2**64}},
        {"input_ids": [5], "rid": "\udc80"},
    ]
    t0 = time.monotonic()
    assert post(server, "/generate", ORDINARY).status_code == 200
    alone = time.monotonic() - t0
    with ThreadPoolExecutor(len(hopeless) + 1) as pool:
        bad = [pool.submit(post, server, "/generate", body, 10) for body in hopeless]
        t0 = time.monotonic()
        ok = pool.submit(post, server, "/generate", ORDINARY).result(10)
        with_them = time.monotonic() - t0
        statuses = [f.result().status_code for f in bad]
    assert ok.status_code == 200
    assert with_them < alone + 1.0, (alone, with_them)
    assert all(400 <= s < 500 for s in statuses), statuses


def test_a_large_n_that_must_wait_does_not_block_the_requests_behind_it(server):
    long = {"input_ids": PROMPT, "sampling_params": {"n": 40, "max_new_tokens": 150, "ignore_eos": True}}
    big = {"input_ids": [7, 8], "sampling_params": {"n": 60, "max_new_tokens": 4}}  # fits only once `long` is done
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, server, "/generate", long)
        wait_until(lambda: in_flight(server) == 1, "the long request")
        waiting = pool.submit(post, server, "/generate", big)
        wait_until(lambda: in_flight(server) == 2, "the large request")
        t0 = time.monotonic()
        assert post(server, "/generate", ORDINARY).status_code == 200
        assert not first.done() and not waiting.done(), "the ordinary request passed the one that cannot fit yet"
        assert time.monotonic() - t0 < 5
        assert waiting.result(60).status_code == 200 and first.result(60).status_code == 200


def test_health_answers_within_a_second_under_full_load(server):
    prompts = [{"text": " ".join(str(5 + (i * 7 + j) % 400) for j in range(100)),
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}} for i in range(300)]  # fmt: skip
    with ThreadPoolExecutor(128) as pool:
        load = [pool.submit(post, server, "/generate", p, 300) for p in prompts]
        time.sleep(0.5)
        worst = 0.0
        for _ in range(10):
            t0 = time.monotonic()
            assert requests.get(server.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.2)
        assert sum(not f.done() for f in load) > 0  # the load was still there
        assert all(f.result().status_code == 200 for f in load)
    assert worst < 1.0, worst


# ---------------- control routes and proxies ----------------
@pytest.mark.parametrize("header", [
    {"X-Forwarded-For": "203.0.113.7"}, {"X-Forwarded-For": "127.0.0.1"}, {"Forwarded": "for=127.0.0.1"},
    {"X-Real-IP": "127.0.0.1"}, {"Via": "1.1 proxy"}, {"X-Forwarded-Host": "example.org"},
    {"X-Client-IP": "127.0.0.1"}, {"True-Client-IP": "127.0.0.1"}, {"CF-Connecting-IP": "127.0.0.1"},
    {"X-Original-Forwarded-For": "127.0.0.1"}, {"X-Forwarded-Proto": "http"}, {"X-Forwarded-Port": "80"},
    {"X_Forwarded_For": "127.0.0.1"},
])  # fmt: skip
def test_forwarded_headers_never_open_control_routes(server, header):
    for path, body in [("/abort_request", {"abort_all": True}), ("/pause_generation", {}), ("/flush_cache", None),
                       ("/update_weights_from_disk", {"model_path": "/nope"})]:
        r = requests.post(server.url + path, json=body, headers=header, timeout=10)
        assert r.status_code == 403, (path, r.text)
    assert post(server, "/generate", ORDINARY, headers=header).status_code == 200  # generation is not a control route


def test_serve_refuses_a_network_address_without_an_admin_key(model_dir):
    cmd = [sys.executable, "-m", "rollout", "serve", "--model", str(model_dir), "--device", "cpu", "--host", "0.0.0.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--admin-key" in r.stderr


def test_serve_without_the_server_packages_names_the_missing_one_whatever_the_arguments():
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from rollout.tools.cli import main\n"
            "main(['serve', '--port', '1234', '--model', 'x'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs the package fastapi" in r.stderr, r.stderr


def test_the_engine_loop_fails_the_request_a_step_raised_on_and_goes_on(model_dir, monkeypatch):
    from rollout import Engine, SamplingParams
    from rollout.server import protocol
    from rollout.server.engine_loop import EngineLoop

    class Pipe:
        def __init__(self):
            self.messages = []

        def send(self, data):
            self.messages.append(protocol.unpack(data))

    engine = Engine(model=str(model_dir), device="cpu", spec="off")
    pipe = Pipe()
    loop = EngineLoop(engine, recv=None, send=pipe)
    add = lambda rid: protocol.AddRequest(rid, [5, 6, 7], SamplingParams(max_new_tokens=3), False, 0, False)  # noqa: E731
    loop.take_batch([add("doomed")], [])
    launch = engine.runner.launch_prefill
    monkeypatch.setattr(engine.runner, "launch_prefill", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    loop._step()
    monkeypatch.setattr(engine.runner, "launch_prefill", launch)
    failed = [r for m in pipe.messages if isinstance(m, protocol.Outputs) for r in m.requests]
    assert [(r.rid, r.status, r.samples) for r in failed] == [("doomed", 500, [])] and "boom" in failed[0].error
    loop.take_batch([add("fine")], [])
    while engine.has_work:
        loop._step()
    done = [r for m in pipe.messages if isinstance(m, protocol.Outputs) for r in m.requests if r.rid == "fine"]
    assert done and len(done[-1].samples[0].token_ids) == 3
    assert engine.pool.used_slots == 0 and loop.step_failures == 1



# ---------------- smaller ones ----------------
def test_error_types_say_what_kind_of_error_and_bodies_of_the_wrong_form_are_400s(server):
    r = requests.get(server.url + "/generate", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, "/update_weights_from_distributed", {"names": 5, "dtypes": ["float32"], "shapes": [[64]]})
    assert r.status_code == 400 and "names" in r.json()["error"]["message"], r.text
    r = post(server, "/destroy_weights_update_group", {"group_name": 5})
    assert r.status_code == 400 and "group_name" in r.json()["error"]["message"], r.text
    assert post(server, "/destroy_weights_update_group", {"group_name": "never-made"}).json()["error"]["type"] == "not_found_error"


def test_health_reports_a_disk_updates_version_as_soon_as_the_update_answers(server, model_dir, tmp_path):
    from safetensors.torch import load_file

    save_file(load_file(str(model_dir / "model.safetensors")), str(tmp_path / "model.safetensors"))
    version = str(int(requests.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"]) + 5)
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": version}).status_code == 200
    assert requests.get(server.url + "/health", timeout=10).json()["weight_version"] == version


def test_an_ordinary_request_runs_beside_a_group_holding_every_row(server):
    """A trainer's group of n = --max-running-seqs (64) takes every row; a request sent after it is
    admitted at once (the group's newest sample gives its row up) and takes about as many steps as
    alone, not the group's whole run."""
    ordinary = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}
    t0 = time.monotonic()
    alone = post(server, "/generate", ordinary)
    alone_s = time.monotonic() - t0
    group = {"input_ids": PROMPT, "sampling_params": {"n": 64, "max_new_tokens": 120, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, server, "/generate", group)
        wait_until(lambda: in_flight(server) == 1, "the group")
        time.sleep(0.1)  # (admitted by then: its prefill takes a step; its 120 steps last ~0.5 s on the CPU)
        t0 = time.monotonic()
        beside = post(server, "/generate", ordinary)
        beside_s = time.monotonic() - t0
        assert not big.done()
        assert big.result(120).status_code == 200
    assert beside.json()["output_ids"] == alone.json()["output_ids"]
    assert beside_s < 2 * alone_s + 0.5, (beside_s, alone_s)
