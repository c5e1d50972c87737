"""Tensor parallelism on the CPU (gloo): an engine over 2 or 3 processes gives the tokens of one,
with speculation, weight pushes of every kind, and a rank that dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import requests
import torch
from server_process import running_server
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from rollout import Engine, SamplingParams, SpecConfig
from rollout.config import EngineConfig
from rollout.models.config import ModelConfig
from rollout.models.sharding import Shard
from rollout.models.weights import WeightError
from weight_sync import WeightPusher, WeightSyncError

PROMPTS = [[5 + k, 9, 13 + 2 * k, 7, 11 + k] for k in range(6)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, n=2, seed=11)
LOGPROB_TOL = 1e-5  # relative: the ranks' partial sums add up in another order than one rank's


def outputs(engine: Engine, prompts, params) -> list:
    return [o for r in engine.generate(prompts, params, return_logprob=True) for o in r]


def assert_same(one: list, many: list) -> None:
    assert [o.token_ids for o in many] == [o.token_ids for o in one]
    for a, b in zip(one, many):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) <= LOGPROB_TOL * max(1.0, abs(x)), (x, y)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-llama")
    make_tiny_model("llama", path)
    return path


@pytest.mark.parametrize("kind,size", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("qwen3_moe", 2), ("llama", 4)])
def test_tp_engine_gives_tp1_tokens_and_logprobs(tmp_path, kind, size):
    """q/k/v bias (qwen2), q/k norms and tied embeddings (qwen3), experts split by their width (qwen3_moe), KV heads
    replicated (4 ranks, 2 heads)."""
    make_tiny_model(kind, tmp_path)
    one = Engine(model=str(tmp_path), spec="off", device="cpu")
    threads = torch.get_num_threads()
    many = Engine(model=str(tmp_path), spec="off", device="cpu", tp_size=size)
    try:
        assert_same(outputs(one, PROMPTS, GREEDY), outputs(many, PROMPTS, GREEDY))
        assert_same(outputs(one, PROMPTS, SAMPLED), outputs(many, PROMPTS, SAMPLED))
    finally:
        many.close()
    assert torch.get_num_threads() == threads  # rank 0 ran in this process: its share of the cores is returned


def test_default_model_over_3_ranks_with_and_without_speculation(default_engine):
    """9 heads and 3 KV heads: a head of each per rank. Spec off and the hybrid (the n-gram index,
    and the default model's EAGLE-3 head split as the model is) give TP1's tokens and logprobs:
    every rank drafts the same tokens. The head's tensors pushed whole: each rank keeps its part.
    `auto` without a head is the n-gram index alone under TP."""
    from safetensors.torch import load_file

    from rollout.config import DEFAULT_HEAD

    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6,", "def add(a, b):\n    return"]
    params = [SamplingParams(temperature=0, max_new_tokens=12)] * 2 + [SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=5)]
    one = outputs(default_engine, prompts, params)
    off = Engine(model="default", spec="off", device="cpu", tp_size=3)
    try:
        assert_same(one, outputs(off, prompts, params))
    finally:
        off.close()
    assert [p.returncode for p in off.tp.procs] == [0, 0]  # every rank closed its group and left (none killed)
    hybrid = Engine(model="default", spec=SpecConfig(method="auto", draft_model="default", adaptive=False),
                    device="cpu", tp_size=3)  # (a fixed budget: drafts from the first steps)
    try:
        assert_same(one, outputs(hybrid, prompts, params))
        stats = hybrid.stats()
        assert stats["rollout/spec_draft_tokens/ngram"] > 0 and stats["rollout/spec_draft_tokens/eagle"] > 0
        with pytest.raises(WeightError, match="draft.midlayer.mlp.down_proj.weight"):
            hybrid.update_weights([("draft.midlayer.mlp.down_proj.weight", torch.zeros(3, 3))], version=1)
        held = {n: t.clone() for n, t in hybrid.runner.drafters.head.head.state_dict().items()}
        head = load_file(str(DEFAULT_HEAD / "model.safetensors"))
        hybrid.update_weights([("draft." + n, t) for n, t in head.items() if t.is_floating_point()], version=1)
        now = hybrid.runner.drafters.head.head.state_dict()
        assert all(torch.equal(now[n], t) for n, t in held.items())  # rank 0 kept exactly its part
        assert hybrid.stats()["rollout/spec_head_on"] == 1.0  # (a push with the head's tensors keeps it on)
        # the head's cycle weighs rank 0's step times: when rank 0 puts the head to sleep, the
        # other ranks' prefill steps leave it out too (else they wait in its all-reduce alone)
        hybrid.spec.cycle.wake_next = False  # (the push's wake-up, not yet spent: the head was awake)
        hybrid.spec.cycle._sleep("rank 0's measurements")
        assert not hybrid.spec.head_for_prefill(new_prompts=True)
        assert_same(one, outputs(hybrid, prompts, params))
    finally:
        hybrid.close()
    assert EngineConfig(model="default", spec="auto", tp_size=3).spec.drafters == ("ngram",)


def test_a_model_or_head_whose_heads_do_not_split_gets_an_error_naming_the_sizes(default_model_dir):
    from rollout.config import DEFAULT_HEAD
    from spec.draft_head import load_head

    target = ModelConfig.from_dir(default_model_dir)
    with pytest.raises(ValueError, match=r"the model does not split over tp_size 2: 2 does not fit its 9 attention heads"):
        Shard.check(target, 2)
    with pytest.raises(ValueError, match=r"the draft head does not split over tp_size 2: 2 does not fit its 9 attention"):
        load_head(DEFAULT_HEAD, target, layer=target.num_layers, shard=Shard(0, 2))


def test_update_weights_under_tp_equals_tp1_and_a_wrong_shape_changes_no_rank(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(torch.rand(model.model.norm.weight.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    pushed = dict(model.named_parameters())
    one = Engine(model=str(tiny), spec="off", device="cpu")
    many = Engine(model=str(tiny), spec="off", device="cpu", tp_size=2)
    try:
        before = outputs(many, PROMPTS, GREEDY)
        many.release_memory()  # every rank lets go, and takes back
        many.resume_memory()
        assert_same(before, outputs(many, PROMPTS, GREEDY))
        with pytest.raises(ValueError, match="shape"):
            many.update_weights([("model.layers.0.mlp.down_proj.weight", torch.randn(3, 3)), *pushed.items()])
        assert_same(before, outputs(many, PROMPTS, GREEDY))
        assert many.weight_version == 0
        specs = [(n, tuple(t.shape), t.dtype) for n, t in pushed.items()]
        with pytest.raises(WeightError, match="another tensor-parallel rank"):  # rank 1 staged no copy of its own
            many.update_weights_staged(specs, list(pushed.items()), version=3)
        assert_same(before, outputs(many, PROMPTS, GREEDY))
        assert many.weight_version == 0
        for engine in (one, many):
            engine.update_weights(pushed.items(), version=4)
        after = outputs(many, PROMPTS, GREEDY)
        assert_same(outputs(one, PROMPTS, GREEDY), after)
        assert [o.token_ids for o in after] != [o.token_ids for o in before]
        assert {v for o in after for v in o.weight_versions} == {4}
    finally:
        many.close()


def test_a_rank_stages_its_parts_of_a_push_not_the_whole_of_it(tiny):
    """The parts a rank stages land as the whole tensors would, own their memory (the bucket's
    buffer is freed), and the room they need is their size."""
    from rollout.models.loader import build_model
    from rollout.models.weights import copy_weights
    from weight_sync.buckets import TensorSpec
    from weight_sync.receiver import _kept_bytes, _owned, _parts

    cfg = ModelConfig.from_dir(tiny)
    whole = build_model(cfg, torch.device("cpu"), torch.float32).weight_targets()
    specs = [TensorSpec(n, t.shape, torch.float32) for n, t in whole.items()]
    pushed = [(s.name, torch.randn(s.shape)) for s in specs]
    from_whole, from_parts = (build_model(cfg, torch.device("cpu"), torch.float32, Shard(1, 2)) for _ in range(2))
    mine = from_parts.weight_targets()
    kept = _owned(_parts(pushed, mine), mine)
    copy_weights(from_whole.weight_targets(), pushed)  # (cut to the rank's part as they are copied)
    copy_weights(mine, kept)
    for (name, a), b in zip(from_whole.state_dict().items(), from_parts.state_dict().values()):
        assert torch.equal(a, b), name
    full = {n: t for n, t in pushed}
    split = [n for n, t in kept if t.shape != full[n].shape]
    assert len(split) > len(kept) // 2
    assert all(t.untyped_storage().data_ptr() != full[n].untyped_storage().data_ptr() for n, t in kept if n in split)
    assert _kept_bytes(specs, None) == sum(t.numel() * 4 for t in full.values())
    assert _kept_bytes(specs, mine) == sum(t.numel() * 4 for _, t in kept) < 0.6 * _kept_bytes(specs, None)


# ---------------- a server over 2 ranks ----------------
@pytest.fixture(scope="module")
def tp2(tiny):
    with running_server(str(tiny), "--tp-size", "2", "--max-running-seqs", "16", "--kv-cache-tokens", "4096") as server:
        yield server


@pytest.fixture(scope="module")
def tp1(tiny):
    with running_server(str(tiny), "--max-running-seqs", "16", "--kv-cache-tokens", "4096") as server:
        yield server


def generate(url: str, params: dict | None = None) -> list[list[int]]:
    body = {"input_ids": PROMPTS, "sampling_params": params or {"max_new_tokens": 8, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [s["output_ids"] for s in r.json()]


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_a_push_to_a_tp2_server_equals_the_same_push_to_tp1(tp2, tp1, tiny, method):
    info = requests.get(tp2.url + "/server_info", timeout=30).json()
    assert info["tp_size"] == 2
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(7 if method == "disk" else 8)))
    before = generate(tp2.url)
    version = str(int(requests.get(tp2.url + "/get_weight_version", timeout=10).json()["weight_version"]) + 1)
    for url in (tp1.url, tp2.url):
        with WeightPusher(url, method=method) as pusher:  # (TP2: the trainer and both ranks in one group)
            pusher.push(model.named_parameters(), version=version)
    after = generate(tp2.url)
    assert after == generate(tp1.url) != before
    assert requests.get(tp2.url + "/get_weight_version", timeout=10).json()["weight_version"] == version


def test_a_wrong_shape_push_to_a_tp2_server_changes_no_rank(tp2, tiny, tmp_path):
    wider = tmp_path / "wider"
    other = make_tiny_model("llama", wider, intermediate_size=96)
    before, version = generate(tp2.url), requests.get(tp2.url + "/get_weight_version", timeout=10).json()["weight_version"]
    with WeightPusher(tp2.url, method="distributed") as pusher, pytest.raises(WeightSyncError, match="shape"):
        pusher.push(other.named_parameters())
    assert generate(tp2.url) == before
    assert requests.get(tp2.url + "/get_weight_version", timeout=10).json()["weight_version"] == version


def test_a_rank_killed_mid_run_fails_requests_fast_and_the_group_restarts(tp2):
    long = {"max_new_tokens": 1000, "temperature": 1.0, "ignore_eos": True, "n": 2}
    result: dict = {}

    def run():
        r = requests.post(tp2.url + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": long}, timeout=300)
        result.update(status=r.status_code, body=r.text)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not requests.get(tp2.url + "/v1/loads", timeout=10).json()["loads"][0]["num_total_reqs"]:
        assert time.monotonic() < deadline, "the long request never showed in /v1/loads"
        time.sleep(0.05)
    leader = requests.get(tp2.url + "/server_info", timeout=30).json()["engine_pid"]
    rank1 = int(subprocess.check_output(["pgrep", "-P", str(leader), "-f", "rollout.engine.rank_process"]).split()[0])
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    thread.join(60)
    assert result.get("status") == 503 and time.monotonic() - killed_at < 10, result
    deadline = time.monotonic() + 120
    while requests.get(tp2.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the group did not come back"
        time.sleep(0.5)
    assert requests.get(tp2.url + "/server_info", timeout=30).json()["engine_pid"] != leader
    assert len(generate(tp2.url)) == len(PROMPTS)


def test_one_push_reaches_all_four_ranks_of_tp2_x_dp2(tp1, tiny):
    """Two replicas of two ranks each: the trainer's group holds all four (rank_offset + 2i + r)."""
    with running_server(str(tiny), "--tp-size", "2", "--dp-size", "2", "--max-running-seqs", "16",
                        "--kv-cache-tokens", "4096") as both:
        assert [r["dp_rank"] for r in requests.get(both.url + "/server_info", timeout=30).json()["replicas"]] == [0, 1]
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(9)))
        version = str(int(requests.get(tp1.url + "/get_weight_version", timeout=10).json()["weight_version"]) + 1)
        for url in (tp1.url, both.url):
            with WeightPusher(url, method="distributed") as pusher:
                assert pusher.push(model.named_parameters(), version=version)["weight_version"] == version
        assert generate(both.url) == generate(tp1.url)
        assert [r["weight_version"] for r in requests.get(both.url + "/server_info", timeout=30).json()["replicas"]] == [version] * 2


@pytest.mark.parametrize("size", [1, 4])
def test_a_coupled_engines_second_rollout_is_the_first_bit_for_bit_over_1_and_4_ranks(tiny, size):
    """Coupled sampling's second rollout verifies the first one's tokens as drafts, in steps of
    other row counts than the first's. Over 4 ranks a row's all-reduce must come out the same bits
    whatever the step's rows (gloo's ring sums a row in an order set by the tensor's size), or the
    draws and logprobs drift apart from the first rollout's."""
    engine = Engine(model=str(tiny), spec="ngram", device="cpu", coupled_sampling=True, spec_adaptive=False,
                    tp_size=size)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, ignore_eos=True)
    try:
        first = outputs(engine, PROMPTS, params)
        engine.reset_stats()
        second = outputs(engine, PROMPTS, params)
        assert [o.token_ids for o in second] == [o.token_ids for o in first]
        assert [o.logprobs for o in second] == [o.logprobs for o in first]
        assert engine.stats()["rollout/spec_accept_rate/coupled"] == 1.0
    finally:
        engine.close()


def _ordered_rank(rank: int, size: int, port: int) -> None:
    from torch._C._distributed_c10d import TCPStore

    from rollout.engine.tensor_parallel import RankGroup

    store = TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
    group = RankGroup(rank, size, torch.device("cpu"), store, ordered=True)
    gen = torch.Generator().manual_seed(rank)
    row = torch.randn(1, 576, generator=gen) * 3
    everyone = [torch.randn(1, 576, generator=torch.Generator().manual_seed(r)) * 3 for r in range(size)]
    want = torch.zeros(1, 576)
    for part in everyone:  # (rank order, from zero)
        want += part
    for rows in [1, 2, 5, 17, 300]:  # (gloo's ring alone sums row 0 differently at 2 rows than at 1)
        x = torch.cat([row, torch.randn(rows - 1, 576, generator=gen)])
        assert torch.equal(group.all_reduce(x)[:1], want), rows


def test_an_ordered_group_sums_a_row_to_the_same_bits_whatever_the_rows_beside_it():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ordered_rank, args=(3, port), nprocs=3, join=True)
