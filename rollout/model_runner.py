"""Turns a scheduled batch into tensors, runs the model, draws tokens, verifies draft trees.

Host work per step: lay out the new tokens of every sequence (prefill chunk, decode token,
or draft tree) and give them KV slots (`StepLayout`), upload that in two copies, run the
model (a captured CUDA graph for decode and verify steps on the GPU), draw every token
needed in one sampling pass, and copy the results back once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.torch_attention import CPU_GEMM_MIN_ROWS
from rollout.kv_pool import KVPool
from rollout.model_config import ModelConfig
from rollout.models.llama import CausalLM, ForwardContext
from rollout.sampler import SamplingTensors, sample
from rollout.scheduler import Batch
from rollout.sequence import Sequence
from spec.tree import DraftTree
from spec.verify import accept_path


@dataclass
class Emitted:
    """What one sequence produced in a step (before stop-condition truncation)."""

    seq: Sequence
    tokens: list[int]
    logprobs: list[float]
    decode: bool  # a decode/verify step (counts toward accept length), not a prefill's first token
    drafted: int = 0
    accepted: int = 0
    source: str = ""


@dataclass
class StepLayout:
    """The host-side arrays of one forward step."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    out_slots: np.ndarray  # [T] int64
    tree_mask: np.ndarray | None  # [T] int64, None = causal
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

    @staticmethod
    def of(draws: list[tuple[Sequence, int, int]]) -> "DrawInputs":
        params = [d[0].request.params for d in draws]
        i64 = np.array([[d[1], d[0].key, d[2], p.top_k] for d, p in zip(draws, params)], dtype=np.int64).reshape(-1, 4)
        f32 = np.array([[p.temperature, p.top_p, p.min_p] for p in params], dtype=np.float32).reshape(-1, 3)
        if all(p.temperature == 0 for p in params):
            mode = "greedy"
        elif any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            mode = "truncate"
        else:
            mode = "sample"
        return DrawInputs(np.ascontiguousarray(i64.T), np.ascontiguousarray(f32.T), mode)

    def tensors(self, i64: torch.Tensor, f32: torch.Tensor) -> SamplingTensors:
        """SamplingTensors over device copies of i64 [4, S] and f32 [3, S]."""
        return SamplingTensors(
            temperature=f32[0], top_p=f32[1], min_p=f32[2], keys=i64[1], positions=i64[2], top_k=i64[3],
            all_greedy=self.mode == "greedy", any_truncation=self.mode == "truncate",
        )


class DeviceStep:
    """A layout on the device: int64 and int32 fields, each group moved in one copy."""

    def __init__(self, lay: StepLayout, device: torch.device):
        mask = lay.tree_mask if lay.tree_mask is not None else np.zeros(0, dtype=np.int64)
        qo_indptr = np.zeros(len(lay.q_lens) + 1, dtype=np.int32)
        np.cumsum(lay.q_lens, out=qo_indptr[1:])
        i64 = _to_device(np.concatenate([lay.input_ids, lay.positions, lay.out_slots, mask, lay.logits_rows]), device)
        i32 = _to_device(np.concatenate([lay.seq_rows, lay.kv_lens, qo_indptr]), device)
        t, b = lay.num_tokens, len(lay.seq_rows)
        self.input_ids, self.positions, self.out_slots = i64[:t], i64[t : 2 * t], i64[2 * t : 3 * t]
        self.tree_mask = i64[3 * t : 4 * t] if lay.tree_mask is not None else None
        self.logits_rows = i64[3 * t + len(mask) :]
        self.seq_rows, self.kv_lens, self.qo_indptr = i32[:b], i32[b : 2 * b], i32[2 * b :]
        self.max_q_len = int(lay.q_lens.max()) if b else 0
        self.max_kv_len = int(lay.kv_lens.max()) if b else 0


class HostCopy:
    """The step's results on their way to the host: one asynchronous copy, waited for once."""

    def __init__(self, out: torch.Tensor):  # [2, n] float64: drawn tokens, their logprobs
        self.event = None
        if out.is_cuda:
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = out

    @property
    def overlaps_host(self) -> bool:
        """Whether the device works while the host goes on (CUDA); on CPU the step is done at launch."""
        return self.event is not None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        if self.event is not None:
            self.event.synchronize()  # the step's one intended host sync
        out = self.host.numpy()
        return out[0].astype(np.int64), out[1]


@dataclass
class StepInFlight:
    """A launched step: what `collect` needs once the device is done."""

    batch: Batch
    trees: dict[int, DraftTree]
    item_slots: list[np.ndarray]
    draws: list[tuple[Sequence, int, int]]
    result: HostCopy


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


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
        # Pad CPU steps (tokens and logits rows) to the row count from which BLAS rounding no
        # longer depends on the step's shape; see kernels/torch_attention.py.
        self.min_tokens = CPU_GEMM_MIN_ROWS if device.type == "cpu" else 1
        self.graphs = None
        if cuda_graphs:
            from rollout.cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs(self, pool.free_rows, max_graph_tokens, max_tree_tokens)
        self._dirty_rows: list[np.ndarray] = []  # slot-table entries changed on the host since the last commit
        self._dirty_cols: list[np.ndarray] = []

    def _set_row(self, row: int, start: int, slots: np.ndarray) -> None:
        self.pool.rows_host[row, start : start + len(slots)] = slots
        self._dirty_rows.append(np.full(len(slots), row, dtype=np.int64))
        self._dirty_cols.append(np.arange(start, start + len(slots), dtype=np.int64))

    def _commit_rows(self) -> None:
        if self._dirty_rows:
            self.pool.commit_rows(np.concatenate(self._dirty_rows), np.concatenate(self._dirty_cols))
            self._dirty_rows, self._dirty_cols = [], []

    def run(self, batch: Batch, trees: dict[int, DraftTree]) -> list[Emitted]:
        """Run one step. `trees` maps seq_id to its draft tree (decode items only; root = last token)."""
        return self.collect(self.launch(batch, trees))

    @torch.inference_mode()
    def launch(self, batch: Batch, trees: dict[int, DraftTree]) -> StepInFlight:
        """Lay out, upload and queue the step on the device; returns without waiting for it."""
        lay, draws, item_slots = self._layout(batch, trees)
        self._commit_rows()
        inputs = DrawInputs.of(draws)
        shape = None
        if self.graphs is not None and not batch.is_prefill:  # one draw per logits row, in order
            shape = self.graphs.shape(lay, inputs.mode)
        if shape is not None:
            out = self.graphs.launch(lay, inputs, shape)
        else:
            logits = self.forward(DeviceStep(self._pad_for_cpu(lay), self.device))
            out = self._sample(logits, inputs)
        return StepInFlight(batch, trees, item_slots, draws, HostCopy(out))

    def collect(self, step: StepInFlight) -> list[Emitted]:
        """Wait for a launched step and apply what it produced to the sequences' KV bookkeeping."""
        tokens, logprobs = step.result.wait()
        return self._emit(step.batch, step.trees, step.item_slots, step.draws, tokens, logprobs)

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

    def _layout(self, batch: Batch, trees: dict[int, DraftTree]):
        if not trees and not batch.is_prefill:
            return self._decode_layout(batch)
        ids, positions, out_slots, kv_lens, q_lens, masks = [], [], [], [], [], []
        logits_rows: list[int] = []
        draws: list[tuple[Sequence, int, int]] = []  # (sequence, logits row, output position) per draw
        item_slots: list[np.ndarray] = []
        num_tokens = 0
        for item in batch.items:
            seq, start = item.seq, item.seq.num_cached
            tree = trees.get(seq.seq_id)
            if tree is not None:
                new_ids, depths = tree.tokens, tree.depths()
                masks.append(tree.ancestor_mask())
            else:
                new_ids = np.asarray(seq.tokens[start : start + item.num_new], dtype=np.int64)
                depths = np.arange(len(new_ids))
                masks.append(np.ones(1, dtype=np.int64))  # read only in tree steps, where n == 1
            n = len(new_ids)
            slots = self.pool.alloc(n)
            self._set_row(seq.row, start, slots)
            item_slots.append(slots)
            ids.append(new_ids)
            positions.append(start + depths)
            out_slots.append(slots)
            kv_lens.append(start + n)
            q_lens.append(n)
            if tree is not None:  # every node predicts the token after it
                for node, depth in enumerate(depths):
                    draws.append((seq, len(logits_rows), seq.num_output + int(depth)))
                    logits_rows.append(num_tokens + node)
            elif item.samples:  # the last token predicts; siblings draw their first token from it too
                logits_rows.append(num_tokens + n - 1)
                for s in [seq, *seq.forks]:
                    draws.append((s, len(logits_rows) - 1, s.num_output))
            num_tokens += n
        use_tree_mask = any(t.num_drafts for t in trees.values())
        lay = StepLayout(
            input_ids=np.concatenate(ids).astype(np.int64),
            positions=np.concatenate(positions).astype(np.int64),
            out_slots=np.concatenate(out_slots).astype(np.int64),
            tree_mask=np.concatenate(masks) if use_tree_mask else None,
            seq_rows=np.array([item.seq.row for item in batch.items], dtype=np.int32),
            kv_lens=np.array(kv_lens, dtype=np.int32),
            q_lens=np.array(q_lens, dtype=np.int32),
            logits_rows=np.array(logits_rows, dtype=np.int64),
        )
        return lay, draws, item_slots

    def _decode_layout(self, batch: Batch):
        """The common step, vectorised: every sequence feeds its last token and draws the next."""
        seqs = [item.seq for item in batch.items]
        n = len(seqs)
        starts = np.fromiter((s.num_cached for s in seqs), dtype=np.int64, count=n)
        rows = np.fromiter((s.row for s in seqs), dtype=np.int32, count=n)
        slots = self.pool.alloc(n)
        self.pool.rows_host[rows, starts] = slots
        self._dirty_rows.append(rows.astype(np.int64))
        self._dirty_cols.append(starts)
        lay = StepLayout(
            input_ids=np.fromiter((s.tokens[-1] for s in seqs), dtype=np.int64, count=n),
            positions=starts,
            out_slots=slots.astype(np.int64),
            tree_mask=None,
            seq_rows=rows,
            kv_lens=(starts + 1).astype(np.int32),
            q_lens=np.ones(n, dtype=np.int32),
            logits_rows=np.arange(n, dtype=np.int64),
        )
        draws = [(s, i, s.num_output) for i, s in enumerate(seqs)]
        return lay, draws, [slots[i : i + 1] for i in range(n)]

    def _pad_for_cpu(self, lay: StepLayout) -> StepLayout:
        """On the CPU, at least CPU_GEMM_MIN_ROWS tokens and logits rows (see __init__)."""
        if lay.num_tokens >= self.min_tokens and len(lay.logits_rows) >= self.min_tokens:
            return lay
        extra = max(0, self.min_tokens - lay.num_tokens)
        num_seqs = len(lay.seq_rows) + (1 if extra else 0)
        num_logits = max(self.min_tokens, len(lay.logits_rows))
        padded = lay.padded(num_seqs, lay.num_tokens + extra, num_logits, self.pool.padding_row)
        if extra:  # the padding tokens form one causal sequence on the all-zero row
            padded.kv_lens[-1] = padded.q_lens[-1] = extra
            if padded.tree_mask is not None:
                padded.tree_mask[-extra:] = np.left_shift(np.int64(1), np.arange(extra, dtype=np.int64)).cumsum()
        return padded

    def _sample(self, logits: torch.Tensor, inputs: DrawInputs) -> torch.Tensor:
        """[2, S] float64 on the device: drawn tokens and their logprobs."""
        if inputs.i64.shape[1] == 0:
            return torch.zeros(2, 0, dtype=torch.float64, device=self.device)
        i64, f32 = _to_device(inputs.i64, self.device), _to_device(inputs.f32, self.device)
        tokens, logprobs = sample(logits[i64[0]], inputs.tensors(i64, f32))
        return torch.stack([tokens.double(), logprobs.double()])

    def _emit(self, batch, trees, item_slots, draws, tokens, logprobs) -> list[Emitted]:
        by_seq: dict[int, list[int]] = {}  # seq_id -> its draw indices, in row order
        for i, (seq, _, _) in enumerate(draws):
            by_seq.setdefault(seq.seq_id, []).append(i)
        out: list[Emitted] = []
        for item, slots in zip(batch.items, item_slots):
            seq, start = item.seq, item.seq.num_cached
            tree = trees.get(seq.seq_id)
            if tree is None:
                seq.num_cached = start + item.num_new
                if item.samples:
                    for fork in seq.forks:
                        self._fork_prompt_kv(seq, fork)
                    for s in [seq, *seq.forks]:
                        (i,) = by_seq[s.seq_id]
                        out.append(Emitted(s, [int(tokens[i])], [float(logprobs[i])], item.decode))
                continue
            idx = by_seq[seq.seq_id]
            path, bonus = accept_path(tree, tokens[idx])
            kept = slots[path]
            self._set_row(seq.row, start, kept)
            rejected = np.ones(len(slots), dtype=bool)
            rejected[path] = False
            self.pool.release(slots[rejected])
            seq.num_cached = start + len(path)
            emitted = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
            out.append(
                Emitted(
                    seq, emitted, [float(logprobs[idx[p]]) for p in path], True, tree.num_drafts, len(path) - 1, tree.source
                )
            )
        return out

    def _fork_prompt_kv(self, leader: Sequence, fork: Sequence) -> None:
        prompt_slots = self.pool.rows_host[leader.row, : leader.num_cached]
        fork.row = self.pool.alloc_row()
        self.pool.share(prompt_slots)
        self._set_row(fork.row, 0, prompt_slots.copy())
        fork.num_cached = leader.num_cached
