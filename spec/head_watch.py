"""Whether a learned head's drafts are worth verifying under the target's current weights.

A head is trained for one version of the target. After the trainer pushes new weights its
drafts may stop matching what the target emits: the weakness of learned drafters in RL, and
why the n-gram index (which depends on no weights) exists. The watch counts, per weight
version, the head's verified chains and those whose first draft was accepted (a rate that does
not depend on how deep the chains are or how many of their drafts the budget verifies):

- once `MIN_CHAINS` chains of a version were verified and fewer than `min_accept` of them had
  their first draft accepted, the head is switched off for that version: its chains are masked on the
  device (spec/eagle.py), so a hybrid drafts from the n-gram index alone and `--spec eagle`
  decodes plainly;
- while it is off, every `PROBE_EVERY` decode steps the head drafts for `PROBE_STEPS` steps
  (they verify at least the fewest draft rows), and it is switched on again once the probes
  of this version had their first drafts accepted at `min_accept` or more (`MIN_CHAINS` of them);
- a push that includes the head's own weights switches it on at once, with fresh counts.

Every transition is logged and counted (`stats`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("rollout.spec")

MIN_CHAINS = 64  # verified chains of a version before its rate decides anything
PROBE_EVERY = 256  # decode steps between probes while the head is off
PROBE_STEPS = 4  # decode steps a probe lasts (the first leaves the chains the others verify)


@dataclass
class HeadWatch:
    min_accept: float  # the share of chains whose first draft is accepted below which the head is switched off
    version: int = 0  # the weight version the counts are of
    on: bool = True
    chains: int = 0  # the head's verified chains under `version` (while on, or in probes)
    hits: int = 0  # ... those whose first draft was accepted
    switched_off: int = 0
    switched_on: int = 0
    _steps_off: int = 0  # decode steps since the head was switched off or last probed
    transitions: list[str] = field(default_factory=list)

    def active(self) -> bool:
        """Plan one decode step: whether the head drafts in it (on, or probing while off)."""
        if self.on:
            return True
        self._steps_off += 1
        return self.probing

    @property
    def probing(self) -> bool:
        """Off, and in the last PROBE_STEPS of each PROBE_EVERY steps since it was switched off."""
        return not self.on and (self._steps_off - 1) % PROBE_EVERY >= PROBE_EVERY - PROBE_STEPS

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
        self.chains = self.hits = self._steps_off = 0
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
