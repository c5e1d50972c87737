"""A step's tokens into its sequences, and a finished sequence out as an `Output`.

Each sequence takes what the step emitted for it up to its stop condition (stop tokens, stop
strings, its length), checked token by token only where it could stop in this step, so that
speculation, which emits several tokens at once, never changes the output. The step's
speculation counters are kept on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.engine.detokenizer import final_text
from rollout.engine.sequence import Request, Sequence, SpecCounters
from rollout.engine.step import Emitted

log = logging.getLogger("rollout")


@dataclass
class Output:
    """One sample of one prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    finish_reason: str  # stop | length | abort
    matched_stop: int | str | None
    weight_versions: list[int]
    spec: dict
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV this sample took from its request's prefill (its forks')
    top_logprobs: list[tuple[list[int], list[float]]] | None = field(default=None, repr=False)  # per token, if asked
    finish_message: str | None = None  # why the engine aborted it (a forward that overflowed)


def output(seq: Sequence, tokenizer) -> Output:
    text = final_text(tokenizer, seq.output_ids, seq.matched_stop, seq.request.params)
    return Output(
        token_ids=list(seq.output_ids),
        logprobs=list(seq.logprobs) if seq.request.return_logprob else None,
        text=text,
        finish_reason=seq.finish_reason or "abort",
        matched_stop=seq.matched_stop,
        weight_versions=list(seq.weight_versions),
        spec=seq.spec.as_dict(),
        prompt_tokens=seq.num_prompt,
        cached_tokens=seq.cached_tokens,
        top_logprobs=list(seq.top_logprobs) if seq.request.top_logprobs_num else None,
        finish_message=seq.finish_message,
    )


@dataclass
class SourceStep:
    """A step's verified drafts of one drafter: drafts, accepted, tokens appended, sequences, and the
    sequences whose first draft was accepted."""

    drafted: int = 0
    accepted: int = 0
    appended: int = 0
    sequences: int = 0
    first_accepted: int = 0


class Emitter:
    """`finish(seq, reason, message)`: the engine's end of a sequence (its KV row freed);
    `overflow`: the message a sequence is aborted with when its forward overflowed."""

    def __init__(self, tokenizer, finish: Callable[[Sequence, str, str | None], None], overflow: str):
        self.tokenizer = tokenizer
        self.finish = finish
        self.overflow = overflow
        self.overflowed = 0  # sequences aborted so

    def append(self, e: Emitted, updated: dict, version: int, totals: SpecCounters) -> tuple[int, dict[str, SourceStep]]:
        """Append what a step emitted, up to each sequence's stop condition; a sequence that stopped
        while the step ran takes none. Returns the tokens appended, and each drafter's SourceStep. (Runs for every
        sequence of every step: it is kept lean, and a sequence that cannot stop in this step
        takes its tokens in three list extends.)"""
        if e.overflowed is not None:
            self._abort_overflowed(e, updated)
        if e.single:
            return self._append_single(e, updated, version, totals), {}
        top = e.top
        # the step's totals, recorded once after the loop (a call per sequence costs ~1 us at 512 of them)
        appended_all = plain = plain_appended = 0
        by_source: dict[str, SourceStep] = {}
        for i, (seq, tokens, logprobs, drafted, counted) in enumerate(
                zip(e.seqs, e.tokens, e.logprobs, e.drafted, e.counted)):
            if seq.finish_reason is not None:  # (Sequence.finished, without the call)
                continue
            req = seq.request
            updated[id(req)] = req
            k = len(tokens)
            if req.plain and len(seq.tokens) + k < req.max_len and req.stop_ids.isdisjoint(tokens):
                seq.tokens += tokens
                seq.logprobs += logprobs
                seq.weight_versions += [version] * k
                reason = None
            else:
                k, reason = self._append_checked(seq, tokens, logprobs, version)
            if top is not None:
                seq.top_logprobs.extend(top[i][:k])
            appended_all += k
            if drafted:
                source = e.sources[i]
                seq.spec.record(source, drafted, len(tokens) - 1, k)
                t = by_source.get(source) or by_source.setdefault(source, SourceStep())
                t.drafted += drafted
                t.accepted += len(tokens) - 1
                t.appended += k
                t.sequences += 1
                t.first_accepted += len(tokens) > 1
            elif counted:  # a step without drafts: what SpecCounters.record does for it, inline
                spec = seq.spec
                spec.verify_steps += 1
                spec.emitted_tokens += k
                plain += 1
                plain_appended += k
            if reason is not None:
                self.finish(seq, reason, None)
        totals.verify_steps += plain
        totals.emitted_tokens += plain_appended
        for source, t in by_source.items():
            totals.record(source, t.drafted, t.accepted, t.appended, steps=t.sequences)
        return appended_all, by_source

    def _append_single(self, e: Emitted, updated: dict, version: int, totals: SpecCounters) -> int:
        """`append` for a step of one token a sequence and no drafts (Emitted.single), the common
        step of a large batch: the same work without a list per sequence. A sequence still running
        takes its token (a stop condition ends it after it)."""
        top = e.top
        appended = counted_steps = 0
        for i, (seq, token, logprob, counted) in enumerate(zip(e.seqs, e.tokens, e.logprobs, e.counted)):
            if seq.finish_reason is not None:  # (Sequence.finished, without the call)
                continue
            req = seq.request
            updated[id(req)] = req
            if req.plain and len(seq.tokens) + 1 < req.max_len and token not in req.stop_ids:
                seq.tokens.append(token)
                seq.logprobs.append(logprob)
                seq.weight_versions.append(version)
                reason = None
            else:
                _, reason = self._append_checked(seq, [token], [logprob], version)
            if top is not None:
                seq.top_logprobs.extend(top[i])
            appended += 1
            if counted:  # what SpecCounters.record does for a step without drafts, inline
                spec = seq.spec
                spec.verify_steps += 1
                spec.emitted_tokens += 1
                counted_steps += 1
            if reason is not None:
                self.finish(seq, reason, None)
        totals.verify_steps += counted_steps
        totals.emitted_tokens += counted_steps
        return appended

    def _abort_overflowed(self, e: Emitted, updated: dict) -> None:
        """End every sample of a request one of whose forwards overflowed, its tokens of this step
        dropped: nothing computed from an inf or a NaN is returned (its siblings share its prompt's KV,
        and a trainer takes a group whole)."""
        for i in e.overflowed:
            req = e.seqs[i].request
            updated[id(req)] = req
            if not req.finished:
                log.warning("request %s: %s", req.rid, self.overflow)
            for seq in req.sequences:
                if seq.finish_reason is None:
                    self.overflowed += 1
                    self.finish(seq, "abort", self.overflow)

    def _append_checked(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int) -> tuple[int, str | None]:
        """Append token by token while no stop condition holds: (tokens appended, why it stopped or None)."""
        req = seq.request
        reason, appended = None, 0
        for token, logprob in zip(tokens, logprobs):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.weight_versions.append(version)
            appended += 1
            reason = self._stop_reason(seq, token, req)
            if reason is not None:
                break
        if req.edits_logits:
            counts = seq.output_counts
            for token in tokens[:appended]:
                counts[token] = counts.get(token, 0) + 1
        return appended, reason

    def _stop_reason(self, seq: Sequence, token: int, req: Request) -> str | None:
        if seq.num_output >= req.params.min_new_tokens:
            if token in req.stop_ids:
                seq.matched_stop = token
                return "stop"
            stop = req.params.stop
            if stop:
                window = max(len(s) for s in stop) + 2
                tail = self.tokenizer.decode(seq.output_ids[-window:])
                hit = next((s for s in stop if s in tail), None)
                if hit is not None:
                    seq.matched_stop = hit
                    return "stop"
        if len(seq.tokens) >= req.max_len:
            return "length"
        return None



def overflow_message(dtype) -> str:
    """Why a request whose forward overflowed `dtype` ended (SGLang's abort message)."""
    name = str(dtype).removeprefix("torch.")
    why = f"the forward pass overflowed {name} (an inf or NaN in the hidden state or the logits)"
    if name == "float16":
        return (f"{why}: this model's activations exceed float16's range (65,504); serve it in bfloat16 "
                "(--dtype bfloat16), or push weights that keep it in range. No token of the failed step was returned")
    return f"{why}: its weights may be broken (push sane ones). No token of the failed step was returned"
