"""`rollout serve` as processes: SIGTERM stops both; a dead engine fails requests fast and /health."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from server_process import running_server
from tiny_models import make_tiny_model

# Still running when the engine is killed a second after it is sent: one greedy sample of 1,000
# tokens took ~1 s on a CI-class machine (it once finished first), eight take several.
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 8}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path)
    return path


def engine_pid(url: str) -> int:
    return requests.get(url + "/get_server_info", timeout=30).json()["engine_pid"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie child of the front end counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_crashed_engine_fails_in_flight_requests_fast_and_health_answers_503(model_dir):
    with running_server(str(model_dir)) as server:
        results = {}

        def in_flight():
            t0 = time.monotonic()
            r = requests.post(server.url + "/generate", json=LONG, timeout=60)
            results["status"], results["seconds"], results["error"] = r.status_code, time.monotonic() - t0, r.json()

        thread = threading.Thread(target=in_flight)
        thread.start()
        time.sleep(1.0)
        os.kill(engine_pid(server.url), signal.SIGKILL)
        thread.join(30)
        assert results["status"] == 503 and results["seconds"] < 20, results
        assert "engine" in results["error"]["error"]["message"]
        assert requests.get(server.url + "/health", timeout=10).status_code == 503
        r = requests.post(server.url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        assert r.status_code == 503
        assert "rollout_engine_up 0" in requests.get(server.url + "/metrics", timeout=10).text


def test_sigterm_stops_the_front_end_and_the_engine_process(model_dir):
    with running_server(str(model_dir)) as server:
        pid = engine_pid(server.url)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, "the engine process outlived the front end"
            time.sleep(0.1)
