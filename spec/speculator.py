"""Speculation as the engine sees it: one object for the index, the drafter, the budget, the numbers.

    spec = Speculator(config.spec, token_table)
    spec.join(seq) / spec.leave(seq, keep)       a sequence starts or stops running
    plan = spec.plan(num_seqs, free_slots)       this step's width (0: plain decoding), drafting, shadow
    ... the step runs (ModelRunner.launch_decode(batch, plan.width, plan.drafting, plan.shadow)) ...
    spec.observe(seqs, root_lens, trees, width, device_s, host_s)   once collected, before its tokens are appended
    spec.stats()

Drafting itself happens on the device inside the step (kernels/ngram_draft.py, over the token
table and the index's scan lines), so nothing here runs per token. `observe` keeps the trees
that came back and, once their sequences have emitted the tokens after each root, scores them
for the budget (spec/budget.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from rollout.config import SpecConfig
from rollout.engine.sequence import Sequence
from rollout.engine.step import DraftSettings
from rollout.engine.token_table import TokenTable
from spec.budget import DraftBudget, StepPlan
from spec.index import NgramIndex

SCAN_WIDTH = 32  # rows of its group a sequence searches besides its own: live samples, then history
CANDIDATES = 8  # continuations a tree is built from (the most recent of the longest matches)


@dataclass(eq=False)
class _Trees:
    """Trees that came back from a step, waiting for the tokens they guessed."""

    seqs: list[Sequence]
    roots: np.ndarray  # [S]: each sequence's length when the tree was drafted (its root is the last token)
    tokens: np.ndarray  # [S, N]
    parents: np.ndarray  # [S, N]
    age: int = 0


class Speculator:
    def __init__(self, cfg: SpecConfig, table: TokenTable):
        self.enabled = cfg.enabled
        self.depth = cfg.max_draft_tokens
        self.budget = DraftBudget(cfg.max_draft_tokens, cfg.max_verify_tokens, cfg.adaptive)
        self.index = NgramIndex(table, SCAN_WIDTH, cfg.history_per_prompt, cfg.share_siblings)
        self.draft = DraftSettings(cfg.max_match, cfg.min_match, CANDIDATES, self.depth, self.index.scan) if self.enabled else None
        self._waiting: deque[_Trees] = deque()
        self._widths: dict[int, int] = {}  # width -> steps

    def join(self, seq: Sequence) -> None:
        if self.enabled:
            self.index.join(seq)

    def leave(self, seq: Sequence, keep: bool) -> None:
        if self.enabled:
            self.index.leave(seq, keep)

    def plan(self, num_seqs: int, free_slots: int) -> StepPlan:
        if not self.enabled:
            return StepPlan(0, False, False)
        plan = self.budget.plan(num_seqs, free_slots)
        self._widths[plan.width] = self._widths.get(plan.width, 0) + 1
        return plan

    def observe(self, seqs: list[Sequence], roots: np.ndarray | None, trees: tuple[np.ndarray, np.ndarray] | None,
                width: int, device_s: float, host_s: float) -> None:
        """A decode or verify step was collected (before its tokens are appended: `roots` are the
        sequences' lengths then): its device time, and the host's time for it; `trees`: the
        drafter's, if they came back."""
        if not self.enabled:
            return
        self.budget.observe_step(len(seqs), width, device_s, host_s)
        if trees is not None:
            self._waiting.append(_Trees(seqs, roots, *trees))
        while self._waiting and self._waiting[0].age > self.depth:  # the tokens after every root are known
            self.budget.observe_acceptance(self._score(self._waiting.popleft()))
        for t in self._waiting:
            t.age += 1

    def _score(self, t: _Trees) -> np.ndarray:
        """[S, widths]: how many of each tree's drafts the emitted tokens confirm, using its top-w nodes."""
        s, n = t.tokens.shape
        after = np.full((s, max(n - 1, 1)), -1, dtype=np.int64)  # the tokens each sequence emitted after its root
        for i, (seq, root) in enumerate(zip(t.seqs, t.roots.tolist())):
            got = seq.tokens[root : root + n - 1]
            after[i, : len(got)] = got
        depth = np.zeros((s, n), dtype=np.int64)
        matched = np.zeros((s, n), dtype=bool)
        matched[:, 0] = True
        rows = np.arange(s)
        for j in range(1, n):  # parents precede their children
            p = t.parents[:, j]
            real = p >= 0
            pj = np.where(real, p, 0)
            depth[:, j] = np.where(real, depth[rows, pj] + 1, 0)
            guess = after[rows, np.clip(depth[:, j] - 1, 0, None)]
            matched[:, j] = real & matched[rows, pj] & (t.tokens[:, j] == guess)
        deepest = np.maximum.accumulate(np.where(matched, depth, 0), axis=1)  # within the top j nodes
        widths = np.minimum(self.budget.widths, n - 1)
        return deepest[:, widths].astype(np.float64)

    def clear_history(self) -> None:
        if self.enabled:
            self.index.clear_history()

    def stats(self) -> dict:
        if not self.enabled:
            return {}
        steps = sum(self._widths.values())
        out = {
            "rollout/spec_history_rows": self.index.history_rows_used,
            "rollout/spec_index_bytes": self.index.table.nbytes,
            "rollout/spec_width_mean": sum(w * c for w, c in self._widths.items()) / steps if steps else 0.0,
        }
        for w, a in zip(self.budget.widths, self.budget.acc.tolist()):
            out[f"rollout/spec_accept_estimate_w{w}"] = a
        out.update({f"rollout/spec_cost_ms_{k}": v for k, v in self.budget.costs().items()})
        return out
