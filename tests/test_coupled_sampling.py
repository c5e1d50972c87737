"""Coupled sampling: every rollout of a prompt draws sample i with the same noise, and a later
rollout drafts from the earlier one (drafter source `coupled`), losslessly."""

from __future__ import annotations

import random

import pytest
import requests
import torch

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig, SpecConfig
from rollout.models.llama import Linear

SAMPLED = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, ignore_eos=True)


def prompts(num: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(4, 12))] for _ in range(num)]


def rollout(engine: Engine, batch, params=SAMPLED):
    outs = engine.generate(batch, params, return_logprob=True)
    return [[o.token_ids for o in group] for group in outs], [[o.logprobs for o in group] for group in outs]


def test_a_second_coupled_rollout_with_the_same_weights_equals_the_first_and_accepts_every_coupled_draft(model_dir):
    engine = Engine(model=str(model_dir), spec="ngram", device="cpu", coupled_sampling=True, spec_adaptive=False)
    # batch-invariant products, and n-gram drafts as chains (on the GPU these keep the two rollouts alike)
    assert all(m.batch_invariant for m in engine.model.modules() if isinstance(m, Linear)) and engine.model.batch_invariant
    assert engine.spec.draft.cands == 1
    batch = prompts()
    first, _ = rollout(engine, batch)
    engine.reset_stats()
    second, _ = rollout(engine, batch)
    assert second == first
    stats = engine.stats()
    assert stats["rollout/spec_draft_tokens/coupled"] > 0.5 * sum(len(t) for g in first for t in g)
    assert stats["rollout/spec_accept_rate/coupled"] == 1.0


def test_after_a_weight_push_coupled_spec_on_equals_spec_off_with_equal_logprobs(model_dir):
    """fp32 on the CPU: the samples of the second rollout under new weights are spec off's, token for
    token, whether the coupled drafts were accepted or not."""
    off = Engine(model=str(model_dir), spec="off", device="cpu", coupled_sampling=True)
    on = Engine(model=str(model_dir), spec="ngram", device="cpu", coupled_sampling=True, spec_adaptive=False)
    batch = prompts(seed=1)
    assert rollout(off, batch) == rollout(on, batch)
    gen = torch.Generator().manual_seed(7)
    pushed = [(name, t.view() + 0.02 * torch.randn(t.shape, generator=gen))
              for name, t in on.model.weight_targets().items() if name.endswith("mlp.down_proj.weight")]
    for engine in (off, on):
        engine.update_weights(pushed, version=1)
    on.reset_stats()
    (tokens_off, lp_off), (tokens_on, lp_on) = rollout(off, batch), rollout(on, batch)
    assert tokens_on == tokens_off
    for a, b in zip(sum(lp_on, []), sum(lp_off, [])):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    stats = on.stats()
    assert stats["rollout/spec_draft_tokens/coupled"] > 0
    assert 0 < stats["rollout/spec_accept_rate/coupled"] < 1  # the push moved some draws: drafts rejected there


def test_an_explicit_seed_overrides_the_prompts_and_uncoupled_requests_draw_afresh(model_dir):
    coupled = Engine(model=str(model_dir), spec="off", device="cpu", coupled_sampling=True)
    batch = prompts(seed=2)
    derived, _ = rollout(coupled, batch)
    seeded = SamplingParams(**{**SAMPLED.__dict__, "seed": 11})
    explicit, _ = rollout(coupled, batch, seeded)
    assert explicit != derived and rollout(coupled, batch, seeded)[0] == explicit
    uncoupled = Engine(model=str(model_dir), spec="off", device="cpu")
    assert rollout(uncoupled, batch)[0] != rollout(uncoupled, batch)[0]
    assert rollout(uncoupled, batch, seeded)[0] == explicit  # an explicit seed draws the same in any engine


def test_the_server_reports_coupled_drafts_by_source_in_meta_info_and_metrics(model_dir):
    from server_process import running_server

    body = {"input_ids": [5, 9, 13, 17], "sampling_params": {"n": 4, "max_new_tokens": 24, "ignore_eos": True}}
    with running_server(str(model_dir), "--spec", "ngram", "--coupled-sampling", "--spec-no-adaptive") as server:
        first = requests.post(server.url + "/generate", json=body, timeout=60).json()
        second = requests.post(server.url + "/generate", json=body, timeout=60).json()
        metrics = requests.get(server.url + "/metrics", timeout=30).text
    assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first]
    by_source = second[0]["meta_info"]["spec_by_source"]
    assert by_source["coupled"]["accepted_tokens"] == by_source["coupled"]["draft_tokens"] > 0
    assert 'rollout_spec_draft_tokens_by_source{source="coupled"}' in metrics


def test_coupled_sampling_verifies_chains():
    """A head's tree would put a node beside its siblings, not at its position (the n-gram index
    drafts one continuation under coupled sampling for the same reason)."""
    with pytest.raises(ValueError, match="chains"):
        EngineConfig(coupled_sampling=True, spec=SpecConfig(method="mtp", head_topk=2))
    EngineConfig(coupled_sampling=True, spec=SpecConfig(method="ngram", head_topk=2))
