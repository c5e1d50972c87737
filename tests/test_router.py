"""`rollout serve` behind SGLang's router (the `sglang-router` package, started for real): the
router adds fields of its own to every request and asks its workers routes of its own."""

from __future__ import annotations

import pytest
import requests
from server_process import running_servers
from tiny_models import make_tiny_model
from transformers import AutoTokenizer

from rollout.tools.launch import launched_router

PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tiny Llama with a chat template, so the OpenAI chat route has something to render."""
    path = tmp_path_factory.mktemp("chat-llama")
    make_tiny_model("llama", path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def replicas(chat_model_dir):
    args = (str(chat_model_dir), "--max-running-seqs", "32", "--served-model-name", "tiny")
    with running_servers(args, args) as (a, b):
        yield a, b


@pytest.fixture(scope="module")
def server(replicas):
    return replicas[0]


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two"])
def test_slimes_and_areals_bodies_and_openai_chat_succeed_through_the_router(replicas, policy):
    server = replicas[0]
    with launched_router([r.url for r in replicas], policy) as router:
        slime = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": dict(
            temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=12, stop=None, stop_token_ids=None,
            skip_special_tokens=True, no_stop_trim=True, spaces_between_special_tokens=False, sampling_seed=42)}
        areal = {"input_ids": PROMPT, "image_data": None, "return_logprob": True, "stream": False, "sampling_params": {
            "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 12, "temperature": 1.0, "stop_token_ids": [2],
            "frequency_penalty": 0.5}}
        for body in (slime, areal):
            r = requests.post(router.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        direct = requests.post(server.url + "/generate", json=slime, timeout=60).json()
        assert direct["output_ids"] == requests.post(router.url + "/generate", json=slime, timeout=60).json()["output_ids"]
        chat = requests.post(router.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "5 9 13"}], "max_tokens": 6})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        completion = requests.post(router.url + "/v1/completions", timeout=60,
                                   json={"model": "tiny", "prompt": "5 9 13", "max_tokens": 4})
        assert completion.status_code == 200, completion.text
        assert requests.get(router.url + "/get_model_info", timeout=10).json()["served_model_name"] == "tiny"
        assert requests.post(router.url + "/flush_cache", timeout=10).status_code == 200
    for route in ("/model_info", "/server_info", "/get_load"):  # what the router asks its workers
        assert requests.get(server.url + route, timeout=30).status_code == 200, route
    assert isinstance(requests.get(server.url + "/get_load", timeout=10).json()["load"], int)


def test_a_field_asking_for_what_the_engine_does_not_do_is_still_refused(server):
    for body, field in [({"return_bytes": True}, "return_bytes"), ({"background": True}, "background"),
                        ({"return_hidden_states": True}, "return_hidden_states"), ({"log_metrics": "yes"}, "log_metrics")]:
        r = requests.post(server.url + "/generate", json={"input_ids": PROMPT, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = requests.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "5"}], "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_a_model_the_server_does_not_serve_is_a_404_naming_the_served_one(server):
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "5"}]}),
                       ("/v1/completions", {"prompt": "5 9"})]:
        r = requests.post(server.url + path, json={**body, "model": "gpt-4o-does-not-exist", "max_tokens": 2}, timeout=30)
        assert r.status_code == 404 and "'tiny'" in r.json()["error"]["message"], r.text
        assert requests.post(server.url + path, json={**body, "model": "tiny", "max_tokens": 2}, timeout=30).status_code == 200


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_one_push_to_the_routers_url_reaches_every_replica(replicas, chat_model_dir, method):
    """WeightPusher given the router's URL pushes to its workers (GET /workers): both replicas serve
    the pushed weights under one version, and answer alike."""
    import torch
    from transformers import AutoModelForCausalLM

    from weight_sync import WeightPusher

    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32)
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    before = [requests.post(r.url + "/generate", json=greedy, timeout=60).json()["output_ids"] for r in replicas]
    with launched_router([r.url for r in replicas], "round_robin") as router:
        version = str(int(requests.get(replicas[0].url + "/get_weight_version", timeout=10).json()["weight_version"]) + 1)
        with torch.no_grad():
            model.model.norm.weight.mul_(-1.5 if method == "distributed" else 3.0)  # each push changes what they answer
        with WeightPusher(router.url, method=method) as pusher:
            assert len(pusher.transports) == 2
            pusher.push(model.named_parameters(), version=version)
    after = [requests.post(r.url + "/generate", json=greedy, timeout=60).json() for r in replicas]
    assert after[0]["output_ids"] == after[1]["output_ids"] != before[0] == before[1]
    assert all(a["meta_info"]["weight_version"] == version for a in after)
