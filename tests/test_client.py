"""RolloutClient and AsyncRolloutClient against `rollout serve` on a tiny random Llama."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import requests
from server_process import running_server

from rollout import Engine, SamplingParams
from rollout.client import AsyncRolloutClient, RolloutClient, RolloutError

API_KEY = "client-test-key"
PARAMS = {"temperature": 1.0, "max_new_tokens": 8, "seed": 5}


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(str(model_dir), "--api-key", API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model=str(model_dir), device="cpu")


def random_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 24))] for _ in range(num)]


def test_200_concurrent_requests_all_complete_and_equal_serial_runs(server, engine):
    prompts = random_prompts(200, seed=1)

    async def run():
        async with AsyncRolloutClient(server.url, api_key=API_KEY, batch_size=1, max_concurrency=200) as client:
            return await client.generate(prompts, PARAMS, return_logprob=True)

    groups = asyncio.run(run())
    assert len(groups) == 200 and all(len(g) == 1 for g in groups)
    got = [g[0].token_ids for g in groups]
    assert all(len(t) == 8 or groups[k][0].finish_reason == "stop" for k, t in enumerate(got))
    serial = [engine.generate([p], SamplingParams(**PARAMS))[0][0].token_ids for p in prompts[:20]]
    assert got[:20] == serial
    together = [g[0].token_ids for g in engine.generate(prompts, SamplingParams(**PARAMS))]
    assert got == together  # and the rest: the engine's batched run equals its serial runs (test_engine_batching)


def test_sync_client_returns_n_samples_per_prompt_with_ids_logprobs_versions_and_text(server):
    prompts = [" ".join(str(t) for t in p) for p in random_prompts(7, seed=2)]
    with RolloutClient(server.url, api_key=API_KEY, batch_size=3) as client:
        groups = client.generate(prompts, {**PARAMS, "ignore_eos": True}, n=2)
        direct = requests.post(
            server.url + "/generate",
            json={"text": prompts[4], "sampling_params": {**PARAMS, "ignore_eos": True, "n": 2}, "return_logprob": True},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        ).json()
    assert [len(g) for g in groups] == [2] * 7
    for g in groups:
        for s in g:
            assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) == 8
            assert s.finish_reason == "length" and s.weight_version == "0" and isinstance(s.text, str)
    assert [s.token_ids for s in groups[4]] == [d["output_ids"] for d in direct]
    assert [s.text for s in groups[4]] == [d["text"] for d in direct]


def test_client_raises_the_servers_4xx_message_and_needs_the_api_key(server):
    with RolloutClient(server.url, api_key=API_KEY) as client:
        with pytest.raises(RolloutError) as e:
            client.generate([[5, 6]], {"max_new_tokens": 0})
        assert e.value.status == 400 and "max_new_tokens" in e.value.message
    with RolloutClient(server.url) as anonymous, pytest.raises(RolloutError) as e:
        anonymous.generate([[5, 6]], PARAMS)
    assert e.value.status == 401


GOOD = {"text": "x", "output_ids": [1], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1, "completion_tokens": 1,
    "weight_version": "0", "output_token_weight_versions": [0], "output_token_logprobs": [[-0.5, 1, None]],
    "spec_verify_ct": 0, "spec_accept_length": 0.0, "spec_draft_token_num": 0, "spec_accept_token_num": 0}}  # fmt: skip


def test_sync_client_retries_connection_errors_but_never_http_errors(monkeypatch):
    client = RolloutClient("http://127.0.0.1:9", max_retries=3)
    monkeypatch.setattr(client, "_backoff", lambda attempt: 0)
    calls = []

    def flaky(method, url, **kw):
        calls.append(url)
        if len(calls) <= 2:
            raise requests.ConnectionError("connection refused")
        r = requests.Response()
        r.status_code, r._content = 200, requests.compat.json.dumps(GOOD).encode()
        return r

    monkeypatch.setattr(client.session, "request", flaky)
    assert client.generate("hi", {})[0][0].logprobs == [-0.5]
    assert len(calls) == 3

    def broken(method, url, **kw):
        calls.append(url)
        r = requests.Response()
        r.status_code, r._content = 503, b'{"error": {"message": "engine down"}}'
        return r

    calls.clear()
    monkeypatch.setattr(client.session, "request", broken)
    with pytest.raises(RolloutError, match="engine down"):
        client.generate("hi", {})
    assert len(calls) == 1


def test_async_client_retries_connection_errors_but_never_http_errors(monkeypatch):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/generate" and len(calls) <= 2:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/generate":
            return httpx.Response(200, json=[GOOD, GOOD])
        return httpx.Response(500, json={"error": {"message": "boom"}})

    async def run():
        client = AsyncRolloutClient("http://rollout.test", max_retries=3)
        monkeypatch.setattr(client, "_backoff", lambda attempt: 0)
        client._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        groups = await client.generate(["a"], {}, n=2)
        assert len(groups) == 1 and len(groups[0]) == 2
        assert len(calls) == 3
        with pytest.raises(RolloutError, match="boom"):
            await client.server_info()
        assert calls[3:] == ["/get_server_info"]
        await client.aclose()

    asyncio.run(run())
