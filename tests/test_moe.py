"""Mixture-of-experts models (Qwen3-MoE) against transformers: the registry, routing, speculation,
tensor parallelism and pushes of expert tensors by their checkpoint names. (Greedy tokens and
logprobs against HF, batched and alone, are tests/test_models_match_hf.py's, for every family.)"""

from __future__ import annotations

import random

import pytest
import requests
import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_model

from rollout import Engine, SamplingParams
from rollout.models.config import ModelConfig
from rollout.models.registry import model_class
from rollout.models.weights import WeightError, copy_pairs, iter_checkpoint

GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    return path, make_tiny_model("qwen3_moe", path)


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(num)]


def hf_greedy(hf, prompt: list[int], n: int = 12) -> list[int]:
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def test_the_registry_builds_each_family_by_architecture_and_names_the_ones_it_serves():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2)
    moe = ModelConfig.from_dict({**base, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                                 "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                 "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert moe.sparse_layers == (1,) and model_class(moe).__name__ == "Qwen3MoeCausalLM"
    dense = ModelConfig.from_dict({**base, "model_type": "llama"})  # (no architectures: its model_type's)
    assert dense.sparse_layers == () and model_class(dense).__name__ == "CausalLM"
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported; this engine runs .*Qwen3Moe"):
        model_class(ModelConfig.from_dict({**base, "model_type": "llama", "architectures": ["GPT2LMHeadModel"]}))


def test_speculation_on_an_moe_model_gives_the_tokens_and_logprobs_of_spec_off(moe):
    path, hf = moe
    off = Engine(model=str(path), spec="off", device="cpu")
    on = Engine(model=str(path), spec="ngram", spec_adaptive=False, device="cpu")
    ps = [p * 3 for p in prompts(4, seed=2)]  # (repeats for the index to draft from)
    for params in (GREEDY, SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=5)):
        a = [o for g in off.generate(ps, params, return_logprob=True) for o in g]
        b = [o for g in on.generate(ps, params, return_logprob=True) for o in g]
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert all(x.logprobs == pytest.approx(y.logprobs, abs=1e-5) for x, y in zip(a, b))
    assert on.stats()["rollout/spec_draft_tokens"] > 0
    assert [o[0].token_ids for o in off.generate(ps, GREEDY)] == [hf_greedy(hf, p) for p in ps]


def _changed_experts(path) -> dict[str, torch.Tensor]:
    """Every expert tensor of the checkpoint, as a trainer's step would change them."""
    gen = torch.Generator().manual_seed(3)
    return {n: t * (1 + 0.5 * torch.randn(t.shape, generator=gen)) for n, t in iter_checkpoint(path) if ".experts." in n}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_push_of_expert_tensors_by_their_checkpoint_names_changes_the_output_as_in_hf(moe, tmp_path, tp_size):
    import shutil

    from transformers import AutoModelForCausalLM

    path, hf = moe
    new = _changed_experts(path)
    assert len(new) == 4 * 3  # (layer 0's four experts; layer 1 is dense)
    for f in path.iterdir():  # the same change to the checkpoint, loaded by transformers
        shutil.copy(f, tmp_path)
    save_file({**{n: t.contiguous() for n, t in iter_checkpoint(path)}, **new}, str(tmp_path / "model.safetensors"))
    changed = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = Engine(model=str(path), spec="off", device="cpu", tp_size=tp_size)
    try:
        ps = prompts(3, seed=4)
        expected = [hf_greedy(changed, p) for p in ps]
        assert expected != [hf_greedy(hf, p) for p in ps]
        assert engine.update_weights(list(new.items()), version=1) == 1
        assert [o[0].token_ids for o in engine.generate(ps, GREEDY)] == expected
        # transformers 5's own names (its experts stacked), as a trainer holding the HF model pushes them
        engine.update_weights(list(hf.named_parameters()), version=2)
        assert [o[0].token_ids for o in engine.generate(ps, GREEDY)] == [hf_greedy(hf, p) for p in ps]
        stacked = [(n, t) for n, t in changed.named_parameters() if ".experts." in n]
        assert {n.rsplit(".", 1)[1] for n, _ in stacked} == {"gate_up_proj", "down_proj"}
        engine.update_weights(stacked, version=3)
        assert [o[0].token_ids for o in engine.generate(ps, GREEDY)] == expected
    finally:
        engine.close()


def test_experts_packed_in_a_bucket_land_exactly_as_one_copy_per_stacked_parameter(moe):
    from weight_sync.buckets import TensorSpec, pack, plan_buckets, unpack

    path, _ = moe
    engine = Engine(model=str(path), spec="off", device="cpu")
    new = _changed_experts(path)  # (expert 0's down, gate and up, then expert 1's, ...)
    new["model.layers.0.mlp.gate.weight"] = torch.randn(4, 64)  # the router, between two runs of layer 0's experts
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in new.items()]
    (bucket,) = plan_buckets(specs, 1 << 30)
    staged = unpack(bucket, pack(bucket, list(new.values()), specs), specs)  # as a receiver stages a push
    staged.insert(6, staged.pop())  # the router after expert 1: every stacked parameter's run ends there
    targets = engine.weights.targets()
    copies = list(copy_pairs(targets, staged))
    assert sorted(tuple(to.shape) for to, _ in copies) == [(2, 48, 64)] * 4 + [(2, 64, 48)] * 2 + [(4, 64)]
    engine.update_weights(staged, version=1)
    assert all(torch.equal(targets[n].view(), t) for n, t in new.items())


def test_a_push_naming_an_unknown_expert_or_of_a_wrong_shape_is_refused_whole(moe):
    path, _ = moe
    engine = Engine(model=str(path), spec="off", device="cpu")
    before = [o[0].token_ids for o in engine.generate(prompts(2), GREEDY)]
    good = _changed_experts(path)
    bad_index = {**good, "model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(48, 64)}
    with pytest.raises(WeightError, match=r"unknown weight 'model\.layers\.0\.mlp\.experts\.4\.gate_proj\.weight'"):
        engine.update_weights(list(bad_index.items()))
    bad_shape = {**good, "model.layers.0.mlp.experts.1.down_proj.weight": torch.zeros(64, 47)}
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mlp\.experts\.1\.down_proj\.weight: shape \(64, 47\) != "
                                          r"expected \(64, 48\)"):
        engine.update_weights(list(bad_shape.items()))
    assert engine.weight_version == 0 and [o[0].token_ids for o in engine.generate(prompts(2), GREEDY)] == before


def test_the_server_refuses_a_bad_expert_push_naming_the_tensor_and_keeps_serving(moe, tmp_path):
    from server_process import running_server

    path, _ = moe
    bad = {**_changed_experts(path), "model.layers.0.mlp.experts.7.up_proj.weight": torch.zeros(48, 64)}
    save_file({n: t.contiguous() for n, t in bad.items()}, str(tmp_path / "model.safetensors"))
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    with running_server(str(path)) as server:
        before = requests.post(server.url + "/generate", json=body, timeout=60).json()
        r = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=60)
        assert r.status_code == 400 and "model.layers.0.mlp.experts.7.up_proj.weight" in r.json()["error"]["message"], r.text
        after = requests.post(server.url + "/generate", json=body, timeout=60).json()
    assert [s["output_ids"] for s in after] == [s["output_ids"] for s in before]
    assert all(s["meta_info"]["weight_version"] == "0" for s in after)


def test_the_bench_shape_of_qwen3_30b_a3b_is_the_real_one():
    from rollout.tools.bench_args import SPEED_SHAPES

    cfg = ModelConfig.from_dict(SPEED_SHAPES["qwen3-30b-a3b"])
    assert cfg.sparse_layers == tuple(range(48)) and (cfg.num_experts, cfg.num_experts_per_tok) == (128, 8)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = total - 48 * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert 30.4e9 < total < 30.6e9 and 3.3e9 < active < 3.4e9  # (A3B: the embedding and LM head are 0.6 B of the 3.3)
