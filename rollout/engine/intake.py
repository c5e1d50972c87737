"""Requests into an engine: their prompts' token ids, their params checked against what the engine
can ever run, their seeds, and their `n` sample sequences (the first prefills the prompt for all)."""

from __future__ import annotations

import dataclasses
import itertools
import random

from rollout.config import MAX_TOP_LOGPROBS, EngineConfig, SamplingParams, request_limit
from rollout.engine.sampler import prompt_seed, sequence_key
from rollout.engine.sequence import Request, Sequence


class Intake:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int,
                 kv_tokens: int):
        self.config, self.tokenizer, self.vocab = config, tokenizer, vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len, self.kv_tokens = max_model_len, kv_tokens
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._rids = itertools.count()

    def rid(self) -> str:
        return f"req-{next(self._rids)}"

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab}): {bad[:5]}")
        return ids

    def checked(self, params: SamplingParams, prompt_ids: list[int], top_logprobs_num: int) -> SamplingParams:
        """`params`, checked against what this engine can ever run (ValueError naming the field if not)."""
        vocab = self.vocab
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids must be in [0, {vocab}) (got {bad[0]})")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise ValueError(f"sampling_params.logit_bias keys must be token ids in [0, {vocab}) (got {bad[0]})")
        if not (isinstance(top_logprobs_num, int) and 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}] (got {top_logprobs_num!r})")
        broken = request_limit(len(prompt_ids), params, self.max_model_len, self.config.max_running_seqs, self.kv_tokens)
        if broken is not None:
            raise ValueError(f"{broken[0]}: {broken[1]}")
        if params.top_k >= vocab:  # keeps every token: no truncation at all
            params = dataclasses.replace(params, top_k=-1)
        return params

    def seed(self, params: SamplingParams, prompt_ids: list[int]) -> int:
        """The request's own seed, or under coupled sampling its prompt's (every rollout of a prompt
        draws with the same noise), or a fresh one."""
        if params.seed is not None:
            return params.seed
        if self.config.coupled_sampling:
            return prompt_seed(prompt_ids, self.config.seed)
        return self._rng.getrandbits(63)

    def request(self, prompt_ids: list[int], params: SamplingParams, rid: str, seed: int, return_logprob: bool,
                top_logprobs_num: int) -> Request:
        """The request and its `n` sequences: the first (the leader) prefills, the rest ride as its forks."""
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        req = Request(rid, prompt_ids, params, seed, return_logprob, top_logprobs_num, stop_ids=stop_ids,
                      max_len=len(prompt_ids) + params.max_new_tokens)  # within max_model_len: checked
        for i in range(params.n):
            req.sequences.append(Sequence(next(self._seq_ids), req, i, sequence_key(seed, i), list(prompt_ids),
                                          len(prompt_ids)))
        leader, *forks = req.sequences
        leader.forks = forks
        return req
