"""`rollout serve` as processes: SIGTERM stops both; a dead engine fails requests fast and /health;
a stream cut either way ends with an error event and [DONE]."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from concurrent.futures import ThreadPoolExecutor

import requests
from server_process import running_server

# Still running when the engine is killed a second after it is sent: one greedy sample of 1,000
# tokens took ~1 s on a CI-class machine (it once finished first), eight take several.
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 8}}


def streamed_events(url: str, body: dict) -> list[bytes]:
    """A streaming /generate's SSE payloads, to the end of the stream."""
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as r:
        return [line.removeprefix(b"data: ") for line in r.iter_lines() if line.startswith(b"data: ")]


def ends_with_an_error_then_done(events: list[bytes], message: str) -> bool:
    return events[-1] == b"[DONE]" and message in json.loads(events[-2])["error"]["message"]


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


def test_a_killed_engine_fails_in_flight_requests_at_once_then_comes_back_with_its_disk_weights(model_dir, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with running_server(str(model_dir)) as server:
        pushed = requests.post(server.url + "/update_weights_from_disk",
                               json={"model_path": str(tmp_path), "weight_version": "step-7"}, timeout=60)
        assert pushed.status_code == 200, pushed.text
        results = {}

        def in_flight():
            r = requests.post(server.url + "/generate", json=LONG, timeout=60)
            results["status"], results["at"], results["error"] = r.status_code, time.monotonic(), r.json()

        def stream():
            results["events"] = streamed_events(server.url, LONG)

        threads = [threading.Thread(target=in_flight), threading.Thread(target=stream)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        pid = engine_pid(server.url)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        # /health and /generate read one liveness: no /generate is refused while /health says ok
        while True:
            g = requests.post(server.url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}},
                              timeout=10).status_code
            h = requests.get(server.url + "/health", timeout=10).status_code
            assert (g, h) in ((200, 200), (503, 503), (200, 503)), (g, h)
            if g == 503:
                break
            assert time.monotonic() - killed < 10, "the killed engine still served"
        for thread in threads:
            thread.join(30)
        assert results["status"] == 503 and results["at"] - killed < 1.0, results
        assert "engine" in results["error"]["error"]["message"]
        assert ends_with_an_error_then_done(results["events"], "engine"), results["events"][-2:]
        deadline = time.monotonic() + 180
        while requests.get(server.url + "/health", timeout=10).status_code != 200:  # it restarts by itself
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.5)
        assert engine_pid(server.url) != pid
        r = requests.post(server.url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "step-7"
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        assert "rollout_engine_restarts_total 1" in metrics and "rollout_engine_up 1" in metrics
        assert "restarting engine process 0" in server.log()


def test_sigterm_stops_the_front_end_and_the_engine_process(model_dir):
    with running_server(str(model_dir)) as server:
        pid = engine_pid(server.url)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, "the engine process outlived the front end"
            time.sleep(0.1)


def test_sigterm_with_requests_in_flight_answers_each_at_once_with_a_json_503(model_dir):
    with running_server(str(model_dir)) as server:
        with ThreadPoolExecutor(9) as pool:
            flying = [pool.submit(requests.post, server.url + "/generate", json=LONG, timeout=60) for _ in range(8)]
            streaming = pool.submit(streamed_events, server.url, LONG)
            deadline = time.monotonic() + 30
            while requests.get(server.url + "/v1/loads", timeout=10).json()["loads"][0]["num_total_reqs"] < 9:
                assert time.monotonic() < deadline, "the requests never arrived"
                time.sleep(0.05)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in flying]
            events = streaming.result()
        waited = time.monotonic() - t0
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
        log = server.log()
    for r in answers:
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"]
    assert ends_with_an_error_then_done(events, "shutting down"), events[-2:]
    assert waited < 2, waited  # not after uvicorn's graceful period (5 s)
    assert "Traceback" not in log and "never retrieved" not in log, log
