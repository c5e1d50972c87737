"""Runs the model on a scheduled batch: prefill steps laid out by the host, decode and verify
steps laid out on the device.

A prefill step (prompt chunks, with one decode token of every running sequence riding along)
runs eagerly: the host knows every token, position and KV slot, lays them out, and records
the prompt and the drawn tokens in the token table (spec/token_table.py). One sequence's short
chunk alone replays a CUDA graph of its token bucket (rollout/engine/prefill_graphs.py).

A decode or verify step is one device function (`run_decode`), captured as a CUDA graph per
(batch bucket, draft rows, drafting, a draft head's work, sampling mode) on the GPU. The host gives
it only the sequences' rows, KV slots from the scheduler (one per row: a root per sequence, and the step's
draft rows) and sampling parameters; everything else comes from the device: each sequence's
last token and length from the token table, its draft tree from the drafters
(spec/drafters.py, when drafting), which of the batch's drafts get the step's draft rows
(kernels/draft_rows.py), and after the forward pass and the draws, the accept walk
(kernels/tree_accept.py) writes the emitted tokens back and moves the accepted KV slots. So a
step can be launched before the one before it has been collected (the overlap schedule),
whether either drafts or not. No draft rows is plain decoding: a row per sequence, its root.
The host learns each step's tokens one step late (`collect`), and the scheduler mirrors the
slot table then (Scheduler.settle_step).

A step whose logits are edited (penalties, logit bias) or which reports top logprobs runs
eagerly; with drafts, its trees are read back before sampling, so the edits can count the
drafts above each row's node (rollout/engine/logits_processing.py).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.draft_rows import lay_out_drafts
from kernels.tree_accept import accept_trees
from rollout.engine.kv_pool import KVPool
from rollout.engine.logits_processing import LogitEdits, logit_edits
from rollout.engine.sampler import SamplingTensors, processed_logprobs, sample
from rollout.engine.sequence import Sequence
from rollout.engine.step import (
    Batch,
    BatchRows,
    DecodeInputs,
    DecodeOutputs,
    DeviceClock,
    Emitted,
    F32Row,
    HostCopy,
    I64Row,
    OutCol,
    SamplingRows,
    StepInFlight,
)
from rollout.models.config import ModelConfig
from rollout.models.llama import CausalLM, ForwardContext
from spec.drafters import DraftOrder, DraftStep
from spec.step import HeadWork, to_device
from spec.token_table import TokenTable


def sampling_tensors(i64: torch.Tensor, f32: torch.Tensor, positions: torch.Tensor, mode: str) -> SamplingTensors:
    """SamplingTensors of one draw per row: i64 [2, R] by I64Row, f32 [3, R] by F32Row, positions [R]."""
    return SamplingTensors(
        temperature=f32[F32Row.TEMPERATURE], top_p=f32[F32Row.TOP_P], min_p=f32[F32Row.MIN_P], keys=i64[I64Row.KEY],
        positions=positions, top_k=i64[I64Row.TOP_K], all_greedy=mode == "greedy", any_truncation=mode == "truncate",
    )


def rope_tables(cfg: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, computed as transformers does."""
    inv_freq = cfg.rope_inv_freq()
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, table: TokenTable, backend: AttentionBackend,
                 device: torch.device, drafters: DraftOrder):
        self.model = model
        self.pool = pool
        self.table = table
        self.backend = backend
        self.device = device
        self.drafters = drafters
        self.cos, self.sin = rope_tables(model.config, pool.max_context, device)
        drafters.attach(backend, self.cos, self.sin)
        self.graphs = None  # rollout.engine.cuda_graphs.CudaGraphs, once captured (capture_graphs)
        self.prefill_graphs = None  # rollout.engine.prefill_graphs.PrefillGraphs, likewise
        self._rows: BatchRows | None = None  # the last decode batch's

    def capture_graphs(self, attn_out: torch.Tensor, max_batch: int, capacities, step_kinds) -> int:
        """Capture a CUDA graph of every decode-step shape (rollout/engine/cuda_graphs.py); returns how many."""
        from rollout.engine.cuda_graphs import CudaGraphs

        self.graphs = CudaGraphs(self.run_decode, attn_out, self.table.padding_row, max_batch, capacities, step_kinds)
        return self.graphs.capture_all()

    def capture_prefill_graphs(self, heads: int) -> int:
        """Capture a CUDA graph of a one-sequence prefill step per token bucket (rollout/engine/prefill_graphs.py)."""
        from rollout.engine.prefill_graphs import BUCKETS, PrefillGraphs

        attn_out = torch.zeros(BUCKETS[-1], heads, self.model.config.head_dim, dtype=self.pool.dtype, device=self.device)
        self.prefill_graphs = PrefillGraphs(self.forward, self.pool.slot_table, self.table.padding_row,
                                            self.pool.max_context, attn_out)
        return self.prefill_graphs.capture_all()

    # ---------------- decode and verify steps ----------------
    @torch.inference_mode()
    def launch_decode(self, batch: Batch, slots: np.ndarray, draft_rows: int, drafting: bool,
                      head: HeadWork = HeadWork.NONE, shadow: bool = False, after: StepInFlight | None = None) -> StepInFlight:
        """Queue a decode or verify step of every sequence in `batch` on the device: its roots and
        at most `draft_rows` drafts, with the KV slots of those rows in `slots` [S + draft_rows]
        (the scheduler's); it may follow a step not yet collected (`after`: its tokens are on the
        device, not yet the host's). `drafting`: the drafter runs (draft_rows > 0 needs it; with
        none it only looks, for the statistics); `head`: a draft head's work (spec/head_drafter.py);
        `shadow`: the whole trees come back to the host."""
        seqs = batch.seqs
        s = len(seqs)
        b = self._batch_rows(batch)
        mode, top = b.sampling.mode, b.top
        clock = DeviceClock(self.device)
        plain = not b.editing and not top
        self.drafters.start_step(head)
        shape = self.graphs.shape(s, draft_rows, drafting, head, mode) if self.graphs is not None and plain else None
        if shape is not None:
            out = self.graphs.launch(shape, DecodeInputs.host_arrays(slots, b))
        else:
            inputs = DecodeInputs(*(to_device(a, self.device) for a in DecodeInputs.host_arrays(slots, b)), s, len(slots))
            edit = (lambda layout: self._edits(seqs, layout)) if b.editing else None
            # a bound of the sequences' lengths after this step (attention pads to it on the CPU): the
            # host's, plus what the step in flight and this one append
            unseen = self._appends(after.draft_rows) if after is not None else 0
            max_kv = min(max(len(q.tokens) for q in seqs) + unseen + self._appends(draft_rows), self.pool.max_context)
            out = self.run_decode(inputs, draft_rows, drafting, head, mode, edit=edit, top_logprobs=top, max_kv_len=max_kv)
        tensors = [out.ints, out.logprobs]
        if shadow and out.trees is not None:
            tensors += list(out.trees)
        if top:
            tensors += list(out.top)
        return StepInFlight(batch, draft_rows, HostCopy(tensors, clock), slots=slots, rows=b.rows, drafting=drafting,
                            shadow=shadow and out.trees is not None, top=bool(top), head=head)

    def _appends(self, draft_rows: int) -> int:
        """The most tokens a step of `draft_rows` draft rows appends to a sequence: its root's draw
        and the drafts of its tree accepted before it."""
        return 1 + min(draft_rows, self.drafters.width)

    def _batch_rows(self, batch: Batch) -> BatchRows:
        """The batch's BatchRows: kept from the last decode step while the running set is the same."""
        if batch.epoch is None or self._rows is None or self._rows.epoch != batch.epoch:
            self._rows = BatchRows.of(batch)
        return self._rows

    def run_decode(self, x: DecodeInputs, draft_rows: int, drafting: bool, head: HeadWork, mode: str, edit=None,
                   top_logprobs: int = 0, attn_out: torch.Tensor | None = None,
                   max_kv_len: int | None = None) -> DecodeOutputs:
        """The step on the device (what a CUDA graph captures): draft, choose the batch's best
        `draft_rows` drafts (kernels/draft_rows.py), lay them out, forward, draw, accept.
        `max_kv_len`: a bound of the sequences' lengths for attention's plan (None: the pool's
        context, as a graph, which serves any length, needs)."""
        table, s = self.table, x.rows.shape[0]
        rows = x.rows.long()
        length = table.lengths[rows].long()
        kv = (length - 1).clamp(min=0)
        out_pos = length - table.prompt_lens[rows].long()  # the root's draw: its output position
        step = DraftStep(table, x.rows, x.groups, kv, self.drafters.width, head)
        drafted, source = self.drafters.trees(step, drafting)
        trees = None
        if drafted is not None:
            tok, par, dep, anc, key = drafted
            trees = (tok, dep, anc, key)
        if draft_rows:
            layout = lay_out_drafts(tok, par, dep, anc, key, kv, out_pos, x.slots, draft_rows)
            par, counts, slots = layout.parents, layout.counts, layout.slots
            ids, positions, tree = layout.tokens, layout.positions, layout.tree
            st = sampling_tensors(x.sampling[:, layout.seq], x.params[:, layout.seq], layout.draw_positions, mode)
            qo_indptr, q_len = layout.qo_indptr, tok.shape[1]
        else:  # the roots alone, a row each
            layout, counts = None, torch.ones(s, dtype=torch.long, device=self.device)
            ids = table.tokens[rows, kv].long()
            tok, positions, slots, tree = ids[:, None], kv, x.slots[:, None], None
            par = torch.full((s, 1), -1, dtype=torch.long, device=self.device)
            dep = torch.zeros(s, 1, dtype=torch.long, device=self.device)
            anc = torch.ones(s, 1, dtype=torch.long, device=self.device)
            st = sampling_tensors(x.sampling, x.params, out_pos, mode)
            qo_indptr, q_len = torch.arange(s + 1, dtype=torch.int32, device=self.device), 1
        node = torch.arange(tok.shape[1], device=self.device)
        self.pool.slot_table[rows[:, None], kv[:, None] + node] = slots.to(torch.int32)  # nodes in a row, for now
        meta = AttentionMetadata(
            seq_rows=x.rows, kv_lens=(kv + counts).to(torch.int32), qo_indptr=qo_indptr,
            slot_table=self.pool.slot_table, out_slots=x.slots, tree_mask=tree, max_q_len=q_len,
            max_kv_len=max_kv_len or self.pool.max_context,
        )
        working, reader = self.drafters.working(head), self.drafters.reading(head)
        aux = None if reader is None else torch.empty(ids.shape[0], reader.aux_width, dtype=self.pool.dtype, device=self.device)
        logits = self.forward(ids, positions, meta, None, attn_out, aux)
        if edit is not None:
            edit(None if layout is None else (tok, par, layout.node_of_row)).apply(logits)
        drawn, lps = sample(logits, st)  # [R]
        states = [d.after_forward(step, drawn, aux, self._context(meta, positions)) for d in working]
        if layout is not None:
            drawn, lps = layout.nodes(drawn), layout.nodes(lps)
        out_tok, out_lp, accepted, bits = accept_trees(
            par, anc, dep, tok, drawn.view(s, -1), lps.view(s, -1), x.rows, slots, self.pool.slot_table,
            table.tokens, table.lengths, table.padding_row,
        )
        for d, state in zip(working, states):
            d.after_accept(step, state, bits, None if layout is None else layout.row_of_node, max_kv_len)
        columns = {OutCol.LENGTH: accepted, OutCol.BITS: bits, OutCol.COUNT: counts, OutCol.SOURCE: source}
        ints = torch.cat([out_tok, torch.stack([columns[c] for c in OutCol], dim=1)], dim=1)
        top = processed_logprobs(logits, st).topk(top_logprobs, dim=-1) if top_logprobs else None
        return DecodeOutputs(ints, out_lp, trees, None if top is None else (top.indices, top.values))

    def _edits(self, seqs: list[Sequence], layout) -> LogitEdits:
        """Logit edits of every row; with drafts (`layout`: tokens, parents, node of each row), read
        back first (this step is eager), each row's counts include the drafts above its node."""
        if layout is None:
            return logit_edits(seqs, [[] for _ in seqs]).to(self.device)  # (some request edits: this step was chosen for it)
        tok, par, node_of_row = (t.cpu().tolist() for t in layout)
        paths: list[list[int]] = []  # per node, flat
        for t_row, p_row in zip(tok, par):
            node_paths: list[list[int]] = [[]]
            for t, p in zip(t_row[1:], p_row[1:]):
                node_paths.append(node_paths[p] + [t] if p >= 0 else [])
            paths += node_paths
        n = len(tok[0])
        at = [min(k, len(paths) - 1) for k in node_of_row]  # (a row left over takes the last node's: it is dropped)
        return logit_edits([seqs[k // n] for k in at], [paths[k] for k in at]).to(self.device)

    # ---------------- prefill steps ----------------
    @torch.inference_mode()
    def launch_prefill(self, batch: Batch, slots: np.ndarray, positions: np.ndarray, starts: np.ndarray,
                       head: bool = False) -> StepInFlight:
        """Prompt chunks (and decode tokens riding along) in the KV slots the scheduler placed them
        (Scheduler.place_prefill: each token's slot and position, each item's start); a finished prompt
        draws for its sample and its forks, which take the prompt's tokens now. `head`: a draft
        head runs over the step's rows (else it sleeps: spec/head_watch.py HeadCycle). One
        sequence's short chunk alone replays a CUDA graph (rollout/engine/prefill_graphs.py)."""
        ids, q_lens, rows, logits_rows, draw_seqs = [], [], [], [], []
        num_tokens = 0
        for item, start in zip(batch.items, starts.tolist()):
            seq = item.seq
            ids.append(np.asarray(seq.tokens[start : start + item.num_new], dtype=np.int64))
            q_lens.append(item.num_new)
            rows.append(seq.row)
            num_tokens += item.num_new
            if item.samples:
                logits_rows.append(num_tokens - 1)
                draw_seqs += [seq, *seq.forks]
        input_ids = np.concatenate(ids)
        self.table.write(np.repeat(np.array(rows, dtype=np.int64), q_lens), positions, input_ids)
        for item in batch.items:  # forks take the finished prompt's tokens
            if item.samples and item.seq.forks:
                self.table.copy_prefix(item.seq.row, [f.row for f in item.seq.forks], item.seq.num_cached)
        work = HeadWork.PASS if head else HeadWork.NONE
        self.drafters.start_step(work)
        graphs, after = self.prefill_graphs, None
        if graphs is not None and len(rows) == 1 and graphs.bucket(num_tokens) and not self.drafters.working(work):
            logits = graphs.run(input_ids, positions, slots, rows[0], int(starts[0]))[: len(logits_rows)]
        else:
            logits, after = self._eager_prefill(batch, input_ids, slots, positions, starts, q_lens, rows, logits_rows, work)
        draw_rows = np.repeat(np.arange(len(logits_rows)), [1 + len(item.seq.forks) for item in batch.items if item.samples])
        sampling = SamplingRows.of(draw_seqs)
        out_pos = np.array([q.num_output for q in draw_seqs], dtype=np.int64)
        st = sampling_tensors(to_device(sampling.i64, self.device), to_device(sampling.f32, self.device),
                              to_device(out_pos, self.device), sampling.mode)
        logits = logits[to_device(draw_rows, self.device)]
        edits = logit_edits(draw_seqs, [[]] * len(draw_seqs))
        if edits is not None:
            edits.to(self.device).apply(logits)
        drawn, lps = sample(logits, st)
        self._record_prefill(batch, draw_seqs, drawn)
        if after is not None:
            after(drawn)
        tensors = [torch.stack([drawn.double(), lps.double()])]
        top = max((q.request.top_logprobs_num for q in draw_seqs), default=0)
        if top:
            values, ids_ = processed_logprobs(logits, st).topk(top, dim=-1)
            tensors += [ids_, values]
        return StepInFlight(batch, 0, HostCopy(tensors), top=bool(top))

    def _eager_prefill(self, batch: Batch, input_ids: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                       starts: np.ndarray, q_lens: list[int], rows: list[int], logits_rows: list[int], work: HeadWork):
        """The prefill's forward, eagerly: the logits of `logits_rows`, and what the working drafters
        do once the step drew (`after(drawn)`; None if none works)."""
        q_lens_a = np.array(q_lens, dtype=np.int32)
        meta = AttentionMetadata(
            seq_rows=to_device(np.array(rows, dtype=np.int32), self.device),
            kv_lens=to_device((starts + q_lens_a).astype(np.int32), self.device),
            qo_indptr=to_device(np.concatenate([[0], np.cumsum(q_lens_a)]).astype(np.int32), self.device),
            slot_table=self.pool.slot_table, out_slots=to_device(slots, self.device), tree_mask=None,
            max_q_len=int(q_lens_a.max()), max_kv_len=int((starts + q_lens_a).max()),
        )
        working, reader = self.drafters.working(work), self.drafters.reading(work)
        aux = None if reader is None else torch.empty(len(input_ids), reader.aux_width, dtype=self.pool.dtype,
                                                      device=self.device)
        positions_d = to_device(positions, self.device)
        logits_at = to_device(np.array(logits_rows, dtype=np.int64), self.device)
        # (with a reader of hidden states, every row's logits: the forward writes them all)
        logits = self.forward(to_device(input_ids, self.device), positions_d, meta, None if reader else logits_at, aux=aux)
        logits = logits[logits_at] if reader else logits

        def after(drawn: torch.Tensor) -> None:
            for d in working:
                d.after_prefill(batch, starts, self._context(meta, positions_d), aux, drawn, logits_rows, self.table)

        return logits, after if working else None

    def _record_prefill(self, batch: Batch, draw_seqs: list[Sequence], drawn: torch.Tensor) -> None:
        """The token table after a prefill step: every row's length, and the tokens drawn after each sampled sequence."""
        ends = [(q.row, q.num_cached + item.samples, q.num_prompt, q.key) for item in batch.items
                for q in [item.seq, *(item.seq.forks if item.samples else [])]]
        rec = np.array(ends, dtype=np.int64).reshape(-1, 4)
        lengths_now = np.array([len(q.tokens) for q in draw_seqs], dtype=np.int64)
        self.table.record_prefill(rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3], drawn,
                                  np.array([q.row for q in draw_seqs], dtype=np.int64), lengths_now)

    # ---------------- collecting ----------------
    def collect(self, step: StepInFlight) -> Emitted:
        """Wait for a launched step: what each sequence emitted (a decode step also sets `step.accepted`,
        the nodes whose KV the scheduler keeps)."""
        host = step.result.wait()
        if step.batch.is_prefill:
            return self._emit_prefill(step, host)
        if step.shadow:
            step.trees = tuple(host[2:6])
        return self._emit_decode(step, host)

    def _emit_prefill(self, step: StepInFlight, host: list[np.ndarray]) -> Emitted:
        """The first token of each finished prompt's sample and forks (in the order they were drawn),
        and the next of each decode riding along."""
        drawn, logprobs = host[0][0].astype(np.int64).tolist(), host[0][1].tolist()
        top_of = _top_rows(host[1:3] if step.top else None)
        seqs, counted = [], []
        for item in step.batch.items:
            if item.samples:
                seqs += [item.seq, *item.seq.forks]
                counted += [item.decode] * (1 + len(item.seq.forks))
        return Emitted(seqs, drawn, logprobs, counted, [0] * len(seqs),
                       top=[top_of([d]) for d in range(len(seqs))] if step.top else None,
                       overflowed=_nan_rows(host[0][1][:, None]), single=True)

    def _emit_decode(self, step: StepInFlight, host: list[np.ndarray]) -> Emitted:
        """Tokens by depth, and the nodes accepted (`step.accepted`, `step.first_row`: for
        Scheduler.settle_step). A sequence preempted since the launch keeps its tokens: they are
        right, only recomputed."""
        ints, lps = host[0], host[1]
        s, n = lps.shape
        bits, counts = ints[:, n + OutCol.BITS], ints[:, n + OutCol.COUNT]
        step.accepted = ((bits[:, None] >> np.arange(n)) & 1).astype(bool)  # [S, N]: node order is depth order
        step.first_row = np.cumsum(counts) - counts
        if n == 1:  # plain decoding: one token each
            tokens, logprobs = ints[:, 0].tolist(), lps[:, 0].tolist()
            overflowed = _nan_rows(lps)
        else:
            lengths = ints[:, n + OutCol.LENGTH].tolist()
            tokens = [row[:k] for row, k in zip(ints[:, :n].tolist(), lengths)]
            logprobs = [row[:k] for row, k in zip(lps.tolist(), lengths)]
            overflowed = _nan_rows(np.where(np.arange(n) < ints[:, n + OutCol.LENGTH, None], lps, 0.0))
        top = None
        if step.top:  # by row: a sequence's accepted nodes are rows from its first on
            top_of, first = _top_rows(host[-2:]), step.first_row.tolist()
            top = [top_of([first[i] + j for j in _path(bits[i], k)]) for i, k in enumerate(lengths if n > 1 else [1] * s)]
        codes = ints[:, n + OutCol.SOURCE]
        names = self.drafters.source_names
        sources = [names[c] for c in codes.tolist()] if n > 1 else None  # (a sequence's drafter: read only where it drafted)
        misses, coupled = self.drafters.counts(codes, step.drafting)
        return Emitted(step.batch.seqs, tokens, logprobs, [True] * s, (counts - 1).tolist(), sources, top, index_misses=misses,
                       coupled=coupled, overflowed=overflowed, single=n == 1)

    # ---------------- the model ----------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: torch.Tensor | None, attn_out: torch.Tensor | None = None,
                aux: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [L, vocab] float32 for `logits_rows` of the tokens (None: all); `aux`: the
        hidden states entering the draft head's layers are written there (spec/head_drafter.py)."""
        self.backend.plan(meta)
        ctx = self._context(meta, positions, attn_out)
        if aux is not None:
            ctx.aux_layers, ctx.aux_hidden = self.drafters.reader.aux_layers, aux
        return self.model(input_ids, ctx, logits_rows)

    def _context(self, meta: AttentionMetadata, positions: torch.Tensor, attn_out: torch.Tensor | None = None) -> ForwardContext:
        return ForwardContext(meta, self.backend, self.pool.k_caches, self.pool.v_caches,
                              self.cos[positions], self.sin[positions], attn_out)

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they hold the addresses of the weights and the KV pool; prefill
        graphs are captured again as their buckets are next used)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.clear()


def _path(bits: int, length: int) -> list[int]:
    """The accepted nodes, root first (set bits in index order)."""
    return [j for j in range(64) if (int(bits) >> j) & 1][:length]


def _top_rows(top) -> callable:
    """Per draw index list: the (ids, logprobs) lists of those draws' most likely tokens, or None."""
    if top is None:
        return lambda draws: None
    ids, values = top[0].tolist(), top[1].tolist()
    return lambda draws: [(ids[d], values[d]) for d in draws]


def _nan_rows(logprobs: np.ndarray) -> list[int] | None:
    """The rows of [S, N] emitted logprobs that hold a NaN (None if none): a forward that overflowed
    (an inf in the hidden state is a NaN once normed, and a NaN logit a NaN log-softmax)."""
    bad = np.isnan(logprobs).any(axis=1)
    return np.flatnonzero(bad).tolist() if bad.any() else None
