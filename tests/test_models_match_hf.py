"""Our decoder against transformers, on random-weight models of every supported architecture."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import CONFIGS, make_tiny_model

from rollout import Engine, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, path)
    return hf, Engine(model=str(path), spec="off", device="cpu")


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(num)]


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def test_greedy_matches_hf_token_for_token_batched_and_alone(tiny):
    hf, eng = tiny
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    ps = prompts(8)
    batched = eng.generate(ps, params)
    for p, out in zip(ps, batched):
        alone = eng.generate([p], params)[0][0]
        expected, _ = hf_greedy(hf, p)
        assert out[0].token_ids == expected
        assert alone.token_ids == expected


def test_logprobs_match_hf_log_softmax(tiny):
    hf, eng = tiny
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    for p in prompts(3, seed=1):
        out = eng.generate([p], params, return_logprob=True)[0][0]
        tokens, logprobs = hf_greedy(hf, p)
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
