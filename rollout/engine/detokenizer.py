"""Token ids to text, in the front end: whole outputs at once, streams a few tokens at a time."""

from __future__ import annotations

from rollout.config import SamplingParams


def final_text(tokenizer, ids: list[int], matched_stop: int | str | None, params: SamplingParams) -> str:
    """The text `Engine.output` gives: the decoded ids, cut before a matched stop string (unless no_stop_trim)."""
    return trim_at_stop(decode(tokenizer, ids, params), matched_stop, params)


def decode(tokenizer, ids: list[int], params: SamplingParams) -> str:
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=params.spaces_between_special_tokens)


def trim_at_stop(text: str, matched_stop: int | str | None, params: SamplingParams) -> str:
    """The text cut before the stop string it matched, unless `no_stop_trim`."""
    if not params.no_stop_trim and isinstance(matched_stop, str) and matched_stop in text:
        return text[: text.find(matched_stop)]
    return text


class StreamDetokenizer:
    """Text deltas for one growing output; joined, they equal `final_text` of the whole.

    Decodes a short window of recent ids per update (no re-decoding of the whole output),
    waits while the tail is an incomplete UTF-8 character, and holds back as many characters
    as a stop string could still claim.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.holdback = 0 if params.no_stop_trim else max((len(s) for s in params.stop), default=1) - 1
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is the context for the next window
        self.read_offset = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` handed out

    def update(self, ids: list[int], finish=None) -> str:
        """The new text after `ids` (the whole output so far); `finish` (its `.matched`: the stop that
        ended it) from the last update."""
        if finish is not None:
            full = final_text(self.tokenizer, ids, finish.matched, self.params)
            delta = full[self.sent :] if full.startswith(self.text[: self.sent]) else ""
            self.sent = len(full)
            return delta
        if len(ids) > self.read_offset:
            prefix = self._decode(ids[self.prefix_offset : self.read_offset])
            window = self._decode(ids[self.prefix_offset :])
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                self.text += window[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        end = max(self.sent, len(self.text) - self.holdback)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.params) if ids else ""
