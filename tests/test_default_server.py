"""`rollout serve --model default` as a user starts it (speculation `auto`: the n-gram index and the
model's draft head): idle, it holds no KV and hands memory to a colocated trainer; under 500
concurrent requests, /health and /v1/loads answer at once; a step held past --health-timeout is a
503 until it ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from server_process import running_server


@pytest.fixture(scope="module")
def server(default_model_dir):
    # --health-timeout 60: this module asks that /health and /v1/loads answer at once, not that a step
    # is short. Its load's steps take ~1-2 s here (512-token prefill chunks, 256-sequence decode steps),
    # but a CI run whose other worker held both cores saw one loop iteration pass 12 s (/health 503,
    # "busy with one step"). Before the heartbeat thread, /v1/loads waited ~5 s on steps.
    with running_server("default", "--health-timeout", "60") as s:
        yield s


def stats(server) -> dict:
    return requests.get(server.url + "/get_server_info", timeout=30).json()["stats"]


def test_an_idle_default_server_holds_no_kv_and_releases_and_resumes_its_memory(server):
    assert stats(server)["rollout/kv_usage"] == 0  # (the draft head's scratch slots are the pool's reserve)
    r = requests.post(server.url + "/release_memory_occupation", json={}, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.post(server.url + "/resume_memory_occupation", json={}, timeout=60).status_code == 200
    body = {"text": "2+2=", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    assert requests.post(server.url + "/generate", json=body, timeout=60).status_code == 200


LOAD = textwrap.dedent("""
    import sys, requests
    from concurrent.futures import ThreadPoolExecutor

    def generate(i):
        body = {"text": f"{i}:", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        return requests.post(sys.argv[1] + "/generate", json=body, timeout=600).status_code

    with ThreadPoolExecutor(500) as pool:
        print(sorted(set(pool.map(generate, range(500)))))
""")


def test_under_500_concurrent_requests_health_and_loads_answer_within_a_second(server):
    # the load from its own process: 500 client threads in this one made the probes wait for this
    # process's interpreter lock (a first probe of 1.2 s on the 2-core machine), not for the server
    load = subprocess.Popen([sys.executable, "-c", LOAD, server.url], stdout=subprocess.PIPE, text=True)
    probes: list[tuple[str, int, float]] = []
    while load.poll() is None:
        for route in ("/health", "/v1/loads"):
            t0 = time.monotonic()
            code = requests.get(server.url + route, timeout=10).status_code
            probes.append((route, code, time.monotonic() - t0))
        time.sleep(0.1)
    assert load.returncode == 0 and load.stdout.read().split() == ["[200]"]
    slow = [p for p in probes if p[1] != 200 or p[2] > 1.0]
    assert len(probes) > 40 and not slow, slow
    assert stats(server)["rollout/kv_usage"] == 0


def test_after_kv_exhaustion_an_idle_default_server_holds_no_kv_and_releases_its_memory(default_model_dir):
    """The server's side, in the default mode (the hybrid); every spec mode's KV after exhaustion:
    test_engine_batching.py."""
    with running_server("default", "--kv-cache-tokens", "480", "--max-running-seqs", "16") as server:
        body = {"text": ["2+2=", "3+5=", "7*6=", "9-4="], "sampling_params": {
            "n": 4, "temperature": 1.0, "max_new_tokens": 32, "ignore_eos": True}}
        assert requests.post(server.url + "/generate", json=body, timeout=300).status_code == 200
        after = stats(server)
        assert after["rollout/num_preempted"] > 0  # the pool ran dry on the way
        assert after["rollout/kv_usage"] == 0 and after["rollout/num_running"] == 0
        assert requests.post(server.url + "/release_memory_occupation", json={}, timeout=60).status_code == 200
        assert requests.post(server.url + "/resume_memory_occupation", json={}, timeout=60).status_code == 200


def test_a_step_that_holds_the_loop_past_the_health_timeout_is_a_503_until_it_ends(default_model_dir):
    """/health's other half: a step longer than --health-timeout (one 1,000-token prefill chunk, ~9 s
    on the CPU) answers 503 naming the step, and the server is healthy again once it ends; its log
    says when /health turned, both ways."""
    with running_server("default", "--health-timeout", "1.5", "--max-prefill-tokens", "4096") as server:
        body = {"input_ids": [list(range(1000, 2000))], "sampling_params": {"max_new_tokens": 1}}
        answers = []
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(requests.post, server.url + "/generate", json=body, timeout=600)
            while not done.done():
                r = requests.get(server.url + "/health", timeout=10)
                answers.append((r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""))
                time.sleep(0.1)
        assert done.result().status_code == 200
        assert any(code == 503 and "busy with one step" in why for code, why in answers), answers
        deadline = time.monotonic() + 30
        while requests.get(server.url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "/health stayed 503 after the step"
            time.sleep(0.2)
        log = server.log()
        assert "/health answers 503: the engine process's loop has been busy with one step" in log, log
        assert "/health answers 200 again" in log, log
