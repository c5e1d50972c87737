"""Live weight updates of the default model from a trainer process, by broadcast (gloo) and by disk.

The engine runs here behind `weight_sync.dev_server` (the weight routes of `rollout serve`);
trainers are subprocesses pushing with `WeightPusher` over HTTP, as a training loop would.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rollout import Engine, SamplingParams
from rollout.datasets import chat_prompt_ids
from rollout.weights import iter_checkpoint
from weight_sync import WeightPusher
from weight_sync.dev_server import DevServer, EngineLoop
from weight_sync_trainer import TrainerProcess

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def served(default_model_dir):
    engine = Engine(model=str(default_model_dir), spec="off", device="cpu")
    loop = EngineLoop(engine, timeout_s=60)
    server = DevServer(loop)
    yield loop, server
    server.close()
    loop.close()


@pytest.fixture(scope="module")
def prompts(served):
    tok = served[0].engine.tokenizer
    return [chat_prompt_ids(tok, q) for q in ("What is 2+2?", "Write a haiku about the sea.")]


@pytest.fixture(scope="module")
def original(served, prompts):
    """Greedy tokens of the checkpoint's own weights, taken before any push."""
    return tokens(served[0], prompts)


def tokens(loop: EngineLoop, prompts) -> list[list[int]]:
    return [o[0].token_ids for o in loop.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def trainer(served, default_model_dir):
    t = TrainerProcess(served[1].url, default_model_dir, hf=True)
    yield t
    t.close()


def test_trainer_pushes_by_broadcast_then_disk_and_greedy_output_equals_hf_with_its_weights(served, prompts, original, trainer):
    loop, _ = served
    version0 = loop.engine.weight_version
    trainer.send(cmd="push", method="distributed", perturb="mlp", version=str(version0 + 1), bucket_bytes=32 << 20,
                 prompts=prompts, max_new_tokens=MAX_NEW)
    r = trainer.reply()
    assert r["ok"], r
    assert r["result"]["weight_version"] == str(version0 + 1)
    outs = loop.generate(prompts, GREEDY)
    assert [o[0].token_ids for o in outs] == r["reference"]
    assert r["reference"] != original  # the push changed what the model says
    assert all(v == version0 + 1 for o in outs for v in o[0].weight_versions)

    trainer.send(cmd="push", method="disk", perturb="attn", version=None, prompts=prompts, max_new_tokens=MAX_NEW)
    r2 = trainer.reply()
    assert r2["ok"], r2
    assert tokens(loop, prompts) == r2["reference"] != r["reference"]
    assert loop.engine.weight_version == version0 + 2


def test_trainer_killed_mid_broadcast_fails_the_update_old_weights_serve_and_a_new_group_works(served, prompts, original, trainer, default_model_dir):
    """(A trainer that hangs instead of dying is timed out: see test_weight_sync_engine.py.)"""
    loop, server = served
    rx = loop.receiver
    before, version0 = tokens(loop, prompts), loop.engine.weight_version
    try:
        # Small buckets: thousands of broadcasts, so we catch it in the middle.
        trainer.send(cmd="push", method="distributed", perturb="mlp", bucket_bytes=64 << 10)
        deadline = time.monotonic() + 60
        while not any(p["buckets_done"] >= 3 for p in loop.call(rx.progress)):
            assert time.monotonic() < deadline, "the push never started"
            time.sleep(0.001)
        os.kill(trainer.proc.pid, signal.SIGSTOP)
        done = loop.call(rx.progress)[0]["buckets_done"]
        assert 3 <= done < (538 << 20) // (64 << 10)
        # The engine keeps generating, on the old weights, while the update is stuck half way.
        short = SamplingParams(temperature=0, max_new_tokens=4)
        assert loop.generate(prompts[:1], short)[0][0].token_ids == before[0][:4]
        assert loop.call(rx.progress), "the update should still be waiting for the stopped trainer"
        os.kill(trainer.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while loop.call(rx.progress):  # the receiver sees the connection drop (long before its 60 s timeout)
            assert time.monotonic() - t0 < 20, "the receiver never noticed the dead trainer"
            time.sleep(0.02)
    finally:
        trainer.close()
    assert "failed" in rx.last_error and loop.engine.weight_version == version0
    assert tokens(loop, prompts) == before

    # A new trainer (here, this process) makes a new group and pushes the original weights as a new version.
    pusher = WeightPusher(server.url, method="distributed", timeout_s=60)
    try:
        r = pusher.push(iter_checkpoint(default_model_dir), version=version0 + 10)
    finally:
        pusher.close()
    assert r["weight_version"] == str(version0 + 10) and loop.engine.weight_version == version0 + 10
    assert tokens(loop, prompts) == original
