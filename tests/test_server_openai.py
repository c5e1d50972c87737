"""The official `openai` client against `rollout serve` on the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import openai
import pytest
import requests
from server_process import running_server
from transformers import AutoTokenizer

from rollout.tools.datasets import chat_prompt_ids

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(default_model_dir):
    with running_server(str(default_model_dir), "--served-model-name", "smol", "--kv-cache-tokens", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_completion_uses_the_chat_template_and_reports_usage(client, server, default_model_dir):
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0, logprobs=True
    )
    choice = r.choices[0]
    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(default_model_dir), QUESTION)
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "return_logprob": True}
    expected = requests.post(server.url + "/generate", json=body, timeout=120).json()
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert choice.finish_reason == expected["meta_info"]["finish_reason"]["type"]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(expected["output_ids"])
    # the second request may verify drafts remembered from the first: same tokens, logprobs to float rounding
    expected_logprobs = [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]]
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(expected_logprobs, abs=1e-5)
    assert r.model == "smol" and r.object == "chat.completion"


def test_chat_streaming_joins_up_to_the_non_streamed_answer(client):
    kw = dict(model="smol", messages=[{"role": "user", "content": QUESTION}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens >= 1


def test_completion_with_n_and_logprobs(client):
    r = client.completions.create(model="smol", prompt=["The sky is", "One, two,"], max_tokens=5, n=2, seed=3, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) >= 1
        assert "".join(c.logprobs.tokens).startswith(c.text) or c.finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_top_logprobs_are_the_most_likely_tokens_with_the_sampled_one_among_them_when_greedy(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count: one, two,"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for tok in content:
        assert len(tok.top_logprobs) == 2
        first, second = tok.top_logprobs
        assert first.logprob >= second.logprob
        assert first.token == tok.token and first.logprob == pytest.approx(tok.logprob, abs=1e-5)  # greedy: the argmax


def test_completion_logprobs_k_gives_k_alternatives_per_token(client):
    r = client.completions.create(model="smol", prompt="The sky is", max_tokens=4, logprobs=3, seed=1)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) >= 1
    for top, token_logprob in zip(lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 3  # (distinct strings: two ids may decode alike)
        assert max(top.values()) >= token_logprob - 1e-5


def test_models_lists_the_served_name_and_bad_requests_get_400(client):
    assert [m.id for m in client.models.list().data] == ["smol"]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smol", prompt="hi", max_tokens=10**9)
