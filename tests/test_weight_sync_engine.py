"""The receiver against an in-process engine (tiny random Llama): validation, versions, in-flight
requests, pause modes, timeouts, and the n-gram trie across updates. Pushes go through the
real pusher and HTTP (weight_sync.dev_server), from this process."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from rollout import Engine, SamplingParams
from tiny_models import make_tiny_model
from weight_sync import WeightPusher, WeightSyncError
from weight_sync.dev_server import DevServer, EngineLoop
from weight_sync.group import WeightGroup

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", path)
    return path, hf


@pytest.fixture
def served(tiny):
    """A fresh engine (original weights, version 0) behind the weight routes."""
    engine = Engine(model=str(tiny[0]), spec="off", device="cpu")
    loop = EngineLoop(engine, timeout_s=10)
    server = DevServer(loop)
    yield loop, server
    server.close()
    loop.close()


def changed(hf, scale: float = 1.5) -> list[tuple[str, torch.Tensor]]:
    """The HF model's weights after a pretend optimizer step (the HF model itself is left alone)."""
    out = []
    for name, t in hf.named_parameters():
        t = t.detach().clone()
        if "mlp" in name or "q_proj" in name:
            t *= scale
        out.append((name, t))
    return out


def hf_greedy(hf, named, prompt, n: int) -> list[int]:
    model = type(hf)(hf.config).eval()
    model.load_state_dict(dict(named), strict=False)
    model.tie_weights()
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def tokens(loop, params=GREEDY) -> list[list[int]]:
    return [o[0].token_ids for o in loop.generate(PROMPTS, params)]


@pytest.mark.parametrize("method,bucket_bytes", [("distributed", 1 << 14), ("distributed", 0), ("disk", 0)])
def test_push_matches_hf_with_the_pushed_weights_and_advances_the_version(tiny, served, method, bucket_bytes):
    _, hf = tiny
    loop, server = served
    new = changed(hf)
    with WeightPusher(server.url, method=method, bucket_bytes=bucket_bytes, dtype=torch.bfloat16 if bucket_bytes else None) as p:
        r = p.push(new, version="7")
    assert r["weight_version"] == "7" and loop.engine.weight_version == 7
    if bucket_bytes:  # pushed in bf16: the engine casts back to fp32, HF gets the same rounding
        new = [(n, t.to(torch.bfloat16).float()) for n, t in new]
    assert tokens(loop) == [hf_greedy(hf, new, p, GREEDY.max_new_tokens) for p in PROMPTS]


def test_a_trainer_pushes_again_and_again_on_one_group(tiny, served):
    loop, server = served
    with WeightPusher(server.url, bucket_bytes=1 << 15) as p:
        for step in range(1, 4):
            p.push(changed(tiny[1], 1 + step / 10), version=step)
        group = p._group
        assert group is not None and not group.closed
    assert loop.engine.weight_version == 3


@pytest.mark.parametrize("method", ["distributed", "disk"])
@pytest.mark.parametrize(
    "bad,message",
    [
        (("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 64)), "shape (64, 64) != expected (128, 64)"),
        (("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64)), "unknown weight 'model.layers.9.mlp.up_proj.weight'"),
        (("model.norm.weight", torch.ones(64, dtype=torch.int32)), "dtype torch.int32 is not a floating-point type"),
    ],
    ids=["shape", "name", "dtype"],
)
def test_weight_push_rejects_wrong_shape_unknown_name_wrong_dtype_and_keeps_old_weights(tiny, served, method, bad, message):
    loop, server = served
    before = tokens(loop)
    with WeightPusher(server.url, method=method, bucket_bytes=1 << 14, timeout_s=10) as p:
        with pytest.raises(WeightSyncError, match="nothing changed") as err:
            p.push([(n, t) for n, t in changed(tiny[1]) if n != bad[0]] + [bad], version=5)
        assert message in str(err.value) and err.value.status == 400
        assert loop.engine.weight_version == 0
        assert tokens(loop) == before
        p.push(changed(tiny[1]), version=5)  # the same pusher recovers (a new group, for distributed)
    assert loop.engine.weight_version == 5 and tokens(loop) != before


def test_versions_are_monotone_and_labels_are_echoed(tiny, served):
    loop, server = served
    rx = loop.receiver
    with WeightPusher(server.url, method="disk") as p:
        assert p.push(changed(tiny[1]), version=3)["weight_version"] == "3"
        with pytest.raises(WeightSyncError, match="not above the current version 3") as err:
            p.push(changed(tiny[1]), version=3)
        assert err.value.status == 409
        assert p.push(changed(tiny[1]), version="step-12-abc")["weight_version"] == "step-12-abc"
        assert loop.engine.weight_version == 4
        assert p.push(changed(tiny[1]))["weight_version"] == "5"
    out = loop.generate([PROMPTS[0]], GREEDY)[0][0]
    assert out.weight_versions == [5] * GREEDY.max_new_tokens
    assert rx.version_label(4) == "step-12-abc" and loop.call(rx.get_weight_version) == {"weight_version": "5"}


def test_requests_running_during_an_update_all_complete_with_per_token_versions(tiny, served):
    """Tokens before the swap carry the old version, after it the new one; the continuation after
    the swap is exactly what the new weights say given the tokens so far (KV recomputed)."""
    loop, server = served
    params = SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True)
    prompts = [[3 + i, 50 + i, 7] for i in range(6)]
    reqs = [loop.add_request(p, params).result(10) for p in prompts]
    while loop.call(lambda: min(len(r.sequences[0].weight_versions) for r in reqs)) < 5:
        time.sleep(0.002)
    with WeightPusher(server.url, bucket_bytes=1 << 14) as p:
        p.push(changed(tiny[1]), version=1)
    loop.wait_finished(reqs)
    switched = 0
    for prompt, req in zip(prompts, reqs):
        seq = req.sequences[0]
        assert seq.finish_reason == "length" and seq.num_output == params.max_new_tokens
        versions = seq.weight_versions
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        k = versions.index(1) if 1 in versions else len(versions)
        switched += 0 < k < len(versions)
        if k < len(versions):
            rest = SamplingParams(temperature=0, max_new_tokens=len(versions) - k, ignore_eos=True)
            assert loop.generate([prompt + seq.output_ids[:k]], rest)[0][0].token_ids == seq.output_ids[k:]
    assert switched >= 1  # the push landed while requests were running


def test_pause_keep_holds_requests_then_they_continue_under_new_weights(tiny, served):
    loop, server = served
    rx = loop.receiver
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    running = loop.add_request(PROMPTS[0], params).result(10)
    while loop.call(lambda: running.sequences[0].num_output) < 3:
        time.sleep(0.002)
    assert loop.call(rx.gate.pause, "keep").result(10)["mode"] == "keep"
    held_at = loop.call(lambda: running.sequences[0].num_output)
    late = loop.add_request(PROMPTS[1], params)  # arrives during the pause: held, not admitted
    time.sleep(0.1)
    assert loop.call(lambda: running.sequences[0].num_output) == held_at and not late.done()
    with WeightPusher(server.url, method="disk") as p:
        p.push(changed(tiny[1]), version=1)  # applied while paused
    assert loop.call(lambda: running.sequences[0].num_output) == held_at
    loop.resume()
    late_req = late.result(10)
    loop.wait_finished([running, late_req])
    versions = running.sequences[0].weight_versions
    assert versions == [0] * held_at + [1] * (params.max_new_tokens - held_at)
    assert late_req.sequences[0].weight_versions == [1] * params.max_new_tokens


def test_pause_keep_with_flush_cache_false_keeps_the_kv(tiny, served):
    loop, server = served
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    req = loop.add_request(PROMPTS[2], params).result(10)
    while loop.call(lambda: req.sequences[0].num_output) < 3:
        time.sleep(0.002)
    loop.call(loop.receiver.gate.pause, "keep").result(10)
    preempted = loop.engine.scheduler.num_preempted
    with WeightPusher(server.url, method="disk", flush_cache=False) as p:
        p.push(changed(tiny[1]), version=1)
    assert loop.engine.scheduler.num_preempted == preempted  # nothing recomputed
    loop.resume()
    loop.wait_finished([req])
    assert req.sequences[0].num_output == params.max_new_tokens and req.sequences[0].weight_versions[-1] == 1


def test_pause_abort_returns_partial_outputs_with_finish_reason_abort(served):
    loop, _ = served
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=200, ignore_eos=True, seed=0)
    req = loop.add_request(PROMPTS[0], params).result(10)
    while loop.call(lambda: req.sequences[0].num_output) < 3:
        time.sleep(0.002)
    result = loop.call(loop.receiver.gate.pause, "abort").result(10)
    assert result["aborted"] == 1
    assert req.finished and all(s.finish_reason == "abort" and 0 < s.num_output < 200 for s in req.sequences)
    assert loop.engine.pool.used_slots == 0
    loop.resume()


def test_pause_wait_lets_in_flight_requests_finish_and_holds_new_ones(served):
    loop, _ = served
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    req = loop.add_request(PROMPTS[0], params).result(10)
    paused = loop.call(loop.receiver.gate.pause, "wait")
    late = loop.add_request(PROMPTS[1], params)
    assert paused.result(30)["mode"] == "wait"
    assert req.finished and req.sequences[0].finish_reason == "length"
    time.sleep(0.05)
    assert not late.done()
    loop.resume()
    loop.wait_finished([late.result(10)])


def test_update_with_abort_all_requests_aborts_in_flight_requests(tiny, served):
    loop, server = served
    req = loop.add_request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)).result(10)
    while loop.call(lambda: req.sequences[0].num_output) < 2:
        time.sleep(0.002)
    with WeightPusher(server.url, method="disk", abort_all_requests=True) as p:
        p.push(changed(tiny[1]), version=1)
    loop.wait_finished([req])
    assert req.sequences[0].finish_reason == "abort" and set(req.sequences[0].weight_versions) == {0}


def test_a_trainer_that_never_sends_times_out_old_weights_serve_and_a_new_group_works(tiny, served):
    loop, server = served
    rx = loop.receiver
    rx.timeout_s = 1.0
    before = tokens(loop)
    # A trainer that joins the group, announces an update, and then sends nothing.
    box = {}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t = threading.Thread(target=lambda: box.setdefault("g", WeightGroup.connect("127.0.0.1", port, 0, 2, "stuck", "gloo", torch.device("cpu"), 10)))
    t.start()
    loop.call(rx.init_group, "127.0.0.1", port, 1, 2, "stuck").result(10)
    t.join()
    names = [n for n, _ in changed(tiny[1])]
    shapes = [list(w.shape) for _, w in changed(tiny[1])]
    fut = loop.call(rx.update_from_distributed, names, ["float32"] * len(names), shapes, "stuck", "9", True, 1 << 14)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="timed out") as err:
        fut.result(10)
    assert err.value.status == 504 and 0.9 < time.monotonic() - t0 < 5
    box["g"].close()
    assert loop.engine.weight_version == 0 and tokens(loop) == before
    with pytest.raises(WeightSyncError, match="no weight-update group named 'stuck'"):
        loop.call(rx.update_from_distributed, names, ["float32"] * len(names), shapes, "stuck").result(1)
    rx.timeout_s = 10
    with WeightPusher(server.url, group_name="stuck") as p:
        p.push(changed(tiny[1]), version=9)
    assert loop.engine.weight_version == 9


def test_ipc_push_to_a_cpu_engine_is_refused_clearly(served):
    loop, _ = served
    handle = {"size": [256], "stride": [1], "offset": 0, "dtype": "uint8", "device_uuid": "GPU-x", "handle": "AAAA",
              "storage_size_bytes": 256, "storage_offset_bytes": 0, "ref_counter_handle": "AAAA", "ref_counter_offset": 0,
              "event_handle": None, "event_sync_required": False}
    fut = loop.call(loop.receiver.update_from_tensor, ["model.norm.weight"], ["float32"], [[64]], [handle], 1 << 20)
    with pytest.raises(WeightSyncError, match="needs a CUDA engine"):
        fut.result(1)
    assert loop.engine.weight_version == 0


def test_ngram_trie_survives_weight_updates(tiny):
    engine = Engine(model=str(tiny[0]), spec="ngram", device="cpu")
    loop = EngineLoop(engine)
    server = DevServer(loop)
    try:
        prompt = [11, 12, 13, 14] * 4
        loop.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
        drafter = engine.drafter

        def snapshot():
            return drafter.memory_nodes(), {k: sorted(e.trie.items()) for k, e in drafter._history.items()}

        before = loop.call(snapshot)
        assert before[0] > 0 and tuple(prompt) in before[1]
        with WeightPusher(server.url) as p:
            p.push(changed(tiny[1]), version=1)
        with WeightPusher(server.url, method="disk") as p:
            p.push(changed(tiny[1], 2.0), version=2)
        assert engine.drafter is drafter and loop.call(snapshot) == before
    finally:
        server.close()
        loop.close()
