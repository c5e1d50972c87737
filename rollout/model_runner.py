"""Turns a scheduled batch into tensors, runs the model, draws tokens, verifies draft trees.

Host work per step: lay out the new tokens of every sequence (prefill chunk, decode token,
or draft tree) and give them KV slots (`StepLayout`), upload that in three copies, run the
model (a captured CUDA graph for decode and verify steps on the GPU), draw every token
needed in one sampling pass, and copy the results back once. On a small model the host is
the bottleneck, so decode and verify steps are laid out, and verify steps' trees walked,
with array operations over the whole batch rather than per sequence and per node. A decode
step may be launched before the step it follows is collected: what it needs from that step
(its tokens; after a verify step also the accepted paths' lengths) stays on the device
(`Handoff`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.tree_accept import verify_outcome
from rollout.kv_pool import KVPool
from rollout.logits_processing import LogitEdits, logit_edits
from rollout.model_config import ModelConfig
from rollout.models.llama import CausalLM, ForwardContext
from rollout.sampler import SamplingTensors, processed_logprobs, sample
from rollout.scheduler import Batch
from rollout.sequence import Sequence
from spec.tree import DraftTree
from spec.verify import accept_paths


@dataclass
class Emitted:
    """What one sequence produced in a step (before stop-condition truncation)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]
    decode: bool  # a decode/verify step (counts toward accept length), not a prefill's first token
    drafted: int = 0
    accepted: int = 0
    rejected: bool = False  # verification turned down a draft after the accepted ones (it did not run out)
    source: str = ""
    top: list[tuple[list[int], list[float]]] | None = None  # per token: the most likely tokens and their logprobs


@dataclass
class StepLayout:
    """The host-side arrays of one forward step."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    out_slots: np.ndarray  # [T] int64
    tree_mask: np.ndarray | None  # [T] int64, None = causal
    tree_parents: np.ndarray | None  # [T] int64 with tree_mask: each token's tree parent, step-wide (-1: a root)
    seq_rows: np.ndarray  # [B] int32
    kv_lens: np.ndarray  # [B] int32
    q_lens: np.ndarray  # [B] int32
    logits_rows: np.ndarray  # [L] int64: token rows whose next-token logits are needed

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def padded(self, num_seqs: int, num_tokens: int, num_logits: int, padding_row: int) -> "StepLayout":
        """Pad with empty sequences and with tokens that belong to none; both touch only slot 0."""
        extra_tokens, extra_seqs = num_tokens - self.num_tokens, num_seqs - len(self.seq_rows)
        zeros = np.zeros(extra_tokens, dtype=np.int64)
        return StepLayout(
            input_ids=np.concatenate([self.input_ids, zeros]),
            positions=np.concatenate([self.positions, zeros]),
            out_slots=np.concatenate([self.out_slots, zeros]),
            tree_mask=None if self.tree_mask is None else np.concatenate([self.tree_mask, zeros + 1]),
            tree_parents=None if self.tree_parents is None else np.concatenate([self.tree_parents, zeros - 1]),
            seq_rows=np.concatenate([self.seq_rows, np.full(extra_seqs, padding_row, dtype=np.int32)]),
            kv_lens=np.concatenate([self.kv_lens, np.zeros(extra_seqs, dtype=np.int32)]),
            q_lens=np.concatenate([self.q_lens, np.zeros(extra_seqs, dtype=np.int32)]),
            logits_rows=np.concatenate([self.logits_rows, np.zeros(num_logits - len(self.logits_rows), np.int64)]),
        )


@dataclass
class DrawInputs:
    """Host-side sampling inputs, one column per draw (a token to be drawn from a logits row)."""

    i64: np.ndarray  # [4, S]: logits row, RNG key, output position, top_k
    f32: np.ndarray  # [3, S]: temperature, top_p, min_p
    mode: str  # greedy | sample | truncate: which code path every row can share
    edits: LogitEdits | None = None  # penalties, biases, banned stops (rollout/logits_processing.py)
    top_logprobs: int = 0  # the most likely tokens to report per draw (the largest any request asks)

    @property
    def plain(self) -> bool:
        """Nothing beyond drawing: the step may replay a CUDA graph."""
        return self.edits is None and not self.top_logprobs

    @staticmethod
    def of(seqs: list[Sequence], counts: np.ndarray, rows: np.ndarray, positions: np.ndarray,
           paths: list[list[int]] | None = None) -> "DrawInputs":
        """`counts[i]` draws for `seqs[i]`, in order; `rows`, `positions`: per draw; `paths`: per draw,
        the drafts above it in its tree (None: no trees)."""
        n = len(seqs)
        params = [s.request.params for s in seqs]
        column = lambda values, dtype: np.repeat(np.fromiter(values, dtype, n), counts)  # noqa: E731
        top_k = column((p.top_k for p in params), np.int64)
        temperature = column((p.temperature for p in params), np.float32)
        top_p = column((p.top_p for p in params), np.float32)
        min_p = column((p.min_p for p in params), np.float32)
        i64 = np.stack([rows, column((s.key for s in seqs), np.int64), positions, top_k]).astype(np.int64, copy=False)
        if not temperature.any():
            mode = "greedy"
        elif (top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any():
            mode = "truncate"
        else:
            mode = "sample"
        edits = None
        if any(p.processes_logits for p in params):
            per_draw = [s for s, c in zip(seqs, counts.tolist()) for _ in range(c)]
            edits = logit_edits(per_draw, paths or [()] * len(per_draw))
        top = max((s.request.top_logprobs_num for s in seqs), default=0)
        return DrawInputs(i64, np.stack([temperature, top_p, min_p]), mode, edits, top)

    def tensors(self, i64: torch.Tensor, f32: torch.Tensor) -> SamplingTensors:
        """SamplingTensors over device copies of i64 [4, S] and f32 [3, S]."""
        return SamplingTensors(
            temperature=f32[0], top_p=f32[1], min_p=f32[2], keys=i64[1], positions=i64[2], top_k=i64[3],
            all_greedy=self.mode == "greedy", any_truncation=self.mode == "truncate",
        )


class DeviceStep:
    """A layout and its draw inputs on the device: int64, int32 and float32 fields, each group
    moved in one copy."""

    def __init__(self, lay: StepLayout, draws: DrawInputs, device: torch.device):
        tree = lay.tree_mask is not None
        nothing = np.zeros(0, dtype=np.int64)
        qo_indptr = np.zeros(len(lay.q_lens) + 1, dtype=np.int32)
        np.cumsum(lay.q_lens, out=qo_indptr[1:])
        i64 = _to_device(np.concatenate([
            lay.input_ids, lay.positions, lay.out_slots, lay.tree_mask if tree else nothing,
            lay.tree_parents if tree else nothing, lay.logits_rows, draws.i64.ravel(),
        ]), device)
        i32 = _to_device(np.concatenate([lay.seq_rows, lay.kv_lens, qo_indptr]), device)
        f32 = _to_device(draws.f32.ravel(), device)
        t, b, n = lay.num_tokens, len(lay.seq_rows), draws.i64.shape[1]
        self.input_ids, self.positions, self.out_slots = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t]
        self.tree_mask = i64[3 * t : 4 * t] if tree else None
        self.tree_parents = i64[4 * t : 5 * t] if tree else None
        rows_start = 5 * t if tree else 3 * t
        rows_end = rows_start + len(lay.logits_rows)
        self.logits_rows = i64[rows_start:rows_end]
        draw_cols = i64[rows_end:].view(4, n)
        self.draw_rows, self.draw_positions = draw_cols[0], draw_cols[2]
        self.sampling = draws.tensors(draw_cols, f32.view(3, n))
        self.edits = draws.edits.to(device) if draws.edits is not None else None
        self.top_logprobs = draws.top_logprobs
        self.seq_rows, self.kv_lens, self.qo_indptr = i32[:b], i32[b : 2 * b], i32[2 * b :]
        self.max_q_len = int(lay.q_lens.max()) if b else 0
        self.max_kv_len = int(lay.kv_lens.max()) if b else 0


class HostCopy:
    """The step's results on their way to the host: one asynchronous copy, waited for once."""

    def __init__(self, out: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None = None):
        # out [2, n] float64: drawn tokens, their logprobs; top: ids [n, k] int64 and logprobs [n, k] float32
        self.event = None
        tensors = (out,) if top is None else (out, *top)
        if out.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = list(tensors)

    @property
    def overlaps_host(self) -> bool:
        """Whether the device works while the host goes on (CUDA); on CPU the step is done at launch."""
        return self.event is not None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """Tokens, their logprobs, and (ids, logprobs) of the most likely tokens if asked for."""
        if self.event is not None:
            self.event.synchronize()  # the step's one intended host sync
        out = self.host[0].numpy()
        top = (self.host[1].numpy(), self.host[2].numpy()) if len(self.host) == 3 else None
        return out[0].astype(np.int64), out[1], top


@dataclass
class Handoff:
    """What a launched step leaves on the device for a decode step chained after it, per batch item."""

    tokens: torch.Tensor  # [items]: the token each item feeds next (its draw, or its accepted path's bonus token)
    advance: torch.Tensor | None  # [items] int64: KV tokens the item added (a verify step's path); None: one each
    max_advance: int = 1  # a host-side bound of `advance`

    def feed(self, step: DeviceStep, n: int, index: np.ndarray | None, slot_table: torch.Tensor) -> None:
        """Complete a chained decode step of `n` sequences on the device: its i-th sequence continues
        item `index[i]` (None: item i), laid out on the host as if that item had added one token."""
        where = None if index is None else _to_device(index, self.tokens.device)
        pick = (lambda t: t[:n]) if where is None else (lambda t: t[where])  # noqa: E731
        step.input_ids[:n].copy_(pick(self.tokens))
        if self.advance is None:
            return
        extra = pick(self.advance) - 1
        step.positions[:n] += extra
        step.kv_lens[:n] += extra.to(torch.int32)
        step.draw_positions[:n] += extra
        # the host could not place the new token's slot: its position was not known there
        slot_table[step.seq_rows[:n].long(), step.positions[:n]] = step.out_slots[:n].to(torch.int32)


@dataclass
class StepInFlight:
    """A launched step: what `collect` needs once the device is done."""

    batch: Batch
    trees: dict[int, DraftTree]
    layout: StepLayout  # unpadded: input_ids are the tokens fed, out_slots their new KV slots
    first_draw: np.ndarray  # [items + 1]: item k's draws (its sample's, then its forks'; or its tree's nodes)
    result: HostCopy
    handoff: Handoff  # for a decode step chained after this one
    chained_slots: dict[int, int] | None = None  # verify steps: seq_id -> KV slot of the decode step chained after

    @property
    def chainable(self) -> bool:
        """A decode or verify step: a decode step can follow it before the host has its tokens."""
        return not self.batch.is_prefill

    def draw_index(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Where each of `seqs` (all in this step; KeyError if not) is among its items; None: in order, from 0."""
        mine = [item.seq for item in self.batch.items]
        if mine[: len(seqs)] == seqs:
            return None
        where = {id(s): i for i, s in enumerate(mine)}
        return np.array([where[id(s)] for s in seqs], dtype=np.int64)


def _draft_paths(tree: DraftTree | None) -> list[list[int]]:
    """Per node of the tree (root-only without one), the drafts from its root down to it, itself included."""
    if tree is None:
        return [[]]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return paths


def _top_rows(top: tuple[np.ndarray, np.ndarray] | None) -> Callable[[list[int]], list | None]:
    """Per draw index list: the (ids, logprobs) lists of those draws' most likely tokens, or None."""
    if top is None:
        return lambda draws: None
    ids, values = top[0].tolist(), top[1].tolist()
    return lambda draws: [(ids[d], values[d]) for d in draws]


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    # non_blocking: a blocking copy would wait for the device to finish the step in flight. From
    # pageable memory the copy is staged before the call returns, so `a` may be dropped at once.
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def rope_tables(cfg: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, computed as transformers does."""
    inv_freq = cfg.rope_inv_freq()
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        cuda_graphs: bool = False,
        max_graph_tokens: int = 512,
        max_tree_tokens: int = 1,
    ):
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.cos, self.sin = rope_tables(model.config, pool.max_context, device)
        self.graphs = None
        if cuda_graphs:
            from rollout.cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs(self, pool.free_rows, max_graph_tokens, max_tree_tokens)
        self._dirty_rows: list[np.ndarray] = []  # slot-table entries changed on the host since the last commit
        self._dirty_cols: list[np.ndarray] = []

    def reset(self) -> None:
        """Forget slot-table edits not yet committed (the engine starts over: Engine.recover)."""
        self._dirty_rows, self._dirty_cols = [], []

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they hold the addresses of the weights and the KV pool)."""
        if self.graphs is not None:
            self.graphs.clear()

    def _set_slots(self, rows: np.ndarray, cols: np.ndarray, slots: np.ndarray) -> None:
        """Slot-table entries (rows[i], cols[i]) = slots[i], on the host now and on the device at commit."""
        self.pool.rows_host[rows, cols] = slots
        self._dirty_rows.append(rows)
        self._dirty_cols.append(cols)

    def _commit_rows(self) -> None:
        if self._dirty_rows:
            self.pool.commit_rows(np.concatenate(self._dirty_rows), np.concatenate(self._dirty_cols))
            self._dirty_rows, self._dirty_cols = [], []

    def run(self, batch: Batch, trees: dict[int, DraftTree]) -> list[Emitted]:
        """Run one step. `trees` maps seq_id to its draft tree (decode items only; root = last token)."""
        return self.collect(self.launch(batch, trees))

    @torch.inference_mode()
    def launch(self, batch: Batch, trees: dict[int, DraftTree], after: StepInFlight | None = None) -> StepInFlight:
        """Lay out, upload and queue the step on the device; returns without waiting for it.

        `after`: a decode or verify step not yet collected; this decode step (of some of its
        sequences) continues from what that step left on the device (`Handoff`), so the host
        need not wait for its tokens. Prefill and decode tokens count as cached from here on,
        and so do a verify step's roots; its drafts, and the token of a decode step chained
        after it, once `collect` has the verify step's accepted paths.
        """
        prepare = None
        if batch.is_prefill:
            lay, draws, first_draw = self._prefill_layout(batch)
        elif trees:
            lay, draws, first_draw = self._tree_layout(batch, trees)
        else:
            lay, draws, first_draw = self._decode_layout(
                batch, pending=after is not None, place=after is None or not after.trees
            )
            if after is not None:
                prepare = self._chain(after, [item.seq for item in batch.items], lay)
        self._commit_rows()
        shape = None
        if self.graphs is not None and not batch.is_prefill and draws.plain:  # one draw per logits row, in order
            shape = self.graphs.shape(lay, draws.mode)
        top = None
        if shape is not None:
            step, out, handoff = self.graphs.launch(lay, draws, shape, prepare)
        else:
            step = DeviceStep(lay, draws, self.device)
            if prepare is not None:
                prepare(step)
                step.max_kv_len += after.handoff.max_advance - 1  # (a graph's attention is planned for any length)
            out, top = self._sample(self.forward(step), step)
            handoff = self.verify_handoff(step, out[0], int(lay.q_lens.max())) if trees else Handoff(out[0], None)
        if trees:  # a root is always kept; its drafts count once `collect` has the accepted paths
            for item in batch.items:
                item.seq.num_cached += 1
            handoff = Handoff(handoff.tokens, handoff.advance, int(lay.q_lens.max()))
        elif after is None or not after.trees:  # (after a verify step: counted by its `collect`)
            for item in batch.items:
                item.seq.num_cached += item.num_new
        return StepInFlight(batch, trees, lay, first_draw, HostCopy(out, top), handoff)

    def _chain(self, after: StepInFlight, seqs: list[Sequence], lay: StepLayout) -> Callable[[DeviceStep], None]:
        """How a decode step of `seqs` (laid out as `lay`) completes its inputs from `after` on the device."""
        index = after.draw_index(seqs)
        if after.trees:  # the new tokens' positions are known once the paths are: their slots go into the table then
            after.chained_slots = dict(zip((s.seq_id for s in seqs), lay.out_slots.tolist()))
        return partial(after.handoff.feed, n=len(seqs), index=index, slot_table=self.pool.slot_table)

    def verify_handoff(self, step: DeviceStep, drawn: torch.Tensor, max_tree_tokens: int) -> Handoff:
        """Part of every verify step, on the device: its accepted paths, and the slot table brought up
        to date (kernels/tree_accept.py), for a decode step chained after it. Works on a graph's
        padded step too."""
        bonus, lengths = verify_outcome(
            step.tree_parents, step.tree_mask, step.input_ids, step.positions, step.out_slots, drawn,
            step.qo_indptr, step.seq_rows, self.pool.slot_table, self.pool.padding_row, max_tree_tokens,
        )
        return Handoff(bonus, lengths)

    def collect(self, step: StepInFlight) -> list[Emitted]:
        """Wait for a launched step and apply what it produced to the sequences' KV bookkeeping."""
        tokens, logprobs, top = step.result.wait()
        if step.trees:
            return self._emit_trees(step, tokens, logprobs, top)
        return self._emit(step, tokens, logprobs, top)

    def forward(self, step: DeviceStep, attn_out: torch.Tensor | None = None) -> torch.Tensor:
        """The model on one uploaded step: logits [L, vocab] float32 for step.logits_rows."""
        meta = AttentionMetadata(
            seq_rows=step.seq_rows,
            kv_lens=step.kv_lens,
            qo_indptr=step.qo_indptr,
            slot_table=self.pool.slot_table,
            out_slots=step.out_slots,
            tree_mask=step.tree_mask,
            max_q_len=step.max_q_len,
            max_kv_len=step.max_kv_len,
        )
        self.backend.plan(meta)
        ctx = ForwardContext(
            meta, self.backend, self.pool.k_caches, self.pool.v_caches,
            self.cos[step.positions], self.sin[step.positions], attn_out,
        )
        return self.model(step.input_ids, ctx, step.logits_rows)

    def _prefill_layout(self, batch: Batch):
        """Prompt chunks (and decode tokens riding along); a finished prompt draws for its sample and forks."""
        ids, starts, q_lens, rows = [], [], [], []
        logits_rows: list[int] = []
        draw_seqs: list[Sequence] = []
        first_draw = [0]
        num_tokens = 0
        for item in batch.items:
            seq, start = item.seq, item.seq.num_cached
            ids.append(np.asarray(seq.tokens[start : start + item.num_new], dtype=np.int64))
            starts.append(start)
            q_lens.append(item.num_new)
            rows.append(seq.row)
            num_tokens += item.num_new
            if item.samples:  # the last token predicts; forks draw their first token from it too
                logits_rows.append(num_tokens - 1)
                draw_seqs += [seq, *seq.forks]
            first_draw.append(len(draw_seqs))
        q_lens_a = np.array(q_lens, dtype=np.int32)
        starts_a = np.array(starts, dtype=np.int64)
        slots, offsets = self._place(np.array(rows, dtype=np.int64), starts_a, q_lens_a)
        lay = StepLayout(
            input_ids=np.concatenate(ids), positions=np.repeat(starts_a, q_lens_a) + offsets, out_slots=slots,
            tree_mask=None, tree_parents=None, seq_rows=np.array(rows, dtype=np.int32),
            kv_lens=(starts_a + q_lens_a).astype(np.int32),
            q_lens=q_lens_a, logits_rows=np.array(logits_rows, dtype=np.int64),
        )
        counts = np.ones(len(draw_seqs), dtype=np.int64)
        draw_rows = np.repeat(  # a draw reads its row of the logits, which hold only `logits_rows`
            np.arange(len(logits_rows)), [1 + len(item.seq.forks) for item in batch.items if item.samples]
        )
        positions = np.array([s.num_output for s in draw_seqs], dtype=np.int64)
        return lay, DrawInputs.of(draw_seqs, counts, draw_rows, positions), np.array(first_draw, dtype=np.int64)

    def _decode_layout(self, batch: Batch, pending: bool = False, place: bool = True):
        """The common step, vectorised: every sequence feeds its last token and draws the next.
        `pending`: that last token is still being drawn on the device (a chained step), so
        the ids laid out here are placeholders and each draw is one output position later.
        `place=False`: the new tokens get KV slots but no slot-table position (after a verify
        step in flight: the position depends on its accepted paths, see `Handoff.feed`)."""
        seqs = [item.seq for item in batch.items]
        n = len(seqs)
        starts = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=n)
        rows = np.fromiter((s.row for s in seqs), dtype=np.int32, count=n)
        ones = np.ones(n, dtype=np.int32)
        if place:
            slots, _ = self._place(rows.astype(np.int64), starts, ones)
        else:
            slots = self.pool.alloc(n).astype(np.int64)
        lay = StepLayout(
            input_ids=np.fromiter((s.tokens[-1] for s in seqs), dtype=np.int64, count=n),  # placeholders if pending
            positions=starts,
            out_slots=slots,
            tree_mask=None,
            tree_parents=None,
            seq_rows=rows,
            kv_lens=(starts + 1).astype(np.int32),
            q_lens=ones,
            logits_rows=np.arange(n, dtype=np.int64),
        )
        positions = np.fromiter((s.num_output for s in seqs), dtype=np.int64, count=n) + pending
        draws = DrawInputs.of(seqs, ones, lay.logits_rows, positions)
        return lay, draws, np.arange(n + 1, dtype=np.int64)

    def _tree_layout(self, batch: Batch, trees: dict[int, DraftTree]):
        """A verify step: each sequence feeds its draft tree (or only its last token); every node draws."""
        seqs = [item.seq for item in batch.items]
        n = len(seqs)
        ids, depths, masks, parents = [], [], [], []
        num_nodes = 0
        for seq in seqs:
            tree = trees.get(seq.seq_id)
            if tree is None:
                ids.append(seq.tokens[-1:])
                depths.append((0,))
                masks.append((1,))
                parents.append((-1,))
            else:
                ids.append(tree.tokens)
                depths.append(tree.depths())
                masks.append(tree.ancestor_mask())
                parents.append(np.where(tree.parents >= 0, tree.parents + num_nodes, -1))
            num_nodes += len(ids[-1])
        q_lens = np.fromiter(map(len, ids), dtype=np.int32, count=n)
        starts = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=n)
        rows = np.fromiter((s.row for s in seqs), dtype=np.int32, count=n)
        # nodes take consecutive slot-table positions for now; verification keeps the accepted path
        slots, _ = self._place(rows.astype(np.int64), starts, q_lens)
        depth = np.concatenate(depths).astype(np.int64)
        lay = StepLayout(
            input_ids=np.concatenate(ids).astype(np.int64),
            positions=np.repeat(starts, q_lens) + depth,
            out_slots=slots,
            tree_mask=np.concatenate(masks).astype(np.int64),
            tree_parents=np.concatenate(parents).astype(np.int64),
            seq_rows=rows,
            kv_lens=(starts + q_lens).astype(np.int32),
            q_lens=q_lens,
            logits_rows=np.arange(num_nodes, dtype=np.int64),
        )
        num_output = np.fromiter((s.num_output for s in seqs), dtype=np.int64, count=n)
        paths = None
        if any(s.request.params.processes_logits for s in seqs):
            paths = [p for seq in seqs for p in _draft_paths(trees.get(seq.seq_id))]
        inputs = DrawInputs.of(seqs, q_lens, lay.logits_rows, np.repeat(num_output, q_lens) + depth, paths)
        first_draw = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=first_draw[1:])
        return lay, inputs, first_draw

    def _place(self, rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """New KV slots for each sequence's `q_lens` tokens, written into the slot table after its cached
        prefix. Returns the slots and each token's offset within its sequence's new tokens."""
        num_tokens = int(q_lens.sum())
        offsets = np.arange(num_tokens) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        slots = self.pool.alloc(num_tokens).astype(np.int64)
        self._set_slots(np.repeat(rows, q_lens), np.repeat(starts, q_lens) + offsets, slots)
        return slots, offsets

    def _sample(self, logits: torch.Tensor, step: DeviceStep) -> tuple[torch.Tensor, tuple | None]:
        """[2, S] float64 on the device: drawn tokens and their logprobs; and, if asked for, the
        ids [S, k] and logprobs [S, k] of each draw's k most likely tokens."""
        if len(step.draw_rows) == 0:
            return torch.zeros(2, 0, dtype=torch.float64, device=self.device), None
        logits = logits[step.draw_rows]  # (a copy: edits may write to it)
        if step.edits is not None:
            step.edits.apply(logits)
        tokens, logprobs = sample(logits, step.sampling)
        top = None
        if step.top_logprobs:
            values, ids = processed_logprobs(logits, step.sampling).topk(step.top_logprobs, dim=-1)
            top = (ids, values)
        return torch.stack([tokens.double(), logprobs.double()]), top

    def _emit(self, step: StepInFlight, tokens: np.ndarray, logprobs: np.ndarray, top) -> list[Emitted]:
        """A prefill or decode step: every sequence that drew gets one token."""
        out: list[Emitted] = []
        drawn, drawn_logprobs, first_draw = tokens.tolist(), logprobs.tolist(), step.first_draw.tolist()
        top_of = _top_rows(top)
        for item, i in zip(step.batch.items, first_draw):
            seq = item.seq
            if not item.samples:
                continue
            out.append(Emitted(seq, [drawn[i]], [drawn_logprobs[i]], item.decode, top=top_of([i])))
            for i, fork in enumerate(seq.forks, i + 1):
                self._fork_prompt_kv(seq, fork)
                out.append(Emitted(fork, [drawn[i]], [drawn_logprobs[i]], item.decode, top=top_of([i])))
        return out

    def _emit_trees(self, step: StepInFlight, tokens: np.ndarray, logprobs: np.ndarray, top) -> list[Emitted]:
        """A verify step: each tree keeps its accepted path (KV slots and slot-table positions), frees
        the rest. A sequence preempted or finished while the step ran keeps none of it."""
        items = step.batch.items
        lay, first = step.layout, step.first_draw
        roots = first[:-1].tolist()
        fed, slots = lay.input_ids, lay.out_slots
        paths = accept_paths(lay.tree_parents, fed, tokens, roots)
        node_tokens, drawn, node_logprobs = fed.tolist(), tokens.tolist(), logprobs.tolist()
        starts, rows = lay.positions[first[:-1]].tolist(), lay.seq_rows.tolist()
        chained = step.chained_slots or {}
        top_of = _top_rows(top)
        out: list[Emitted] = []
        kept: list[int] = []  # nodes whose slots stay: accepted paths, and the roots of sequences cut off
        released: list[int] = []  # chained decode slots of sequences cut off
        moved_rows, moved_cols, moved_nodes = [], [], []  # accepted drafts: slot-table position -> node
        later_rows, later_cols, later_slots = [], [], []  # chained tokens: slot-table position -> slot
        for item, path, start, row, root in zip(items, paths, starts, rows, roots):
            seq = item.seq
            later = chained.get(seq.seq_id)
            if seq.row == row and seq.num_cached == start + 1:
                kept += path
                # the accepted drafts move to the positions right after the root, a chained token after them
                moved_rows += [row] * (len(path) - 1)
                moved_cols += range(start + 1, start + len(path))
                moved_nodes += path[1:]
                seq.num_cached = start + len(path)
                if later is not None:
                    later_rows.append(row)
                    later_cols.append(seq.num_cached)
                    later_slots.append(later)
                    seq.num_cached += 1
            else:  # its root went with the rest of its KV
                kept.append(root)
                if later is not None:
                    released.append(later)
            tree = step.trees.get(seq.seq_id)
            emitted = [node_tokens[p] for p in path[1:]] + [drawn[path[-1]]]
            lps = [node_logprobs[p] for p in path]
            if tree is None:
                out.append(Emitted(seq, emitted, lps, item.decode, top=top_of(path)))
            else:
                rejected = bool((tree.parents == path[-1] - root).any())  # the last accepted node had children
                out.append(Emitted(seq, emitted, lps, True, tree.num_drafts, len(path) - 1, rejected, tree.source,
                                   top_of(path)))
        if moved_rows or later_rows:
            self._set_slots(np.array(moved_rows + later_rows, dtype=np.int64),
                            np.array(moved_cols + later_cols, dtype=np.int64),
                            np.concatenate([slots[moved_nodes], np.array(later_slots, dtype=np.int64)]))
        keep = np.zeros(len(slots), dtype=bool)
        keep[kept] = True
        self.pool.release(np.concatenate([slots[~keep], np.array(released, dtype=np.int64)]))
        return out

    def _fork_prompt_kv(self, leader: Sequence, fork: Sequence) -> None:
        prompt_slots = self.pool.rows_host[leader.row, : leader.num_cached]
        fork.row = self.pool.alloc_row()
        self.pool.share(prompt_slots)
        n = len(prompt_slots)
        self._set_slots(np.full(n, fork.row, dtype=np.int64), np.arange(n, dtype=np.int64), prompt_slots.copy())
        fork.num_cached = leader.num_cached
        fork.cached_tokens = fork.cached_tokens or leader.num_cached
