"""Weight pushes to a CUDA engine behind `rollout serve`: IPC from a colocated trainer, NCCL between
two GPUs, gloo and disk into a GPU engine.

Run on a GPU machine: `pytest -m gpu tests/test_weight_sync_gpu.py`. The server serves the
default model in bf16 on cuda:0; after each push its version must have advanced and its greedy
output must equal that of an in-process engine on the same GPU holding the trainer's tensors
(cast to bf16). Staging (on the GPU or in pinned host memory) is checked in process, weight
for weight.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from safetensors.torch import save_file  # noqa: E402
from server_process import running_server  # noqa: E402
from weight_sync_http import ServerApi, wait_for  # noqa: E402
from weight_sync_trainer import TrainerProcess, perturb  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.models.weights import iter_checkpoint  # noqa: E402
from weight_sync import WeightPusher, WeightReceiver  # noqa: E402

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPT = [1, 2, 3, 4]
KV_TOKENS = "16384"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")


@pytest.fixture(scope="module")
def api(default_model_dir):
    with running_server(str(default_model_dir), "--device", "cuda", "--spec", "off", "--kv-cache-tokens", KV_TOKENS) as server:
        yield ServerApi(server.url)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """The same engine in this process, on the same GPU: what the server must say with given weights."""
    return Engine(model=str(default_model_dir), spec="off", device="cuda", kv_cache_tokens=int(KV_TOKENS))


def expected_weights(model_dir, kinds: list[str]) -> dict[str, torch.Tensor]:
    named = {n: t.clone() for n, t in iter_checkpoint(model_dir)}
    for kind in kinds:
        perturb(named, kind)
    return named


def greedy_with(reference: Engine, named: dict[str, torch.Tensor]) -> list[int]:
    reference.update_weights(named.items())
    return reference.generate([PROMPT], SamplingParams(**GREEDY))[0][0].token_ids


def assert_engine_holds(engine: Engine, named: dict[str, torch.Tensor]) -> None:
    targets = engine.model.weight_targets()
    for name, want in named.items():
        got = targets[name].view()
        assert torch.equal(got.cpu(), want.to(got.dtype)), name


@needs_cuda
def test_ipc_push_from_a_colocated_trainer_process(api, reference, default_model_dir):
    before = api.tokens([PROMPT], GREEDY)[0]
    trainer = TrainerProcess(api.url, default_model_dir, hf=False, device="cuda:0")
    try:
        for bucket_bytes in (64 << 20, 0):  # packed buckets, then one handle per tensor (zero copy)
            version = str(int(api.weight_version()) + 1)
            r = trainer.push(method="ipc", perturb="mlp", version=version, bucket_bytes=bucket_bytes)
            assert r["ok"], r
            assert api.weight_version() == version
    finally:
        trainer.close()
    after = api.tokens([PROMPT], GREEDY)[0]
    assert after == greedy_with(reference, expected_weights(default_model_dir, ["mlp", "mlp"])) and after != before


@needs_cuda
def test_gloo_push_from_a_cpu_trainer_into_a_gpu_engine(api, reference, default_model_dir):
    trainer = TrainerProcess(api.url, default_model_dir, hf=False, device="cpu")
    try:
        version = str(int(api.weight_version()) + 1)
        r = trainer.push(method="distributed", perturb="attn", version=version, bucket_bytes=32 << 20, backend="gloo")
        assert r["ok"], r
        assert api.weight_version() == version
    finally:
        trainer.close()
    assert api.tokens([PROMPT], GREEDY)[0] == greedy_with(reference, expected_weights(default_model_dir, ["attn"]))


@needs_cuda
def test_disk_push_into_a_gpu_engine(api, reference, default_model_dir):
    with WeightPusher(api.url, method="disk") as p:
        p.push(expected_weights(default_model_dir, ["mlp"]).items())
    assert api.tokens([PROMPT], GREEDY)[0] == greedy_with(reference, expected_weights(default_model_dir, ["mlp"]))


@needs_cuda
@pytest.mark.parametrize("staging", ["device", "cpu"])
def test_received_weights_staged_on_the_gpu_or_in_pinned_host_memory_land_exactly(reference, default_model_dir, staging, tmp_path):
    expected = expected_weights(default_model_dir, ["attn", "mlp"])
    save_file({n: t.contiguous() for n, t in expected.items()}, str(tmp_path / "model.safetensors"))
    rx = WeightReceiver(reference, staging=staging)
    try:
        fut = rx.update_from_disk(str(tmp_path))
        while not fut.done():
            rx.at_step_boundary()  # what the engine loop does between steps
            time.sleep(0.001)
        fut.result()
    finally:
        rx.close()
    assert_engine_holds(reference, expected)


@needs_cuda
def test_auto_staging_counts_the_memory_an_earlier_staging_left_in_the_allocators_cache(reference):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    nbytes = int(torch.cuda.mem_get_info(device)[0] * 0.6)
    block = torch.empty(nbytes, dtype=torch.uint8, device=device)
    del block  # cached by the allocator (as a swapped-in push's staging is), no longer free to the driver
    assert torch.cuda.mem_get_info(device)[0] < nbytes
    rx = WeightReceiver(reference, staging="auto")
    try:
        assert rx._staging_device(device, int(nbytes * 0.8)) == device
        assert rx._staging_device(torch.device("cuda"), int(nbytes * 0.8)).type == "cuda"  # (an engine on "cuda")
        assert rx._staging_device(device, nbytes * 3) == torch.device("cpu")
    finally:
        rx.close()
        torch.cuda.empty_cache()


@needs_two_gpus
def test_nccl_push_from_a_trainer_on_another_gpu(api, reference, default_model_dir):
    trainer = TrainerProcess(api.url, default_model_dir, hf=False, device="cuda:1")
    try:
        for bucket_bytes in (32 << 20, 0):
            version = str(int(api.weight_version()) + 1)
            r = trainer.push(method="distributed", perturb="mlp", version=version, bucket_bytes=bucket_bytes, backend="nccl")
            assert r["ok"], r
            assert api.weight_version() == version
    finally:
        trainer.close()
    assert api.tokens([PROMPT], GREEDY)[0] == greedy_with(reference, expected_weights(default_model_dir, ["mlp", "mlp"]))


@needs_two_gpus
def test_nccl_trainer_stopped_mid_broadcast_times_out_and_the_engine_lives_on(api, default_model_dir):
    """The NCCL watchdog must not take the engine down: we abort the communicator ourselves."""
    version0 = api.weight_version()
    before = api.tokens([PROMPT], GREEDY)[0]

    def in_flight() -> list[dict]:
        return api.info()["weight_sync"]["updates_in_flight"]

    trainer = TrainerProcess(api.url, default_model_dir, hf=False, device="cuda:1", timeout_s=5)  # the server's timeout too
    try:
        trainer.send(cmd="push", method="distributed", perturb="mlp", bucket_bytes=64 << 10, backend="nccl", freeze_after=12)
        wait_for(lambda: any(p["buckets_done"] >= 3 for p in in_flight()), timeout=60, what="the push starting")
        wait_for(lambda: not in_flight(), timeout=30, what="the receiver timing out")
        os.kill(trainer.proc.pid, signal.SIGKILL)
    finally:
        trainer.close()
    time.sleep(2)  # give a watchdog time to do damage
    assert api.info()["weight_sync"]["last_error"] and api.weight_version() == version0
    assert api.tokens([PROMPT], GREEDY)[0] == before
    trainer = TrainerProcess(api.url, default_model_dir, hf=False, device="cuda:1")
    try:
        r = trainer.push(method="distributed", version=str(int(version0) + 5), backend="nccl")
        assert r["ok"], r
    finally:
        trainer.close()
