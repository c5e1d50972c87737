"""Two replicas placed on a local Ray cluster (started for real) serve through sglang-router, take
one weight push through the router's URL, and shut down cleanly."""

from __future__ import annotations

import pytest
import requests
import torch
from tiny_models import make_tiny_model

from weight_sync import WeightPusher

ray = pytest.importorskip("ray")

PROMPTS = [[5 + k, 9, 13 + 2 * k, 7] for k in range(8)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_replicas_on_ray_serve_through_the_router_take_one_push_and_shut_down(local_ray, tmp_path):
    from rollout.tools.ray_launch import launch_on_ray

    hf = make_tiny_model("llama", tmp_path)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    with launch_on_ray(2, ["--model", str(tmp_path), "--device", "cpu", "--max-running-seqs", "16"],
                       gpus_per_replica=0, policy="round_robin") as rollout:
        assert len(set(rollout.worker_urls)) == 2
        workers = requests.get(rollout.url + "/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(rollout.worker_urls)
        body = {"input_ids": PROMPTS, "sampling_params": greedy}
        before = requests.post(rollout.url + "/generate", json=body, timeout=120)
        assert before.status_code == 200, before.text
        with torch.no_grad():
            hf.model.norm.weight.copy_(torch.randn(hf.model.norm.weight.shape, generator=torch.Generator().manual_seed(5)))
        with WeightPusher(rollout.url, method="distributed", admin_key=rollout.admin_key) as pusher:
            assert len(pusher.transports) == 2
            pusher.push(hf.named_parameters(), version="1")
        for url in rollout.worker_urls:  # each replica, asked directly, serves the pushed weights
            out = requests.post(url + "/generate", json=body, timeout=120).json()
            assert {s["meta_info"]["weight_version"] for s in out} == {"1"}
            assert [s["output_ids"] for s in out] != [s["output_ids"] for s in before.json()]
        # served on the node's address, a replica's weight routes take the generated admin key only
        r = requests.post(rollout.worker_urls[0] + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=30)
        assert r.status_code == 401, r.text
        urls = rollout.worker_urls
    for url in urls:
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=5)
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
