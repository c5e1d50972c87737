"""Speculation as the engine sees it: one object for the index, the drafter, the budget, the numbers.

    spec = Speculator(config.spec, token_table)
    spec.join(seq) / spec.leave(seq, keep)       a sequence starts or stops running
    plan = spec.plan(num_seqs, free_slots, draining)   a decode step's draft rows (0: plain decoding), drafting, head work, shadow
    spec.before_decode(plan.drafting)            what the drafter reads goes to the device, if it runs
    ... the step runs (ModelRunner.launch_decode(batch, slots, plan.draft_rows, plan.drafting, plan.head, plan.shadow)) ...
    spec.head_for_prefill(new_prompts)           whether a prefill step runs the draft head
    spec.observe(seqs, root_lens, trees, draft_rows, seconds, report)   once collected and its tokens
                                                 appended: the budget's scores, and what each drafter's
                                                 drafts did (StepReport) for the policies over them
    spec.stats()

Drafting itself happens on the device inside the step (kernels/ngram_draft.py, over the token
table and the index's scan lines; kernels/draft_rows.py picks the batch's best drafts), so
nothing here runs per token. `observe` keeps the trees that came back and, once their
sequences have emitted the tokens after each root, scores them for the budget (`score_trees`,
spec/budget.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from rollout.config import SpecConfig
from spec.budget import FRACTIONS, DraftBudget, StepPlan, rows_at
from spec.head_watch import INFORMED_AFTER, HeadCycle, HeadWatch
from spec.index import NgramIndex
from spec.step import Drafted, DraftSettings, HeadWork, StepReport, bucket
from spec.token_table import TokenTable

SCAN_WIDTH = 32  # rows of its group a sequence searches besides its own: live samples, then history
CANDIDATES = 8  # continuations a tree is built from (the most recent of the longest matches)
SCORED = 128  # trees scored per evaluation at most, spread over the batch (each costs the host a list slice)
COUPLED_ACCEPT = 0.9  # the share of coupled drafts the budget counts on being accepted, until measured
COUPLED_MEMORY = 256  # coupled drafts verified over which their measured acceptance averages


@dataclass(eq=False)
class _Trees:
    """Trees that came back from a step, waiting for the tokens they guessed."""

    seqs: list[Drafted]
    roots: np.ndarray  # [S]: each sequence's length when the tree was drafted (its root is the last token)
    tokens: np.ndarray  # [S, N]
    depths: np.ndarray  # [S, N]
    ancestors: np.ndarray  # [S, N] bit j: node j is the node or above it
    keys: np.ndarray  # [S, N]
    age: int = 0


class Speculator:
    def __init__(self, cfg: SpecConfig, table: TokenTable, chains: bool = False, coupled: bool = False):
        """`chains`: the index drafts one continuation a sequence (a batch-invariant engine's);
        `coupled`: samples draft from their earlier rollouts drawn with their keys (coupled sampling)."""
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.depth = cfg.tree_width
        # a learned head drafts at the end of a step for the next one (spec/head_drafter.py): a step's
        # `drafting` says whether it leaves drafts behind, not whether it verifies any
        self.drafts_ahead = "eagle" in cfg.drafters or "mtp" in cfg.drafters
        self.head_name = next((d for d in cfg.drafters if d in ("eagle", "mtp")), None)
        self.cycle: HeadCycle | None = None
        self.index = NgramIndex(table, SCAN_WIDTH, cfg.history_per_prompt, cfg.share_siblings)
        ngram = "ngram" in cfg.drafters
        # chains, one continuation each, where a tree's nodes would be computed in other bits than
        # decoding computes them (batch-invariant attention sums a token's keys by position)
        candidates = 1 if chains or coupled else CANDIDATES
        self.draft = (DraftSettings(cfg.max_match, cfg.min_match, candidates, self.depth, self.index.scan, coupled)
                      if ngram else None)
        self.reset()

    def reset(self) -> None:
        """Forget what was indexed and learned (after a failed step: it may hold what broke it). The
        index's scan table, which the runner's CUDA graphs read, and the head's measured costs stay."""
        cfg = self.cfg
        self.index.reset()
        self.budget = DraftBudget(self.depth, cfg.max_verify_tokens, self.index.table.padding_row, cfg.adaptive)
        self.watch = HeadWatch(cfg.head_min_accept) if self.drafts_ahead else None
        self.cycle = HeadCycle(costs=self.cycle.costs if self.cycle else None) if self.drafts_ahead else None
        self._index_misses = 1  # a hybrid: sequences the index had nothing for in its last drafting step (none seen yet)
        self._coupled = 0  # sequences that followed their earlier rollout in the last drafting step
        self._coupled_accept = COUPLED_ACCEPT  # their drafts' acceptance, a running mean
        self._waiting: deque[_Trees] = deque()
        self._steps = self._rows = 0  # decode steps planned, and the draft rows they verified

    def on_weights(self, version: int, head_pushed: bool) -> None:
        if self.watch is not None:
            self.watch.on_weights(version, head_pushed)
            if head_pushed:
                self.cycle.head_pushed()

    def _observe_chains(self, report: StepReport) -> None:
        """The draft head's verified chains: their first drafts' hits keep it awake (HeadWatch)."""
        head = report.by_source.get(self.head_name)
        if head is not None and head.sequences:
            self.watch.observe(head.sequences, head.first_accepted)
            self.cycle.verified()

    def head_for_prefill(self, new_prompts: bool) -> bool:
        """Whether a prefill step runs the draft head (`new_prompts`: it admits prompts' first chunks)."""
        if self.cycle is None:
            return False
        return self.cycle.admit(self.watch.switched_off) if new_prompts else self.cycle.awake

    def _observe_coupled_drafts(self, drafted: int, accepted: int) -> None:
        """A step's verified coupled drafts and how many were accepted (their running acceptance)."""
        if drafted:
            share = min(1.0, drafted / COUPLED_MEMORY)
            self._coupled_accept += share * (accepted / drafted - self._coupled_accept)

    @property
    def step_kinds(self) -> list[tuple[bool, HeadWork]]:
        """The (drafting, head work) pairs a decode step may have (a CUDA graph each)."""
        none, pass_, chain = HeadWork.NONE, HeadWork.PASS, HeadWork.CHAIN
        if not self.enabled:
            return [(False, none)]
        if not self.drafts_ahead:
            return [(False, none), (True, none)]
        if self.draft is None:  # a head alone: a drafting step is its chain
            return [(False, none), (False, pass_), (True, chain)]
        return [(False, none), (True, none), (False, pass_), (True, pass_), (True, chain)]

    def join(self, seq: Drafted) -> None:
        if self.enabled:
            self.index.join(seq)

    def leave(self, seq: Drafted, keep: bool) -> None:
        if self.enabled:
            self.index.leave(seq, keep)
            self.budget.forget(seq.row)

    def before_decode(self, drafting: bool) -> None:
        """Before a decode or verify step whose drafter runs: the joins and leaves since it last ran
        reach the device (the scan lines that changed, the finished samples' rows kept as history).
        Only the drafter reads them, so steps that do not draft leave them queued: at a large batch
        samples finish in most steps, and the two flushes cost the host ~80 us a step (cProfile at
        256 sequences on the H200's host). A prefill, which may give a new sequence a finished one's row, flushes the
        token table before it writes (TokenTable.flush)."""
        if self.enabled and drafting:
            self.index.flush()
            self.index.table.flush()

    def plan(self, num_seqs: int, free_slots: int, draining: bool) -> StepPlan:
        """`draining`: no request waits to be admitted (spec/budget.py)."""
        if not self.enabled:
            return StepPlan(0, False, False)
        # Sequences that follow their earlier rollout under coupled sampling (as of the last drafting step)
        # draft its next tokens, accepted 0.995-1.000 of the time on the GPU while aligned (bench/RESULTS.md's
        # coupled rows and their logs); their chains' keys rank above every n-gram draft, so a step's rows go
        # to them first. The budget weighs them at their measured acceptance (a running mean over the last few
        # hundred), against its measured costs, rather than wait for its estimates, which learn too slowly for
        # them (per-sequence rates move a tenth of the way every 8 steps, and the drain caps them at the
        # slowest tenth's).
        if self.cycle is not None and self.cycle.awake and self.cycle.evaluations < INFORMED_AFTER:
            self.budget.shadow_often()  # (its estimates are uninformed: its idle and paying steps do not count yet)
        plan = self.budget.plan(num_seqs, free_slots, draining,
                                sure=self._coupled * self.depth * self._coupled_accept)
        self._steps += 1
        self._rows += plan.draft_rows
        if self.drafts_ahead:
            # Chains for the next step where it will likely verify them (this one does: the
            # budget's choice changes seldom from one step to the next) or where its trees come
            # back for the statistics. A head's chain is a step of its own per draft, run for
            # every sequence. In a hybrid the chains serve only the sequences the index has
            # nothing for: none had in its last drafting step (read one step late), none are made
            # (ShareGPT b1 on the H200, chains of 7 made at every drafting step: the hybrid's
            # steps took 1.51 ms, the index's alone 0.90, and the index had a tree in 64 of its
            # 69 steps). A sleeping head (spec/head_watch.py HeadCycle) does nothing.
            awake = self.cycle.step(self.watch.switched_off)
            probing = awake and not self.watch.on  # (a switched-off head's wake-up)
            rows, drafting, shadow = plan.draft_rows, plan.drafting or self.budget.shadow_next, plan.shadow
            if not awake:
                head = HeadWork.NONE
                if self.draft is None:  # the head alone: plain decoding, and no (empty) trees to score
                    rows, drafting, shadow = 0, False, False
            else:
                if probing and not rows:  # a probe verifies the head's chains whatever the estimates say
                    rows = self.budget.fewest_rows(num_seqs, free_slots)
                drafting = drafting or rows > 0
                chain = drafting and (self.draft is None or self._index_misses > 0 or probing)
                head = HeadWork.CHAIN if chain else HeadWork.PASS
            plan = StepPlan(rows, drafting, shadow, head)
        return plan

    def observe(self, seqs: list[Drafted], roots: np.ndarray | None, trees: tuple[np.ndarray, ...] | None,
                draft_rows: int, seconds: float, report: StepReport | None = None) -> None:
        """A decode or verify step was collected and its tokens appended, `seconds` after the step
        before it; `trees`: the drafter's (tokens, depths, ancestors, keys), if they came back, and
        `roots` the sequences' lengths before the step's tokens were appended; `report`: what its
        drafts did, by drafter."""
        if not self.enabled:
            return
        if report is not None:
            coupled = report.by_source.get("coupled")
            if coupled is not None:
                self._observe_coupled_drafts(coupled.drafted, coupled.accepted)
            if self.watch is not None:
                self._observe_chains(report)
        self.budget.observe_step(len(seqs), draft_rows, seconds)
        if draft_rows and report is not None and set(report.by_source) == {"ngram"}:  # (the trees' drafts alone)
            self.budget.observe_verified(len(seqs), draft_rows, report.by_source["ngram"].accepted)
        if trees is not None:
            self._waiting.append(_Trees(seqs, roots, *trees))
        while self._waiting and self._waiting[0].age > self.depth:  # the tokens after every root are known
            trees = self._waiting.popleft()
            self.budget.observe_acceptance(len(trees.seqs), *score_trees(trees))
            if self.cycle is not None:
                self.cycle.evaluated()
        for t in self._waiting:
            t.age += 1
        if report is None:
            return
        if report.head != HeadWork.NONE:  # a step the head ran in: its time and tokens (HeadCycle)
            head = report.by_source.get(self.head_name)
            self.cycle.ran(bucket(len(seqs)), report.head == HeadWork.CHAIN, seconds, report.tokens,
                           head.accepted if head is not None else 0)
        if report.index_misses is not None:
            self._index_misses = report.index_misses
        if report.coupled is not None:
            self._coupled = report.coupled

    def clear_history(self) -> None:
        if self.enabled:
            self.index.clear_history()

    def stats(self) -> dict:
        if not self.enabled:
            return {}
        out = {
            "rollout/spec_history_rows": self.index.history_rows_used,
            "rollout/spec_index_bytes": self.index.table.nbytes,
            "rollout/spec_draft_rows_mean": self._rows / self._steps if self._steps else 0.0,
        }
        if (b := self.budget.last_evaluated) is not None:  # the bucket evaluated last
            out["rollout/spec_accept_estimate_bucket"] = b
            for f, a in zip(FRACTIONS, self.budget.acc[b].tolist()):
                out[f"rollout/spec_accept_estimate_f{f:g}"] = a
        if self.budget.slowest is not None:  # what caps the estimate while the batch drains
            for f, a in zip(FRACTIONS, self.budget.slowest.tolist()):
                out[f"rollout/spec_accept_slowest_f{f:g}"] = a
        out.update({f"rollout/spec_cost_ms_{k}": v for k, v in self.budget.costs().items()})
        if self.watch is not None:
            out.update(self.watch.stats())
            out.update(self.cycle.stats())
        return out


def score_trees(t: _Trees) -> tuple[np.ndarray, np.ndarray]:
    """[P, fractions]: how many of each tree's drafts the emitted tokens confirm, among the drafts
    a step of that many draft rows would have verified (the device's choice, replayed), for P
    of the trees spread over the batch (at most SCORED); and [P] their sequences' KV rows (-1
    for one that stopped running since)."""
    s, n = t.tokens.shape
    pick = np.arange(s) if s <= SCORED else np.linspace(0, s - 1, SCORED).round().astype(np.int64)
    p = len(pick)
    pad = [-1] * (n - 1)  # (n >= 2: speculation is on only with drafts)
    # the tokens each sequence emitted after its root, -1 past what it has (one array from lists:
    # a row assigned per sequence costs a conversion each)
    after = np.array([(t.seqs[k].tokens[r : r + n - 1] + pad)[: n - 1] for k, r in zip(pick.tolist(), t.roots[pick].tolist())],
                     dtype=np.int64)
    node = np.arange(n)
    depth = t.depths[pick]
    guess = np.take_along_axis(after, np.clip(depth - 1, 0, None), axis=1)
    hit = (node == 0) | ((t.keys[pick] >= 0) & (t.tokens[pick] == guess))  # a draft's own token (padding has none)
    bits = (hit.astype(np.int64) << node).sum(axis=1)  # distinct bits: the sum is their OR
    matched = (t.ancestors[pick] & ~bits[:, None]) == 0  # it and every node above it
    deepest = np.maximum.accumulate(np.where(matched, depth, 0), axis=1)  # within a tree's first j nodes
    rows = np.arange(p)
    kept = kept_drafts(t.keys, [rows_at(f, s, n - 1) for f in FRACTIONS])[:, pick]  # (the whole batch's choice)
    running = np.array([t.seqs[k].row if t.seqs[k].finish_reason is None else -1 for k in pick.tolist()], dtype=np.int64)
    return deepest[rows, kept].T, running


def kept_drafts(keys: np.ndarray, capacities: list[int]) -> np.ndarray:
    """The drafts each tree keeps when a step verifies the batch's best `capacity` (keys [S, N], -1
    for the root and padding), for each capacity: kernels/draft_rows.py's choice on the host, by
    key, then the earlier node. Each tree keeps its first few drafts; returns how many
    [capacities, S]."""
    s, n = keys.shape
    flat = keys[:, 1:].reshape(-1).astype(np.int16)  # (keys < KEY_SCALE: 16 bits sort by radix, 41 -> 13 us at 512 x 8)
    order = np.argsort(-flat, kind="stable")
    tree = np.where(flat[order] >= 0, order // (n - 1), s)  # (s: not a draft)
    return np.stack([np.bincount(tree[:c], minlength=s + 1)[:s] for c in capacities])
