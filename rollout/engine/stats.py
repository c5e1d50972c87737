"""What an engine counts between `reset()`s: tokens, busy time, steps (the latest in a log), and
speculation's totals, overall and by drafter (the `rollout/...` names of `Engine.stats()`, W&B and
/metrics)."""

from __future__ import annotations

from collections import deque

from rollout.engine.sequence import SpecCounters
from rollout.engine.step import StepRecord

STEP_LOG = 1 << 16  # steps the log keeps (a server runs for days: it must not grow)


class EngineStats:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.spec = SpecCounters()
        self.output_tokens = 0
        self.busy_s = 0.0
        self.draft_steps = 0  # steps that verified drafts
        self.steps = 0
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)  # the latest steps, for profiles

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of stepping."""
        return self.output_tokens / self.busy_s if self.busy_s else 0.0

    def counts(self) -> dict:
        """The counters as `rollout/...` names: speculation's totals (by drafter too), tokens, steps."""
        t = self.spec
        out = {
            "rollout/spec_accept_rate": t.accepted_tokens / t.draft_tokens if t.draft_tokens else 0.0,
            "rollout/spec_accept_length": t.accept_length,
            "rollout/spec_draft_tokens": t.draft_tokens,
            "rollout/spec_accepted_tokens": t.accepted_tokens,
            "rollout/spec_verify_steps": t.verify_steps,
            "rollout/spec_emitted_tokens": t.emitted_tokens,
            "rollout/tokens_per_s": self.tokens_per_s,
            "rollout/output_tokens": self.output_tokens,
            "rollout/steps": self.steps,
            "rollout/draft_steps": self.draft_steps,
        }
        for source, c in t.by_source.items():
            out[f"rollout/spec_draft_tokens/{source}"] = c["draft_tokens"]
            out[f"rollout/spec_accepted_tokens/{source}"] = c["accepted_tokens"]
            out[f"rollout/spec_accept_rate/{source}"] = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0
        return out
