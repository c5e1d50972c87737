"""The default model, served by our engine, against transformers: tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams
from rollout.tools.datasets import chat_prompt_ids

QUESTIONS = [
    "Hi",
    "What is 2+2?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List the first five prime numbers and say why 1 is not one of them.",
    "Translate 'good morning, how are you today?' into French, then into Spanish, then into German.",
    "Write a short Python function that returns the n-th Fibonacci number iteratively, and explain "
    "its time complexity and why recursion without memoization would be slower for large n.",
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def chat_prompts(default_engine):
    return [chat_prompt_ids(default_engine.tokenizer, q) for q in QUESTIONS]


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


@pytest.fixture(scope="module")
def hf_outputs(hf_default, chat_prompts):
    return [hf_greedy(hf_default, p) for p in chat_prompts]


def test_prompts_cover_different_lengths(chat_prompts):
    lengths = sorted(len(p) for p in chat_prompts)
    assert len(set(lengths)) == len(lengths) and lengths[-1] > 2 * lengths[0]


def test_greedy_batched_equals_hf_token_for_token(default_engine, chat_prompts, hf_outputs):
    outs = default_engine.generate(chat_prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    assert [o[0].token_ids for o in outs] == [tokens for tokens, _ in hf_outputs]


def test_greedy_one_by_one_equals_hf_with_logprobs_within_1e4(default_engine, chat_prompts, hf_outputs):
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    for prompt, (tokens, logprobs) in zip(chat_prompts, hf_outputs):
        out = default_engine.generate([prompt], params, return_logprob=True)[0][0]
        assert out.token_ids == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
