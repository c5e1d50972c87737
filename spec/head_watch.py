"""Whether a learned head's drafts are worth verifying under the target's current weights.

A head is trained for one version of the target. After the trainer pushes new weights its
drafts may stop matching what the target emits: the weakness of learned drafters in RL, and
why the n-gram index (which depends on no weights) exists. The watch counts, per weight
version, the head's verified chains and those whose first draft was accepted (a rate that does
not depend on how deep the chains are or how many of their drafts the budget verifies):

- once `MIN_CHAINS` chains of a version were verified and fewer than `min_accept` of them had
  their first draft accepted, the head is switched off for that version (it goes to sleep:
  spec/speculator.py);
- while it is off, the head's wake-ups are probes: their chains are verified whatever the
  budget's estimates, and it is switched on again once `MIN_CHAINS` probed chains of this
  version had their first drafts accepted at `min_accept` or more;
- a push that includes the head's own weights switches it on at once, with fresh counts.

Every transition is logged and counted (`stats`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("rollout.spec")

MIN_CHAINS = 64  # verified chains of a version before its rate decides anything


@dataclass
class HeadWatch:
    min_accept: float  # the share of chains whose first draft is accepted below which the head is switched off
    version: int = 0  # the weight version the counts are of
    on: bool = True
    chains: int = 0  # the head's verified chains under `version` (while on, or in probes)
    hits: int = 0  # ... those whose first draft was accepted
    switched_off: int = 0
    switched_on: int = 0
    transitions: list[str] = field(default_factory=list)

    def observe(self, chains: int, hits: int) -> None:
        """A step verified `chains` of the head's chains; `hits` had their first draft accepted."""
        self.chains += chains
        self.hits += hits
        if self.chains < MIN_CHAINS:
            return
        rate = self.hits / self.chains
        if self.on and rate < self.min_accept:
            self._switch(False, f"its first drafts accepted {rate:.2f} under weight version {self.version}")
        elif not self.on and rate >= self.min_accept:
            self._switch(True, f"probes' first drafts accepted {rate:.2f} under weight version {self.version}")

    def on_weights(self, version: int, head_pushed: bool) -> None:
        """The target's weights changed to `version`; `head_pushed`: the head's weights came with them."""
        self.version, self.chains, self.hits = version, 0, 0
        if head_pushed and not self.on:
            self._switch(True, f"its weights were pushed with version {version}")

    def _switch(self, on: bool, why: str) -> None:
        self.on = on
        self.chains = self.hits = 0
        if on:
            self.switched_on += 1
        else:
            self.switched_off += 1
        line = f"draft head switched {'on' if on else 'off'}: {why}"
        self.transitions.append(line)
        log.info(line)

    def stats(self) -> dict:
        return {
            "rollout/spec_head_on": float(self.on),
            "rollout/spec_head_switched_off": self.switched_off,
            "rollout/spec_head_switched_on": self.switched_on,
            "rollout/spec_head_version_first_accept": self.hits / self.chains if self.chains else 0.0,
        }


IDLE_STEPS = 128  # decode steps the head stays awake with none of its chains verified, once the budget is informed
INFORMED_AFTER = 3  # evaluations of trees since it woke before the budget's choice counts (spec/budget.py)
SLEEP_STEPS = 1024  # decode steps it sleeps before an admission of new prompts wakes it (a probe) ...
MAX_DOUBLINGS = 4  # ... doubled after each wake-up in which it never paid, up to 16x
PAY_WINDOW = 128  # informed decode steps awake over which its tokens are weighed against its time, at most ...
PAY_TOKENS = 4096  # ... or fewer once they emitted this many tokens (512 sequences do in 4-8 steps) ...
MIN_PAY_STEPS = 16  # ... but at least this many


@dataclass
class _Window:
    """Informed decode steps awake since the head last woke or was last weighed."""

    steps: int = 0
    seconds: float = 0.0
    head_seconds: float = 0.0  # of them, its pass's and trees' (HeadCycle.costs)
    tokens: int = 0
    head_tokens: int = 0  # of them, its accepted drafts


@dataclass
class HeadCycle:
    """Whether a head runs at all. Its pass over each step's rows, which its KV needs whether it
    drafts or not, cost 0.17 ms of a 0.8 ms step at b1 and 0.2-0.3 ms at 512 sequences on the
    H200, where the budget verified none of its chains (rl at T=1.0: the hybrid 0.87x of spec off
    against the index's 0.97x). So a head goes to sleep (no pass, and the running sequences, whose
    head KV falls behind, draft no trees again) when

    - it is not verified for IDLE_STEPS decode steps;
    - over a pay window (PAY_WINDOW decode steps, fewer at a large batch: below), its accepted
      drafts are a smaller share of the tokens emitted than its work is of the steps' time
      (`costs`: the seconds its pass adds to a step, and its tree to a drafting step, per batch
      bucket, timed on the captured graphs; none without graphs). Asleep, the steps would emit
      the tokens less its drafts in the time less its work: more per second exactly then. At
      ShareGPT b1 the hybrid's head was verified where the index had nothing, so it never
      idled, and its pass and trees cost the steps 18% for 8% more tokens (2.20x of spec off
      against the index's 2.65x on the H100);
    - the watch switches it off.

    It wakes before an admission of new prompts (their prompts give it their KV) once it slept
    SLEEP_STEPS steps, or at the next admission after a push of its weights. A wake-up is a
    probe that costs its window's steps: at grpo b512 the hybrid lost to the index alone in the
    first window of each wake-up (its decode steps 550 ms against 370 in a rollout of 256
    tokens). So a window closes after PAY_TOKENS tokens where a large batch emits them in a few
    steps, and each wake-up in which the head never paid doubles the sleep before the next.

    Idle and paying steps count only once the budget has evaluated trees INFORMED_AFTER times
    since the head woke: before that its estimates are borrowed or still rising from nothing, and
    it verifies nothing whether the head pays or not (ShareGPT b1 on the H200: the head alone
    fell asleep in its first rollout, drafted in none of the runs, and ran 0.94x of spec off)."""

    awake: bool = True
    idle: int = 0  # decode steps awake since its chains were last verified (once informed)
    evaluations: int = 0  # the budget's evaluations of trees since it woke
    asleep: int = 0  # decode steps asleep
    wake_next: bool = False  # its weights were pushed: the next admission wakes it
    sleeps: int = 0
    unpaid: int = 0  # wake-ups in a row that ended with no window paying
    paid: bool = False  # a window paid since it last woke
    costs: dict[int, tuple[float, float]] | None = None  # bucket -> seconds of (its pass, its tree)
    window: _Window = field(default_factory=_Window)
    last_shares: tuple[float, float] | None = None  # (its tokens, its time) over the last whole window
    _offs: int = 0  # the watch's switch-offs when it last woke

    def step(self, watch_offs: int) -> bool:
        """Plan one decode step (`watch_offs`: HeadWatch.switched_off): whether the head runs in it."""
        if self.awake:
            self.idle += self.evaluations >= INFORMED_AFTER
            if self.idle > IDLE_STEPS:
                self._sleep(f"none of its chains verified in {IDLE_STEPS} steps")
            elif watch_offs > self._offs:
                self._sleep("switched off by its watch")
        else:
            self.asleep += 1
        return self.awake

    def ran(self, b: int, tree: bool, seconds: float, tokens: int, head_tokens: int) -> None:
        """A decode step of bucket b in which the head ran (`tree`: and made the next step's trees)
        took `seconds` and emitted `tokens`, `head_tokens` of them its accepted drafts."""
        if not self.costs or not self.awake or self.evaluations < INFORMED_AFTER:
            return
        pass_s, tree_s = self.costs[min(self.costs, key=lambda k: abs(k - b))]
        w = self.window
        w.steps += 1
        w.seconds += seconds
        w.head_seconds += pass_s + tree_s * tree
        w.tokens += tokens
        w.head_tokens += head_tokens
        if w.steps < PAY_WINDOW and (w.steps < MIN_PAY_STEPS or w.tokens < PAY_TOKENS):
            return
        self.last_shares = (w.head_tokens / max(w.tokens, 1), w.head_seconds / max(w.seconds, 1e-9))
        self.window = _Window()
        if self.last_shares[0] < self.last_shares[1]:
            self._sleep("its drafts were {:.1%} of the tokens for {:.1%} of the steps' time".format(*self.last_shares))
        else:
            self.paid = True

    @property
    def sleep_steps(self) -> int:
        """How long its current (or next) sleep lasts: SLEEP_STEPS, doubled for each wake-up in a
        row but the first that never paid."""
        return SLEEP_STEPS << min(max(self.unpaid - 1, 0), MAX_DOUBLINGS)

    def head_pushed(self) -> None:
        """Its weights were pushed: it wakes at the next admission, and its past probes no longer count."""
        self.wake_next, self.unpaid = True, 0

    def verified(self) -> None:
        self.idle = 0

    def evaluated(self) -> None:
        self.evaluations += 1

    def admit(self, watch_offs: int) -> bool:
        """New prompts are about to be admitted: whether the head runs over them (and so drafts for them)."""
        if not self.awake and (self.wake_next or self.asleep >= self.sleep_steps):
            self.awake, self.idle, self.evaluations, self.wake_next, self._offs = True, 0, 0, False, watch_offs
            self.window, self.paid = _Window(), False
            log.info("draft head awake for the prompts admitted now")
        return self.awake

    def _sleep(self, why: str) -> None:
        self.awake, self.asleep = False, 0
        self.sleeps += 1
        self.unpaid = 0 if self.paid else self.unpaid + 1
        log.info("draft head asleep for %d steps: %s", self.sleep_steps, why)

    def stats(self) -> dict:
        out = {"rollout/spec_head_awake": float(self.awake), "rollout/spec_head_sleeps": self.sleeps,
               "rollout/spec_head_sleep_steps": self.sleep_steps}
        if self.last_shares is not None:
            out["rollout/spec_head_token_share"], out["rollout/spec_head_time_share"] = self.last_shares
        return out
