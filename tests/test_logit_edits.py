"""Penalties, logit bias, min_new_tokens and top logprobs: held to their per-token definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, make_tiny_model

from rollout import Engine, SamplingParams, SpecConfig
from rollout.engine.logits_processing import logit_edits, reference_logits
from rollout.engine.sampler import sequence_key
from rollout.engine.sequence import Request, Sequence

EDITS = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.2),
    "repetition": dict(repetition_penalty=1.7),
    "bias": dict(logit_bias={3: 5.0, 7: -100.0, 11: 2.5}),
    "min_new_tokens": dict(min_new_tokens=20, stop_token_ids=[5, 6]),
    "all": dict(frequency_penalty=0.4, presence_penalty=0.9, repetition_penalty=0.6, logit_bias={4: 1.0},
                min_new_tokens=20, stop_token_ids=[9]),
}  # fmt: skip


def _sequence(params: SamplingParams, rng: np.random.Generator, vocab: int) -> Sequence:
    prompt = rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist()
    req = Request("r", prompt, params, 0, stop_ids=frozenset(params.stop_token_ids) | {2}, max_len=10_000)
    seq = Sequence(0, req, 0, sequence_key(0, 0), list(prompt), len(prompt))
    for t in rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist():  # repeats on purpose: vocab is small
        seq.tokens.append(t)
        seq.output_counts[t] = seq.output_counts.get(t, 0) + 1
    return seq


@pytest.mark.parametrize("name", list(EDITS))
def test_logit_edits_match_the_per_token_definition(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    vocab = 64
    for _ in range(20):
        seqs = [_sequence(SamplingParams(**EDITS[name]), rng, vocab) for _ in range(3)]
        paths = [rng.integers(0, vocab, size=int(rng.integers(0, 5))).tolist() for _ in seqs]  # drafts above the draw
        logits = torch.randn(len(seqs), vocab) * 4  # both signs: the repetition penalty treats them differently
        edits = logit_edits(seqs, paths)
        got = edits.to(torch.device("cpu")).apply(logits.clone())
        want = torch.stack([reference_logits(logits[i], s, p) for i, (s, p) in enumerate(zip(seqs, paths))])
        torch.testing.assert_close(got, want)


def test_no_edits_when_no_request_asks_for_any():
    rng = np.random.default_rng(0)
    assert logit_edits([_sequence(SamplingParams(), rng, 64)], [[]]) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_tiny_model("llama", path)
    return path, hf


PROMPT = [5, 9, 13, 5, 9, 13, 5, 9, 13, 21]


def _reference_greedy(hf, params: SamplingParams, n_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with HF transformers, each step's logits edited by the definition."""
    req = Request("ref", PROMPT, params, 0, stop_ids=frozenset(params.stop_token_ids), max_len=10_000)
    seq = Sequence(0, req, 0, 0, list(PROMPT), len(PROMPT))
    tokens, logprobs = [], []
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([seq.tokens])).logits[0, -1].float()
        z = reference_logits(logits, seq)
        t = int(z.argmax())
        tokens.append(t)
        logprobs.append(float(torch.log_softmax(z.double(), -1)[t]))
        seq.tokens.append(t)
        seq.output_counts[t] = seq.output_counts.get(t, 0) + 1
    return tokens, logprobs


@pytest.mark.parametrize("name", ["frequency", "presence", "repetition", "bias", "all"])
def test_penalized_greedy_decoding_equals_hf_with_the_definition_with_and_without_speculation(tiny, name):
    path, hf = tiny
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, **EDITS[name])
    want_tokens, want_logprobs = _reference_greedy(hf, params, 24)
    plain = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    assert _reference_greedy(hf, plain, 24)[0] != want_tokens  # the edit changes the output
    for spec in ("off", SpecConfig(method="ngram", adaptive=False)):
        eng = Engine(model=str(path), device="cpu", spec=spec)
        for _ in range(2):  # the second time, the first is history: its drafts are accepted
            out = eng.generate([PROMPT], params, return_logprob=True)[0][0]
            assert out.token_ids == want_tokens, spec
            assert out.logprobs == pytest.approx(want_logprobs, abs=1e-4)
        if spec != "off":  # verification drew from the edited distribution, drafts included
            assert eng.stats()["rollout/spec_accepted_tokens"] > 10


def test_sampled_penalized_outputs_are_the_same_with_and_without_speculation(tiny):
    path, _ = tiny
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=40, seed=3, ignore_eos=True,
                            frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={7: 3.0})
    outs = {}
    for spec in ("off", SpecConfig(method="ngram", adaptive=False)):
        eng = Engine(model=str(path), device="cpu", spec=spec)
        outs[str(spec)] = eng.generate([PROMPT], params, return_logprob=True)[0]
    off, on = outs.values()
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_min_new_tokens_bans_stopping_until_then(tiny):
    path, _ = tiny
    eng = Engine(model=str(path), device="cpu", spec="off")
    free = eng.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))[0][0].token_ids
    stop = free[2]  # greedy would stop here
    params = dict(temperature=0, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    early = eng.generate([PROMPT], SamplingParams(**params))[0][0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 3
    held = eng.generate([PROMPT], SamplingParams(**params, min_new_tokens=8), return_logprob=True)[0][0]
    assert stop not in held.token_ids[:8] and len(held.token_ids) >= 8


def test_top_logprobs_are_the_processed_distributions_most_likely_tokens(tiny):
    path, hf = tiny
    eng = Engine(model=str(path), device="cpu", spec="off")
    params = SamplingParams(temperature=0.7, max_new_tokens=6, seed=1, ignore_eos=True, presence_penalty=0.5)
    req = eng.add_request(PROMPT, params, return_logprob=True, top_logprobs_num=4)
    while not req.finished:
        eng.step()
    out = eng.output(req.sequences[0])
    seq = Sequence(0, req, 0, 0, list(PROMPT), len(PROMPT))
    for token, logprob, (ids, values) in zip(out.token_ids, out.logprobs, out.top_logprobs):
        with torch.no_grad():
            logits = hf(torch.tensor([seq.tokens])).logits[0, -1].float()
        want = torch.log_softmax(reference_logits(logits, seq).double() / 0.7, -1)
        top = want.topk(4)
        assert ids == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-4)
        assert logprob == pytest.approx(float(want[token]), abs=1e-4)
        seq.tokens.append(token)
        seq.output_counts[token] = seq.output_counts.get(token, 0) + 1
    assert len(out.top_logprobs) == len(out.token_ids) == 6


def test_requests_the_engine_can_never_run_are_refused_by_name(tiny):
    path, _ = tiny
    eng = Engine(model=str(path), device="cpu", spec="off", max_running_seqs=8)
    for params, needle in [
        (SamplingParams(n=9), "max-running-seqs"),
        (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (SamplingParams(logit_bias={VOCAB + 3: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=needle):
            eng.add_request(PROMPT, params)
    huge_k = eng.add_request(PROMPT, SamplingParams(top_k=2**62, max_new_tokens=2))  # keeps everything: no truncation
    assert huge_k.params.top_k == -1
    while eng.has_work:
        eng.step()


def test_a_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-30).temperature == 0.0
    assert SamplingParams(temperature=1e-3).temperature == 1e-3
