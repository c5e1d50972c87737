"""A mixture-of-experts model on a CUDA GPU: its experts inside the decode step's CUDA graphs. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from rollout import Engine, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[5 + k, 9, 13 + 2 * k, 7, 11 + k] * 3 for k in range(6)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe-gpu")
    return path, make_tiny_model("qwen3_moe", path)


def test_moe_in_cuda_graphs_equals_eager_and_hf_greedy_in_float32(moe):
    path, hf = moe
    params = SamplingParams(temperature=0, max_new_tokens=24)
    make = lambda **kw: Engine(model=str(path), device="cuda", dtype="float32", kv_cache_tokens=20_000, **kw)  # noqa: E731
    graphs = [o[0].token_ids for o in make(spec="ngram").generate(PROMPTS, params)]
    eager = [o[0].token_ids for o in make(spec="off", cuda_graphs=False).generate(PROMPTS, params)]
    ids = [torch.tensor([p]) for p in PROMPTS]
    expected = [hf.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=24, do_sample=False)[0, i.shape[1]:].tolist()
                for i in ids]
    assert graphs == eager == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_moe_in_half_precision_gives_finite_logprobs(moe, dtype):
    path, _ = moe
    engine = Engine(model=str(path), device="cuda", dtype=dtype, spec="ngram", kv_cache_tokens=20_000)
    outs = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=2), return_logprob=True)
    assert all(o.finish_reason in ("stop", "length") and torch.isfinite(torch.tensor(o.logprobs)).all() for g in outs for o in g)


def test_the_picks_summed_by_the_norm_give_the_combines_tokens_and_logprobs(moe, monkeypatch):
    """A decoder layer's experts leave each row's picks for the next residual add + norm to sum (`into_sum`),
    in graphs, with speculation: bf16's sampled tokens and logprobs those of the combine kernel's output."""
    from kernels import fused_moe

    path, _ = moe
    layer, asked = fused_moe.layer, []

    def sampled(picks: bool) -> list:
        def moe_layer(*args, into_sum: bool, **kwargs):  # (what the model asks, then what this run takes)
            asked.append(into_sum)
            return layer(*args, into_sum=picks, **kwargs)

        monkeypatch.setattr(fused_moe, "layer", moe_layer)
        engine = Engine(model=str(path), device="cuda", dtype="bfloat16", spec="ngram", kv_cache_tokens=20_000)
        try:
            outs = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=4),
                                   return_logprob=True)
        finally:
            engine.close()
        return [(o.token_ids, o.logprobs) for g in outs for o in g]

    assert sampled(picks=True) == sampled(picks=False)
    assert asked and all(asked)  # (every layer asked for its picks: one rank)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_moe_over_two_gpus_in_graphs_with_speculation_gives_one_gpus_eager_tokens(moe):
    """Each rank's share of every expert's width, its part summed by the layer's all-reduce, in the captured graphs."""
    path, _ = moe
    params = SamplingParams(temperature=0, max_new_tokens=24)

    def tokens(**kw) -> list[list[int]]:
        engine = Engine(model=str(path), device="cuda", dtype="float32", kv_cache_tokens=20_000, **kw)
        try:
            return [o[0].token_ids for o in engine.generate(PROMPTS, params)]
        finally:
            engine.close()

    assert tokens(spec="ngram", tp_size=2) == tokens(spec="off", cuda_graphs=False)
