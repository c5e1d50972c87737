"""`rollout serve --dp-size 2` on the CPU: two engine processes behind one front end, a prompt kept
on one of them, one weight push for both, one dying while the other serves; and a push to two
servers of which one refuses it."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import requests
import torch
from server_process import running_server, running_servers
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from weight_sync import WeightPusher, WeightSyncError

PROMPTS = [[5 + k, 9, 13 + 2 * k, 7, 11 + k] for k in range(16)]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp-llama")
    make_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def dp2(tiny):
    with running_server(str(tiny), "--dp-size", "2", "--max-running-seqs", "32", "--kv-cache-tokens", "4096") as server:
        yield server


@pytest.fixture(scope="module")
def dp1(tiny):
    with running_server(str(tiny), "--max-running-seqs", "32", "--kv-cache-tokens", "4096") as server:
        yield server


def perturbed(path, seed: int):
    """The tiny model with its final norm's scales redrawn: greedy tokens change."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(model.model.norm.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def generate(url: str, prompts, params=GREEDY, timeout: float = 120) -> list[dict]:
    r = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": params}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def requests_by_replica(url: str) -> dict[str, int]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {rank: int(v) for rank, v in re.findall(r'^rollout_requests_total\{dp_rank="(\d)"\} (\d+)', text, re.M)}


def replicas(url: str) -> list[dict]:
    return requests.get(url + "/server_info", timeout=30).json()["replicas"]


def test_dp2_reports_each_replica_and_keeps_a_prompt_on_one(dp2, dp1):
    info = requests.get(dp2.url + "/server_info", timeout=30).json()
    assert info["dp_size"] == 2 and [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    assert len({r["engine_pid"] for r in info["replicas"]}) == 2
    loads = requests.get(dp2.url + "/v1/loads", timeout=10).json()
    assert loads["dp_rank_count"] == 2 and [x["dp_rank"] for x in loads["loads"]] == [0, 1]

    before = requests_by_replica(dp2.url)
    for _ in range(3):  # one prompt, again and again (an RL epoch after another): one replica takes them all
        generate(dp2.url, PROMPTS[0], {**GREEDY, "n": 4})
    moved = {rank: requests_by_replica(dp2.url)[rank] - before[rank] for rank in before}
    assert sorted(moved.values()) == [0, 3], moved

    before = requests_by_replica(dp2.url)
    out = generate(dp2.url, PROMPTS)
    spread = {rank: requests_by_replica(dp2.url)[rank] - before[rank] for rank in before}
    assert sorted(spread.values()) == [8, 8], spread  # a batch of new prompts splits evenly
    assert [s["output_ids"] for s in out] == [s["output_ids"] for s in generate(dp1.url, PROMPTS)]


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_one_push_changes_both_replicas_as_it_changes_one_server(dp2, dp1, tiny, method):
    model = perturbed(tiny, seed=1 if method == "distributed" else 2)
    before = [s["output_ids"] for s in generate(dp2.url, PROMPTS)]
    version = str(max(int(requests.get(u + "/get_weight_version", timeout=10).json()["weight_version"])
                      for u in (dp1.url, dp2.url)) + 1)
    for url in (dp1.url, dp2.url):
        with WeightPusher(url, method=method) as pusher:
            pusher.push(model.named_parameters(), version=version)
    after = generate(dp2.url, PROMPTS)
    assert [s["output_ids"] for s in after] == [s["output_ids"] for s in generate(dp1.url, PROMPTS)] != before
    assert {s["meta_info"]["weight_version"] for s in after} == {version}
    assert [r["weight_version"] for r in replicas(dp2.url)] == [version, version]


@pytest.mark.parametrize("method", ["disk", "distributed"])
def test_a_server_that_refuses_a_push_is_named_keeps_its_weights_and_the_other_is_whole(tiny, tmp_path, method):
    """Two servers, the second of another shape: the error names the second; it keeps its weights;
    the first took the whole update (disk: each server is its own update) or none of it (a
    broadcast is one collective); a pusher for the failed URL alone retries it."""
    other = tmp_path / "wider"
    make_tiny_model("llama", other, intermediate_size=96)
    model = perturbed(tiny, seed=3)
    with running_servers((str(tiny),), (str(other),)) as (good, bad):
        before = {s.url: [x["output_ids"] for x in generate(s.url, PROMPTS[:4])] for s in (good, bad)}
        with WeightPusher([good.url, bad.url], method=method) as pusher, pytest.raises(WeightSyncError) as err:
            pusher.push(model.named_parameters(), version="7")
        assert bad.url in str(err.value) and "shape" in str(err.value)
        assert bad.url in err.value.failed and (good.url in err.value.failed) == (method == "distributed")
        assert [x["output_ids"] for x in generate(bad.url, PROMPTS[:4])] == before[bad.url]
        assert requests.get(bad.url + "/get_weight_version", timeout=10).json()["weight_version"] == "0"
        good_now = generate(good.url, PROMPTS[:4])
        if method == "disk":
            assert {x["meta_info"]["weight_version"] for x in good_now} == {"7"}
            assert [x["output_ids"] for x in good_now] != before[good.url]
        else:
            assert [x["output_ids"] for x in good_now] == before[good.url]
            with WeightPusher(err.value.failed[:1], method=method) as retry:  # the good one, alone, retried
                retry.push(model.named_parameters(), version="7")
            assert generate(good.url, PROMPTS[:1])[0]["meta_info"]["weight_version"] == "7"


@pytest.mark.parametrize("cores,shares", [(8, [4, 4, 2, 2]), (2, [1, 1, 1, 1]), (None, [1, 1, 1, 1])])
def test_replicas_on_the_cpu_split_its_cores_unless_told(monkeypatch, cores, shares):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)  # (None: the count is unknown)
    assert [EngineConfig(model="default", dp_size=2, tp_size=tp).replica(i).cpu_threads for tp in (1, 2) for i in (0, 1)] == shares
    assert EngineConfig(model="default", dp_size=2, cpu_threads=3).replica(1).cpu_threads == 3
    assert EngineConfig(model="default").replica(0).cpu_threads == 0  # one replica: torch's own default


def test_killing_one_engine_process_fails_its_requests_fast_and_the_other_keeps_serving(dp2, tiny):
    """... and, restarted with older weights than the latest push (in memory: it cannot reload
    them), the replica is routed around until the next push reaches it."""
    version = str(int(requests.get(dp2.url + "/get_weight_version", timeout=10).json()["weight_version"]) + 1)
    with WeightPusher(dp2.url, method="distributed") as pusher:
        pusher.push(perturbed(tiny, seed=4).named_parameters(), version=version)
    long = {"max_new_tokens": 1000, "temperature": 1.0, "ignore_eos": True, "n": 4}  # (the context is 1,024)
    result: dict = {}

    def run():
        t0 = time.monotonic()
        r = requests.post(dp2.url + "/generate", json={"input_ids": PROMPTS[3], "sampling_params": long}, timeout=300)
        result.update(status=r.status_code, body=r.text, seconds=time.monotonic() - t0)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    busy = []
    while not busy and time.monotonic() < deadline:
        busy = [x["dp_rank"] for x in requests.get(dp2.url + "/v1/loads", timeout=10).json()["loads"] if x["num_total_reqs"]]
        time.sleep(0.05)
    assert busy, "the long request never showed in /v1/loads"
    victim = replicas(dp2.url)[busy[0]]
    killed_at = time.monotonic()
    os.kill(victim["engine_pid"], signal.SIGKILL)
    thread.join(60)
    assert result["status"] == 503 and time.monotonic() - killed_at < 10, result
    # The other replica serves every prompt meanwhile, the victim's included.
    assert len(generate(dp2.url, PROMPTS)) == len(PROMPTS)
    assert requests.get(dp2.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 120
    while not all(r["alive"] for r in replicas(dp2.url)):
        assert time.monotonic() < deadline, replicas(dp2.url)
        time.sleep(0.5)
    back = replicas(dp2.url)[busy[0]]
    assert back["restarts"] == 1 and back["engine_pid"] != victim["engine_pid"]
    assert back["stale"] and back["weight_version"] != version
    before = requests_by_replica(dp2.url)
    assert {s["meta_info"]["weight_version"] for s in generate(dp2.url, PROMPTS)} == {version}
    assert requests_by_replica(dp2.url)[str(busy[0])] == before[str(busy[0])]  # none went to the stale one
    newer = str(int(version) + 1)
    with WeightPusher(dp2.url, method="distributed") as pusher:
        pusher.push(perturbed(tiny, seed=5).named_parameters(), version=newer)
    assert [(r["stale"], r["weight_version"]) for r in replicas(dp2.url)] == [(False, newer)] * 2
    before = requests_by_replica(dp2.url)
    fresh = [[t + 40 for t in p] for p in PROMPTS]  # (the prompts above stay where they moved)
    assert {s["meta_info"]["weight_version"] for s in generate(dp2.url, fresh)} == {newer}
    assert requests_by_replica(dp2.url)[str(busy[0])] > before[str(busy[0])]  # it serves again


def test_rollout_bench_drives_servers_and_a_router_over_http(dp2, dp1, tiny, tmp_path):
    import json

    from rollout.tools.cli import main
    from rollout.tools.launch import launched_router

    with launched_router([dp2.url], "cache_aware") as router:
        main(["bench", "--model", str(tiny), "--workload", "decode", "--batch-sizes", "4", "--prompt-len", "8",
              "--output-len", "6", "--repeats", "2", "--out", str(tmp_path),
              "--url", f"dp1={dp1.url},dp2={dp2.url},router={router.url}"])
    rows = json.loads(next(tmp_path.glob("*.json")).read_text())["rows"]
    assert [(r["spec"], r["system"], r["repeats"]) for r in rows] == [("dp1", "http", 2), ("dp2", "http", 2), ("router", "http", 2)]
    assert all(r["output_tokens"] == 4 * 6 and r["tokens_per_s"] > 0 for r in rows)
