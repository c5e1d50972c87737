"""Live weight updates of the default model from a trainer process, by broadcast (gloo) and by disk.

`rollout serve` runs as its own processes (front end and engine); trainers are subprocesses
pushing with `WeightPusher` over HTTP, as a training loop would.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from server_process import running_server
from weight_sync_http import ServerApi, versions, wait_for
from weight_sync_trainer import TrainerProcess

from rollout.models.weights import iter_checkpoint
from rollout.tools.datasets import chat_prompt_ids
from weight_sync import WeightPusher

MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def api(default_model_dir):
    with running_server(str(default_model_dir), "--spec", "off") as server:
        yield ServerApi(server.url)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return [chat_prompt_ids(tok, q) for q in ("What is 2+2?", "Write a haiku about the sea.")]


@pytest.fixture(scope="module")
def original(api, prompts):
    """Greedy tokens of the checkpoint's own weights, taken before any push."""
    return api.tokens(prompts, GREEDY)


@pytest.fixture(scope="module")
def trainer(api, default_model_dir):
    t = TrainerProcess(api.url, default_model_dir, hf=True)
    yield t
    t.close()


def test_trainer_pushes_by_broadcast_then_disk_and_greedy_output_equals_hf_with_its_weights(api, prompts, trainer, original):
    version0 = int(api.weight_version())
    trainer.send(cmd="push", method="distributed", perturb="mlp", version=str(version0 + 1), bucket_bytes=32 << 20,
                 prompts=prompts, max_new_tokens=MAX_NEW)
    r = trainer.reply()
    assert r["ok"], r
    assert r["result"]["weight_version"] == str(version0 + 1)
    samples = api.generate(prompts, GREEDY)
    assert [s["output_ids"] for s in samples] == r["reference"]
    assert r["reference"] != original  # the push changed what the model says
    assert all(versions(s) == [version0 + 1] * len(s["output_ids"]) for s in samples)

    trainer.send(cmd="push", method="disk", perturb="attn", version=None, prompts=prompts, max_new_tokens=MAX_NEW)
    r2 = trainer.reply()
    assert r2["ok"], r2
    assert api.tokens(prompts, GREEDY) == r2["reference"] != r["reference"]
    assert api.weight_version() == str(version0 + 2)


def test_trainer_killed_mid_broadcast_fails_the_update_old_weights_serve_and_a_new_group_works(api, prompts, original, trainer, default_model_dir):
    """(A trainer that hangs instead of dying is timed out: see test_weight_sync_engine.py.)"""
    before, version0 = api.tokens(prompts, GREEDY), api.weight_version()

    def in_flight() -> list[dict]:
        return api.info()["weight_sync"]["updates_in_flight"]

    try:
        # Small buckets: thousands of broadcasts, so we catch it in the middle.
        trainer.send(cmd="push", method="distributed", perturb="mlp", bucket_bytes=64 << 10)
        wait_for(lambda: any(p["buckets_done"] >= 3 for p in in_flight()), timeout=60, what="the push starting")
        os.kill(trainer.proc.pid, signal.SIGSTOP)
        done = in_flight()[0]["buckets_done"]
        assert 3 <= done < (538 << 20) // (64 << 10)
        # The server keeps generating, on the old weights, while the update is stuck half way.
        short = {"temperature": 0, "max_new_tokens": 4}
        assert api.tokens(prompts[:1], short)[0] == before[0][:4]
        assert in_flight(), "the update should still be waiting for the stopped trainer"
        os.kill(trainer.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        # The receiver sees the connection drop (long before its 60 s timeout).
        wait_for(lambda: not in_flight(), timeout=20, what="the receiver noticing the dead trainer")
        assert time.monotonic() - t0 < 20
    finally:
        trainer.close()
    assert "failed" in api.info()["weight_sync"]["last_error"] and api.weight_version() == version0
    assert api.tokens(prompts, GREEDY) == before

    # A new trainer (here, this process) makes a new group and pushes the original weights as a new version.
    with WeightPusher(api.url, method="distributed", timeout_s=60) as pusher:
        r = pusher.push(iter_checkpoint(default_model_dir), version=int(version0) + 10)
    assert r["weight_version"] == str(int(version0) + 10) == api.weight_version()
    assert api.tokens(prompts, GREEDY) == original


def test_a_trainer_frozen_mid_broadcast_is_timed_out_at_the_push_deadline(api, prompts, original, default_model_dir):
    """Its store cannot answer either (the whole process is stopped), and the store's questions wait for
    minutes: the engine still gives up at the update's deadline, and serves on."""
    version0 = api.weight_version()

    def in_flight() -> list[dict]:
        return api.info()["weight_sync"]["updates_in_flight"]

    trainer = TrainerProcess(api.url, default_model_dir, hf=False, timeout_s=3)  # the server's deadline too
    try:
        trainer.send(cmd="push", method="distributed", perturb="mlp", bucket_bytes=64 << 10, freeze_after=12)
        wait_for(lambda: any(p["buckets_done"] >= 3 for p in in_flight()), timeout=60, what="the push starting")
        wait_for(lambda: not in_flight(), timeout=20, what="the receiver timing out")
    finally:
        os.kill(trainer.proc.pid, signal.SIGKILL)
        trainer.close()
    assert "timed out" in api.info()["weight_sync"]["last_error"] and api.weight_version() == version0
    assert api.tokens(prompts, GREEDY) == original
