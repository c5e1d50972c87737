"""Weight pushes to a CUDA engine: IPC from a colocated trainer, NCCL between two GPUs, gloo into a GPU engine.

Run on a GPU machine: `pytest -m gpu tests/test_weight_sync_gpu.py`. The engine serves the
default model in bf16 on cuda:0; after each push its parameters must equal the trainer's
tensors (cast to bf16) exactly, and its version must have advanced.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.weights import iter_checkpoint  # noqa: E402
from weight_sync import WeightPusher  # noqa: E402
from weight_sync.dev_server import DevServer, EngineLoop  # noqa: E402
from weight_sync_trainer import TrainerProcess, perturb  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")


@pytest.fixture(scope="module")
def served(default_model_dir):
    engine = Engine(model=str(default_model_dir), spec="off", device="cuda:0", kv_cache_tokens=16384)
    loop = EngineLoop(engine, timeout_s=60)
    server = DevServer(loop)
    yield loop, server
    server.close()
    loop.close()


def expected_weights(model_dir, kinds: list[str]) -> dict[str, torch.Tensor]:
    named = {n: t.clone() for n, t in iter_checkpoint(model_dir)}
    for kind in kinds:
        perturb(named, kind)
    return named


def assert_engine_holds(engine, named: dict[str, torch.Tensor]) -> None:
    targets = engine.model.weight_targets()
    for name, want in named.items():
        got = targets[name].view()
        assert torch.equal(got.cpu(), want.to(got.dtype)), name


@needs_cuda
def test_ipc_push_from_a_colocated_trainer_process(served, default_model_dir):
    loop, server = served
    before = [o[0].token_ids for o in loop.generate([[1, 2, 3, 4]], GREEDY)]
    trainer = TrainerProcess(server.url, default_model_dir, hf=False, device="cuda:0")
    try:
        for bucket_bytes in (64 << 20, 0):  # packed buckets, then one handle per tensor (zero copy)
            version = loop.engine.weight_version + 1
            r = trainer.push(method="ipc", perturb="mlp", version=str(version), bucket_bytes=bucket_bytes)
            assert r["ok"], r
            assert loop.engine.weight_version == version
        assert_engine_holds(loop.engine, expected_weights(default_model_dir, ["mlp", "mlp"]))
        assert [o[0].token_ids for o in loop.generate([[1, 2, 3, 4]], GREEDY)] != before
    finally:
        trainer.close()


@needs_cuda
def test_gloo_push_from_a_cpu_trainer_into_a_gpu_engine(served, default_model_dir):
    loop, server = served
    trainer = TrainerProcess(server.url, default_model_dir, hf=False, device="cpu")
    try:
        version = loop.engine.weight_version + 1
        r = trainer.push(method="distributed", perturb="attn", version=str(version), bucket_bytes=32 << 20, backend="gloo")
        assert r["ok"], r
        assert loop.engine.weight_version == version
        assert_engine_holds(loop.engine, expected_weights(default_model_dir, ["attn"]))
    finally:
        trainer.close()


@needs_cuda
@pytest.mark.parametrize("staging", ["device", "cpu"])
def test_disk_push_into_a_gpu_engine(served, default_model_dir, staging):
    loop, server = served
    loop.receiver.staging = staging
    try:
        with WeightPusher(server.url, method="disk") as p:
            p.push(expected_weights(default_model_dir, ["mlp"]).items())
        assert_engine_holds(loop.engine, expected_weights(default_model_dir, ["mlp"]))
    finally:
        loop.receiver.staging = "auto"


@needs_two_gpus
@pytest.mark.parametrize("staging", ["device", "cpu"])
def test_nccl_push_from_a_trainer_on_another_gpu(served, default_model_dir, staging):
    loop, server = served
    loop.receiver.staging = staging
    trainer = TrainerProcess(server.url, default_model_dir, hf=False, device="cuda:1")
    try:
        for bucket_bytes in (32 << 20, 0):
            version = loop.engine.weight_version + 1
            r = trainer.push(method="distributed", perturb="mlp", version=str(version), bucket_bytes=bucket_bytes, backend="nccl")
            assert r["ok"], r
            assert loop.engine.weight_version == version
        assert_engine_holds(loop.engine, expected_weights(default_model_dir, ["mlp", "mlp"]))
    finally:
        trainer.close()
        loop.receiver.staging = "auto"


@needs_two_gpus
def test_nccl_trainer_stopped_mid_broadcast_times_out_and_the_engine_lives_on(served, default_model_dir):
    """The NCCL watchdog must not take the engine down: we abort the communicator ourselves."""
    loop, server = served
    rx = loop.receiver
    version0 = loop.engine.weight_version
    before = [o[0].token_ids for o in loop.generate([[1, 2, 3, 4]], GREEDY)]
    trainer = TrainerProcess(server.url, default_model_dir, hf=False, device="cuda:1")
    rx.timeout_s = 5.0
    try:
        trainer.send(cmd="push", method="distributed", perturb="mlp", bucket_bytes=64 << 10, backend="nccl")
        deadline = time.monotonic() + 60
        while not any(p["buckets_done"] >= 3 for p in loop.call(rx.progress)):
            assert time.monotonic() < deadline, "the push never started"
            time.sleep(0.001)
        os.kill(trainer.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while loop.call(rx.progress):
            assert time.monotonic() - t0 < 30, "the receiver never timed out"
            time.sleep(0.05)
        os.kill(trainer.proc.pid, signal.SIGKILL)
    finally:
        trainer.close()
        rx.timeout_s = 60
    time.sleep(2)  # give a watchdog time to do damage
    assert loop.engine.weight_version == version0
    assert [o[0].token_ids for o in loop.generate([[1, 2, 3, 4]], GREEDY)] == before
    trainer = TrainerProcess(server.url, default_model_dir, hf=False, device="cuda:1")
    try:
        r = trainer.push(method="distributed", version=str(version0 + 5), backend="nccl")
        assert r["ok"], r
    finally:
        trainer.close()
