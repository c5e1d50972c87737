"""A step's tokens into its sequences (rollout/engine/emit.py): a step of one token a sequence
(`Emitted.single`, the common step of a large batch) appends exactly what the same step as lists
appends, whatever ends a sequence."""

from __future__ import annotations

import copy
import random

from rollout import SamplingParams
from rollout.engine.emit import Emitter
from rollout.engine.sequence import Request, Sequence, SpecCounters
from rollout.engine.step import Emitted

PROMPT = [3, 4, 5]


class SpacedIds:
    """Text as the ids' decimal forms with spaces (stop strings need a tokenizer's decode)."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def requests() -> list[Request]:
    """One request for each way a sample can end, or not, in a few steps."""
    kinds = [SamplingParams(max_new_tokens=50), SamplingParams(max_new_tokens=3),
             SamplingParams(max_new_tokens=50, stop_token_ids=[7]),
             SamplingParams(max_new_tokens=50, stop_token_ids=[7], min_new_tokens=4),
             SamplingParams(max_new_tokens=50, stop=["8 9"]), SamplingParams(max_new_tokens=50, repetition_penalty=1.2)]
    reqs = []
    for i, params in enumerate(kinds):
        req = Request(f"r{i}", PROMPT, params, seed=i, return_logprob=True, top_logprobs_num=i % 2,
                      stop_ids=frozenset(params.stop_token_ids or ()), max_len=len(PROMPT) + params.max_new_tokens)
        req.sequences = [Sequence(10 * i + j, req, j, key=j, tokens=list(PROMPT), num_prompt=len(PROMPT))
                         for j in range(2)]
        reqs.append(req)
    return reqs


def test_a_single_token_step_appends_what_the_same_step_as_lists_appends():
    rng = random.Random(0)
    finished: list[tuple[int, int, str]] = []

    def finisher(side: int):
        def finish(seq: Sequence, reason: str, message: str | None) -> None:  # (the engine's: the row freed too)
            seq.finish_reason = reason
            finished.append((side, seq.seq_id, reason))
        return finish

    singles, lists = requests(), requests()
    emitters = [Emitter(SpacedIds(), finisher(side), "overflow") for side in range(2)]
    totals = [SpecCounters(), SpecCounters()]
    for step in range(8):
        seqs = [[q for r in reqs for q in r.sequences] for reqs in (singles, lists)]
        tokens = [rng.choice([7, 8, 9, 11, 12]) for _ in seqs[0]]
        logprobs = [-rng.random() for _ in seqs[0]]
        counted = [step > 0 or i % 3 > 0 for i in range(len(seqs[0]))]  # (step 0: some are a prefill's first token)
        top = [[([t, 1], [lp, -3.0])] for t, lp in zip(tokens, logprobs)]
        single = Emitted(seqs[0], tokens, logprobs, counted, [0] * len(tokens), top=copy.deepcopy(top), single=True)
        as_lists = Emitted(seqs[1], [[t] for t in tokens], [[lp] for lp in logprobs], counted, [0] * len(tokens),
                           sources=["ngram"] * len(tokens), top=top)
        got = [emitters[0].append(single, {}, step, totals[0]), emitters[1].append(as_lists, {}, step, totals[1])]
        assert got[0] == got[1]
    assert [(q, reason) for s, q, reason in finished if s == 0] == [(q, reason) for s, q, reason in finished if s == 1]
    assert {reason for _, _, reason in finished} == {"stop", "length"}
    assert totals[0] == totals[1] and totals[0].verify_steps > 0
    fields = ("tokens", "logprobs", "weight_versions", "top_logprobs", "output_counts", "finish_reason", "matched_stop",
              "spec")
    for a, b in zip((q for r in singles for q in r.sequences), (q for r in lists for q in r.sequences)):
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], a.seq_id
