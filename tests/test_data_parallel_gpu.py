"""`rollout serve --dp-size 2` on two GPUs (run on the device machine: -m gpu): each replica on its
own GPU, and both answer as one replica does."""

from __future__ import annotations

import pytest
import requests
import torch

from rollout.models.default_model import ensure_default_model
from rollout.tools.launch import launched_server

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 504, 28, 1040 + 7 * k, 314, 17 + k] for k in range(12)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_replicas_on_two_gpus_answer_as_one():
    model = str(ensure_default_model())
    greedy = {"max_new_tokens": 32, "temperature": 0}
    with launched_server("--model", model, "--dp-size", "2", "--spec", "ngram", "--kv-cache-tokens", "65536") as dp2, \
            launched_server("--model", model, "--spec", "ngram", "--kv-cache-tokens", "65536") as dp1:
        replicas = requests.get(dp2.url + "/server_info", timeout=30).json()["replicas"]
        assert [r["device"] for r in replicas] == ["cuda:0", "cuda:1"] and all(r["alive"] for r in replicas)
        for prompt in PROMPTS:  # one at a time: bf16 outputs depend on the batch they run in
            body = {"input_ids": prompt, "sampling_params": greedy}
            a = requests.post(dp2.url + "/generate", json=body, timeout=120).json()["output_ids"]
            b = requests.post(dp1.url + "/generate", json=body, timeout=120).json()["output_ids"]
            assert a == b, prompt
        text = requests.get(dp2.url + "/metrics", timeout=30).text
        served = [line for line in text.splitlines() if line.startswith("rollout_requests_total{")]
        assert len(served) == 2 and all(not line.endswith(" 0") for line in served), served  # both GPUs served
