"""One request's state: a prompt, its `n` sample sequences, and what each has produced."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from rollout.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # needs prefill (first time, or recompute after preemption)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecCounters:
    """Speculation bookkeeping for one sequence, or summed over many."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    emitted_tokens: int = 0  # tokens produced by verify steps, bonus included
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, source: str, drafted: int, accepted: int, emitted: int, steps: int = 1) -> None:
        """A verify step's drafts (or `steps` of them, summed)."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += steps
        self.emitted_tokens += emitted
        if drafted:
            src = self.by_source.setdefault(source, {"draft_tokens": 0, "accepted_tokens": 0})
            src["draft_tokens"] += drafted
            src["accepted_tokens"] += accepted

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, bonus token included (1.0 without speculation)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "accept_length": self.accept_length,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_steps": self.verify_steps,
            "by_source": {k: dict(v) for k, v in self.by_source.items()},
        }


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    sample_index: int
    key: int  # sampler RNG key (see rollout.engine.sampler.sequence_key)
    tokens: list[int]  # prompt + output
    num_prompt: int
    status: Status = Status.WAITING
    row: int = -1  # slot-table row (and token-table row) while it holds KV
    group: int = 0  # the n-gram index's line for its prompt while it runs (spec/index.py)
    history_row: int = -1  # the token-table row it was kept in once finished, if it was
    finished_at: float = 0.0  # time.perf_counter() when it finished
    num_cached: int = 0  # tokens whose KV is in the pool; tokens[num_cached:] are this step's input
    forks: list["Sequence"] = field(default_factory=list)  # siblings that take this prefill's KV
    cached_tokens: int = 0  # prompt tokens whose KV it took from its leader's prefill (a fork's), as SGLang reports
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token, if the request asks
    output_counts: dict[int, int] = field(default_factory=dict)  # per output token, kept if the request edits logits
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    finish_message: str | None = None  # why it was aborted, when the engine did it (an overflow)
    matched_stop: int | str | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None  # (set as it finishes: the engine's hot loops read it directly)


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0  # the most likely tokens reported with each output token's logprob
    sequences: list[Sequence] = field(default_factory=list)
    stop_ids: frozenset[int] = field(kw_only=True)  # token ids that end a sample: stop_token_ids, and EOS unless ignored
    max_len: int = field(kw_only=True)  # a sample's tokens, prompt included, when it reaches max_new_tokens

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def detach(self) -> list[Sequence]:
        """Its sequences, let go of: for the last reader of a finished request (nothing steps it
        again). A request and its sequences point at each other, a cycle that only a full
        collection frees, every round's token lists at once, inside whichever step it lands in
        (158 ms of one grpo b512 rollout on an H200). Detached, they are freed by reference
        counting as soon as the caller drops them."""
        sequences, self.sequences = self.sequences, []
        return sequences

    @cached_property
    def edits_logits(self) -> bool:
        """Its logits are edited (SamplingParams.processes_logits): its steps need the host's tokens."""
        return self.params.processes_logits

    @cached_property
    def plain(self) -> bool:
        """No stop strings and no logit edits: a step's tokens can stop it only by a stop id or its length."""
        return not self.params.stop and not self.edits_logits

    @cached_property
    def prompt_token_set(self) -> np.ndarray:
        """The prompt's distinct tokens, sorted (the repetition penalty's)."""
        return np.unique(np.asarray(self.prompt_ids, dtype=np.int64))
