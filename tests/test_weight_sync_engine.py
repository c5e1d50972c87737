"""The weight routes of `rollout serve` on a tiny random Llama: pushes by broadcast (gloo) and disk
with WeightPusher, validation, versions, requests in flight, pause modes, timeouts, bad input, the
admin key. One server for the module, started with an admin key; every test starts unpaused on the
checkpoint's weights (pushed back as a new version), so versions only grow: tests compare relative ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import save_file
from server_process import free_port, running_server
from tiny_models import make_tiny_model
from weight_sync_http import ServerApi, error, versions, wait_for

from rollout import Engine, SamplingParams
from rollout.server.weight_routes import ROUTES
from weight_sync import WeightPusher, WeightReceiver, WeightSyncError
from weight_sync.group import WeightGroup

ADMIN_KEY = "weights-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", path)
    return path, hf


@pytest.fixture(scope="module")
def api(tiny):
    with running_server(str(tiny[0]), "--spec", "off", "--admin-key", ADMIN_KEY) as server:
        yield ServerApi(server.url, ADMIN)


@pytest.fixture(scope="module")
def background():
    """Runs HTTP calls that block (generation, pauses) while the test goes on."""
    with ThreadPoolExecutor(8) as pool:
        yield pool


@pytest.fixture(autouse=True)
def checkpoint_weights(api, tiny):
    """Each test starts unpaused, on the checkpoint's own weights; a failing test leaves no pause behind."""
    assert api.post("/continue_generation").status_code == 200
    with pusher(api, "disk") as p:
        p.push(tiny[1].named_parameters())
    yield
    api.post("/continue_generation")


def pusher(api: ServerApi, method: str = "distributed", **kw) -> WeightPusher:
    return WeightPusher(api.url, method=method, admin_key=ADMIN_KEY, timeout_s=30, **kw)


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


def engine_version(api: ServerApi) -> int:
    return api.stats()["rollout/weight_version"]


@pytest.mark.parametrize("method,bucket_bytes", [("distributed", 1 << 14), ("distributed", 0), ("disk", 0)])
def test_push_matches_hf_with_the_pushed_weights_and_advances_the_version(tiny, api, method, bucket_bytes):
    _, hf = tiny
    new = changed(hf)
    version = str(int(api.weight_version()) + 1)
    with pusher(api, method, bucket_bytes=bucket_bytes, dtype=torch.bfloat16 if bucket_bytes else None) as p:
        r = p.push(new, version=version)
    assert r["weight_version"] == version and api.weight_version() == version
    if bucket_bytes:  # pushed in bf16: the engine casts back to fp32, HF gets the same rounding
        new = [(n, t.to(torch.bfloat16).float()) for n, t in new]
    samples = api.generate(PROMPTS, GREEDY)
    assert [s["output_ids"] for s in samples] == [hf_greedy(hf, new, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert all(s["meta_info"]["weight_version"] == version for s in samples)
    assert all(s["meta_info"]["output_token_weight_versions"] == [version] * GREEDY["max_new_tokens"] for s in samples)


def test_a_trainer_pushes_again_and_again_on_one_group(tiny, api):
    v0 = int(api.weight_version())
    with pusher(api, bucket_bytes=1 << 15) as p:
        for step in range(1, 4):
            p.push(changed(tiny[1], 1 + step / 10), version=v0 + step)
        group = p._group
        assert group is not None and not group.closed
        # the receiver keeps the last push's checked metadata: one that differs in a shape is still refused
        bad = [(n, t[:-1] if n == "model.layers.0.mlp.up_proj.weight" else t) for n, t in changed(tiny[1])]
        with pytest.raises(WeightSyncError, match=r"shape \(127, 64\) != expected \(128, 64\)"):
            p.push(bad, version=v0 + 4)
    assert api.weight_version() == str(v0 + 3)


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
def test_weight_push_rejects_wrong_shape_unknown_name_wrong_dtype_and_keeps_old_weights(tiny, api, method, bad, message):
    before, v0 = api.tokens(PROMPTS, GREEDY), api.weight_version()
    with pusher(api, method, bucket_bytes=1 << 14) as p:
        with pytest.raises(WeightSyncError, match="nothing changed") as err:
            p.push([(n, t) for n, t in changed(tiny[1]) if n != bad[0]] + [bad], version=int(v0) + 5)
        assert message in str(err.value) and err.value.status == 400
        assert api.weight_version() == v0
        assert api.tokens(PROMPTS, GREEDY) == before
        p.push(changed(tiny[1]), version=int(v0) + 5)  # the same pusher recovers (a new group, for distributed)
    assert api.weight_version() == str(int(v0) + 5) and api.tokens(PROMPTS, GREEDY) != before


def test_versions_are_monotone_and_labels_are_echoed_in_outputs(tiny, api):
    v0 = int(api.weight_version())
    with pusher(api, "disk") as p:
        assert p.push(changed(tiny[1]), version=v0 + 3)["weight_version"] == str(v0 + 3)
        with pytest.raises(WeightSyncError, match=f"not above the current version {v0 + 3}") as err:
            p.push(changed(tiny[1]), version=v0 + 3)
        assert err.value.status == 409
        assert p.push(changed(tiny[1]), version="step-12-abc")["weight_version"] == "step-12-abc"
        assert engine_version(api) == v0 + 4
        labelled = api.generate([PROMPTS[0]], GREEDY)[0]["meta_info"]
        assert labelled["weight_version"] == "step-12-abc"
        assert labelled["output_token_weight_versions"] == ["step-12-abc"] * GREEDY["max_new_tokens"]
        assert p.push(changed(tiny[1]))["weight_version"] == str(v0 + 5)
    assert versions(api.generate([PROMPTS[0]], GREEDY)[0]) == [v0 + 5] * GREEDY["max_new_tokens"]
    assert api.weight_version() == str(v0 + 5)


def test_requests_running_during_an_update_all_complete_with_per_token_versions(tiny, api, background):
    """Tokens before the swap carry the old version, after it the new one; the continuation after
    the swap is exactly what the new weights say given the tokens so far (KV recomputed)."""
    n = 300
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    prompts = [[3 + i, 50 + i, 7] for i in range(6)]
    v0, start = int(api.weight_version()), api.output_tokens()
    running = background.submit(api.generate, prompts, params)
    wait_for(lambda: api.output_tokens() - start >= 5 * len(prompts), what="generation")
    with pusher(api, bucket_bytes=1 << 14) as p:
        p.push(changed(tiny[1]), version=v0 + 1)
    samples = running.result(120)
    switched, rest = 0, []
    for prompt, s in zip(prompts, samples):
        assert s["meta_info"]["finish_reason"]["type"] == "length" and len(s["output_ids"]) == n
        vs = versions(s)
        assert vs == sorted(vs) and set(vs) <= {v0, v0 + 1}
        k = vs.index(v0 + 1) if v0 + 1 in vs else n
        switched += 0 < k < n
        if k < n:
            params_rest = {**params, "max_new_tokens": n - k}
            rest.append((s["output_ids"][k:], background.submit(api.tokens, [prompt + s["output_ids"][:k]], params_rest)))
    assert switched >= 1  # the push landed while requests were running
    for want, got in rest:
        assert got.result(120)[0] == want


def test_pause_keep_holds_requests_then_they_continue_under_new_weights(tiny, api, background):
    n = 60
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    v0, start = int(api.weight_version()), api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], params)
    wait_for(lambda: api.output_tokens() - start >= 3, what="generation")
    r = api.post("/pause_generation", {"mode": "keep"})
    assert r.status_code == 200 and r.json()["mode"] == "keep"
    held_at = api.output_tokens() - start
    late = background.submit(api.generate, [PROMPTS[1]], params)  # arrives during the pause: held, not admitted
    wait_for(lambda: api.info()["weight_sync"]["held_requests"] == 1, what="holding the late request")
    time.sleep(0.1)
    assert api.output_tokens() - start == held_at and not running.done() and not late.done()
    with pusher(api, "disk") as p:
        p.push(changed(tiny[1]), version=v0 + 1)  # applied while paused
    assert api.output_tokens() - start == held_at
    assert api.post("/continue_generation").json()["success"]
    assert versions(running.result(30)[0]) == [v0] * held_at + [v0 + 1] * (n - held_at)
    assert versions(late.result(30)[0]) == [v0 + 1] * n


def test_pause_keep_with_flush_cache_false_keeps_the_kv(tiny, api, background):
    n = 400  # (still running when the server info, up to protocol.INFO_EVERY_S old, first shows 3 tokens)
    v0, start = int(api.weight_version()), api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[2]], {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    wait_for(lambda: api.output_tokens() - start >= 3, what="generation")
    assert api.post("/pause_generation", {"mode": "keep"}).status_code == 200
    preempted = api.stats()["rollout/num_preempted"]
    with pusher(api, "disk", flush_cache=False) as p:
        p.push(changed(tiny[1]), version=v0 + 1)
    assert api.stats()["rollout/num_preempted"] == preempted  # nothing recomputed
    api.post("/continue_generation")
    sample = running.result(30)[0]
    assert len(sample["output_ids"]) == n and versions(sample)[-1] == v0 + 1


def test_pause_abort_returns_partial_outputs_with_finish_reason_abort(api, background):
    params = {"temperature": 1.0, "n": 2, "max_new_tokens": 200, "ignore_eos": True, "seed": 0}
    start = api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], params)
    wait_for(lambda: api.output_tokens() - start >= 6, what="generation")
    r = api.post("/pause_generation", {"mode": "abort"}).json()
    assert r["mode"] == "abort" and r["aborted"] == 1
    samples = running.result(30)
    assert len(samples) == 2
    assert all(s["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(s["output_ids"]) < 200 for s in samples)
    assert api.stats()["rollout/kv_usage"] == 0


def test_pause_wait_lets_in_flight_requests_finish_and_holds_new_ones(api, background):
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    start = api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], params)
    wait_for(lambda: api.output_tokens() - start >= 1, what="generation")
    pause = background.submit(api.post, "/pause_generation", {"mode": "wait"})
    wait_for(lambda: api.info()["weight_sync"]["paused"] == "wait", what="the pause")
    late = background.submit(api.generate, [PROMPTS[1]], params)
    assert pause.result(30).json()["mode"] == "wait"
    assert running.result(30)[0]["meta_info"]["finish_reason"]["type"] == "length"
    wait_for(lambda: api.info()["weight_sync"]["held_requests"] == 1, what="holding the late request")
    assert not late.done()
    api.post("/continue_generation")
    assert len(late.result(30)[0]["output_ids"]) == 30


def test_a_request_aborted_while_held_reports_abort_after_continue(api, background):
    assert api.post("/pause_generation", {"mode": "abort"}).json()["aborted"] == 0
    late = background.submit(api.generate, [PROMPTS[1]], GREEDY, ["held-1"])
    wait_for(lambda: api.info()["weight_sync"]["held_requests"] == 1, what="holding the request")
    assert api.post("/abort_request", {"rid": "held-1"}).json() == {"aborted": ["held-1"]}
    api.post("/continue_generation")
    sample = late.result(30)[0]
    assert sample["meta_info"]["finish_reason"]["type"] == "abort" and sample["output_ids"] == []
    assert api.stats()["rollout/num_requests"] == 0


def test_update_with_abort_all_requests_aborts_in_flight_requests(tiny, api, background):
    v0, start = int(api.weight_version()), api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True})
    wait_for(lambda: api.output_tokens() - start >= 2, what="generation")
    with pusher(api, "disk", abort_all_requests=True) as p:
        p.push(changed(tiny[1]), version=v0 + 1)
    sample = running.result(30)[0]
    assert sample["meta_info"]["finish_reason"]["type"] == "abort" and set(versions(sample)) == {v0}


def test_an_update_aborting_all_requests_during_a_keep_pause_returns_them_before_continue(tiny, api, background):
    v0, start = int(api.weight_version()), api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True})
    wait_for(lambda: api.output_tokens() - start >= 2, what="generation")
    assert api.post("/pause_generation", {"mode": "keep"}).status_code == 200
    with pusher(api, "disk", abort_all_requests=True) as p:
        p.push(changed(tiny[1]), version=v0 + 1)
    sample = running.result(10)[0]  # still paused: nothing is left to hold, so the aborted request reports
    assert sample["meta_info"]["finish_reason"]["type"] == "abort" and set(versions(sample)) == {v0}
    assert api.info()["weight_sync"]["paused"] == "keep"


def test_flush_cache_answers_200_only_when_idle_as_sglang_does(api, background):
    start = api.output_tokens()
    running = background.submit(api.generate, [PROMPTS[0]], {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
    wait_for(lambda: api.output_tokens() - start >= 2, what="generation")
    busy = api.post("/flush_cache")
    assert busy.status_code == 400 and "in flight" in error(busy)
    assert len(running.result(30)[0]["output_ids"]) == 200  # untouched
    assert api.post("/flush_cache").json()["success"]


def test_a_trainer_that_never_sends_times_out_old_weights_serve_and_a_new_group_works(tiny, api):
    before, v0 = api.tokens(PROMPTS, GREEDY), int(api.weight_version())
    # A trainer that joins the group, announces an update, and then sends nothing.
    port, box = free_port(), {}
    t = threading.Thread(target=lambda: box.setdefault("g", WeightGroup.connect("127.0.0.1", port, 0, 2, "stuck", "gloo", torch.device("cpu"), 10)))
    t.start()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": "stuck", "backend": "gloo"}
    assert api.post("/init_weights_update_group", init).json()["success"]
    t.join()
    named = changed(tiny[1])
    update = {"names": [n for n, _ in named], "dtypes": ["float32"] * len(named), "shapes": [list(w.shape) for _, w in named],
              "group_name": "stuck", "weight_version": str(v0 + 9), "bucket_bytes": 1 << 14, "timeout_s": 1.0}
    t0 = time.monotonic()
    r = api.post("/update_weights_from_distributed", update)
    assert r.status_code == 504 and "timed out" in error(r) and 0.9 < time.monotonic() - t0 < 5
    box["g"].close()
    assert api.weight_version() == str(v0) and api.tokens(PROMPTS, GREEDY) == before
    r = api.post("/update_weights_from_distributed", update)
    assert r.status_code == 404 and "no weight-update group named 'stuck'" in error(r)
    with pusher(api, group_name="stuck") as p:
        p.push(named, version=v0 + 9)
    assert api.weight_version() == str(v0 + 9)


def test_a_wait_whose_deadline_is_under_a_millisecond_away_times_out_at_once():
    """gloo reads a sub-millisecond wait as "no timeout" and would block for its op timeout (60 s)."""
    port, box = free_port(), {}
    t = threading.Thread(target=lambda: box.setdefault("g", WeightGroup.connect("127.0.0.1", port, 0, 2, "ms", "gloo", torch.device("cpu"), 10)))
    t.start()
    group = WeightGroup.connect("127.0.0.1", port, 1, 2, "ms", "gloo", torch.device("cpu"), 10)
    t.join()
    try:
        work = group.start_broadcast(torch.zeros(4))
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="timed out"):
            group.wait(work, time.monotonic() + 0.0005)
        assert time.monotonic() - t0 < 1
    finally:
        box["g"].close()  # the peer first: then the transfer still pending here fails at once
        group.close()


def test_ipc_push_to_a_cpu_engine_is_refused_clearly(api):
    v0 = api.weight_version()
    handle = {"size": [256], "stride": [1], "offset": 0, "dtype": "uint8", "device_uuid": "GPU-x", "handle": "AAAA",
              "storage_size_bytes": 256, "storage_offset_bytes": 0, "ref_counter_handle": "AAAA", "ref_counter_offset": 0,
              "event_handle": None, "event_sync_required": False}
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "handles": [handle], "bucket_bytes": 1 << 20}
    r = api.post("/update_weights_from_tensor", body)
    assert r.status_code == 400 and "needs a CUDA engine" in error(r)
    assert api.weight_version() == v0


TENSOR = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
INIT = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}
BAD_BODIES = [
    ("malformed JSON", "/flush_cache", b'{"mode": ', 400, "not valid JSON"),
    ("not an object", "/pause_generation", b"[1]", 400, "JSON object"),
    ("unknown field", "/continue_generation", {"now": True}, 400, "unknown field(s) now"),
    ("a load format we lack", "/update_weights_from_disk", {"model_path": "CKPT", "load_format": "gguf"}, 400, "load_format"),
    ("missing field", "/init_weights_update_group", {**INIT, "master_port": None}, 400, "missing field(s) master_port"),
    ("missing fields", "/update_weights_from_distributed", {"names": ["a"]}, 400, "missing field(s) dtypes, shapes"),
    ("port not an integer", "/init_weights_update_group", {**INIT, "master_port": "port"}, 400, "master_port must be an integer"),
    ("rank 0 is the trainer's", "/init_weights_update_group", {**INIT, "rank_offset": 0}, 400, "rank_offset must be in"),
    ("unknown backend", "/init_weights_update_group", {**INIT, "backend": "mpi"}, 400, "backend 'mpi'"),
    ("unknown group", "/update_weights_from_distributed", {**TENSOR, "group_name": "nope"}, 404, "no weight-update group named 'nope'"),
    ("negative timeout", "/update_weights_from_distributed", {**TENSOR, "timeout_s": -1}, 400, "timeout_s"),
    ("no checkpoint there", "/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"}, 400, "cannot read checkpoint"),
    ("path not a string", "/update_weights_from_disk", {"model_path": 7}, 400, "model_path must be"),
    ("version not a string", "/update_weights_from_disk", {"model_path": "CKPT", "weight_version": ["9"]}, 400, "weight_version must be a string"),
    ("flag not a bool", "/update_weights_from_disk", {"model_path": "CKPT", "flush_cache": "yes"}, 400, "flush_cache must be true or false"),
    ("version going back", "/update_weights_from_disk", {"model_path": "CKPT", "weight_version": "0"}, 409, "not above the current version"),
    ("unknown pause mode", "/pause_generation", {"mode": "sometimes"}, 400, "pause mode 'sometimes'"),
    ("destroy unknown group", "/destroy_weights_update_group", {"group_name": "nope"}, 404, "no weight-update group named 'nope'"),
]


@pytest.mark.parametrize("route,body,status,needle", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_bad_input_to_a_weight_route_gets_a_4xx_naming_the_problem_and_nothing_changes(tiny, api, route, body, status, needle):
    before, v0 = api.tokens(PROMPTS, GREEDY), api.weight_version()
    if isinstance(body, dict):
        body = {k: str(tiny[0]) if v == "CKPT" else v for k, v in body.items() if v is not None}
        r = api.post(route, body)
    else:
        r = requests.post(api.url + route, data=body, headers={**ADMIN, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    assert needle in error(r)
    assert api.weight_version() == v0 and api.info()["weight_sync"]["paused"] is None
    assert api.tokens(PROMPTS, GREEDY) == before


def test_without_the_admin_key_weight_and_control_routes_answer_401_and_change_nothing(tiny, api, background, tmp_path):
    save_file({n: t.contiguous() for n, t in changed(tiny[1])}, str(tmp_path / "model.safetensors"))
    bodies = {"/update_weights_from_disk": {"model_path": str(tmp_path)}, "/pause_generation": {"mode": "keep"}}
    v0, start = int(api.weight_version()), api.output_tokens()
    n = 64
    running = background.submit(api.generate, [PROMPTS[0]], {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    wait_for(lambda: api.output_tokens() - start >= 1, what="generation")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ADMIN_KEY}x"}):
        for route in ROUTES:
            r = api.post(route, bodies.get(route, {}), headers=headers)
            assert r.status_code == 401 and "admin key" in error(r), (route, r.text)
        r = requests.get(api.url + "/get_weight_version", headers=headers, timeout=10)
        assert r.status_code == 401
    sample = running.result(30)[0]  # never paused, never aborted, never updated
    assert sample["meta_info"]["finish_reason"]["type"] == "length" and versions(sample) == [v0] * n
    assert api.weight_version() == str(v0) and api.info()["weight_sync"]["paused"] is None


def test_metrics_and_server_info_report_the_push(tiny, api):
    v0 = int(api.weight_version())
    with pusher(api, "disk") as p:
        r = p.push(changed(tiny[1]), version=v0 + 1)["responses"][0]
    metrics = {}
    for line in requests.get(api.url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    assert metrics["rollout_weight_version"] == v0 + 1 and metrics["rollout_paused"] == 0
    assert metrics["rollout_weight_sync_s"] == pytest.approx(r["total_s"]) and r["total_s"] >= r["apply_s"] > 0
    info = api.info()
    assert info["weight_version"] == str(v0 + 1)
    assert info["weight_sync"]["last_update"]["weight_version"] == str(v0 + 1) and info["weight_sync"]["updates_in_flight"] == []
    assert info["stats"]["rollout/weight_sync_s"] == metrics["rollout_weight_sync_s"]


def test_the_drafters_history_survives_weight_updates(tiny, tmp_path):
    """In process: the receiver swaps weights under a speculating engine; the index keeps what it learnt."""
    engine = Engine(model=str(tiny[0]), spec="ngram", device="cpu")
    rx = WeightReceiver(engine)
    try:
        prompt = [11, 12, 13, 14] * 4
        req = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
        while engine.has_work:
            engine.step()
        seq = req.sequences[0]
        index = engine.spec.index

        def snapshot():
            return index.history_rows_used, engine.table.read(seq.history_row)

        before = snapshot()
        assert before[0] == 1 and before[1] == seq.tokens
        for version, scale in ((1, 1.5), (2, 2.0)):
            ckpt = tmp_path / f"v{version}"
            ckpt.mkdir()
            save_file({n: t.contiguous() for n, t in changed(tiny[1], scale)}, str(ckpt / "model.safetensors"))
            fut = rx.update_from_disk(str(ckpt), weight_version=str(version))
            while not fut.done():
                rx.at_step_boundary()  # what the engine loop does between steps
                time.sleep(0.001)
            assert fut.result()["weight_version"] == str(version)
        assert engine.weight_version == 2 and engine.spec.index is index and snapshot() == before
    finally:
        rx.close()


def test_checkpoint_headers_have_one_reader_for_the_initial_load_the_engine_and_the_server(tmp_path):
    """A checkpoint's dtypes read alike wherever it is read: an int tensor is named as what it is,
    a dtype the model cannot take is refused by name, before anything is read."""
    from rollout.models.weights import WeightError, checkpoint_specs
    from weight_sync.receiver import _checkpoint_specs

    save_file({"a": torch.zeros(2, dtype=torch.int32), "b": torch.ones(3, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    assert checkpoint_specs(tmp_path) == [("a", (2,), torch.int32), ("b", (3,), torch.bfloat16)]
    assert [(s.name, s.dtype) for s in _checkpoint_specs(tmp_path)] == [("a", torch.int32), ("b", torch.bfloat16)]
    save_file({"c": torch.zeros(2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="F8_E4M3"):
        checkpoint_specs(tmp_path)
    with pytest.raises(WeightSyncError, match="F8_E4M3"):
        _checkpoint_specs(tmp_path)
