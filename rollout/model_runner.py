"""Turns a scheduled batch into tensors, runs the model, draws tokens, verifies draft trees.

Host work per step: lay out the new tokens of every sequence (prefill chunk, decode token,
or draft tree), give them KV slots, plan attention once; then one forward, one sampling
pass over every row that needs a token, and one copy of the results back to the host.
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


def rope_tables(cfg: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in float32, computed as transformers does."""
    inv_freq = cfg.rope_inv_freq()
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend, device: torch.device):
        self.model = model
        # Pad CPU steps (tokens and logits rows) to the row count from which BLAS rounding no
        # longer depends on the step's shape; see kernels/torch_attention.py.
        self.min_tokens = CPU_GEMM_MIN_ROWS if device.type == "cpu" else 1
        self.pool = pool
        self.backend = backend
        self.device = device
        self.cos, self.sin = rope_tables(model.config, pool.max_context, device)
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

    @torch.inference_mode()
    def run(self, batch: Batch, trees: dict[int, DraftTree]) -> list[Emitted]:
        """Run one step. `trees` maps seq_id to its draft tree (decode items only; root = last token)."""
        ids, positions, out_slots, kv_lens, q_lens, masks = [], [], [], [], [], []
        logits_rows: list[int] = []  # token row of each logits row
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
        if num_tokens < self.min_tokens:  # a padding sequence on the all-zero row: slot 0 only
            pad = self.min_tokens - num_tokens
            ids.append(np.zeros(pad, dtype=np.int64))
            positions.append(np.zeros(pad, dtype=np.int64))
            out_slots.append(np.zeros(pad, dtype=np.int64))
            masks.append(np.left_shift(np.int64(1), np.arange(pad, dtype=np.int64)).cumsum())
            kv_lens.append(pad)
            q_lens.append(pad)
        self._commit_rows()

        dev = self.device
        use_tree_mask = bool(trees) and any(len(t.tokens) > 1 for t in trees.values())
        qo_indptr = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qo_indptr[1:])
        seq_rows = np.array([item.seq.row for item in batch.items], dtype=np.int32)
        if len(q_lens) > len(batch.items):
            seq_rows = np.append(seq_rows, np.int32(self.pool.padding_row))
        meta = AttentionMetadata(
            seq_rows=torch.from_numpy(seq_rows).to(dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            qo_indptr=torch.from_numpy(qo_indptr).to(dev),
            slot_table=self.pool.slot_table,
            out_slots=torch.from_numpy(np.concatenate(out_slots).astype(np.int64)).to(dev),
            tree_mask=torch.from_numpy(np.concatenate(masks)).to(dev) if use_tree_mask else None,
            max_q_len=max(q_lens),
            max_kv_len=max(kv_lens),
        )
        self.backend.plan(meta)
        pos = torch.from_numpy(np.concatenate(positions).astype(np.int64)).to(dev)
        ctx = ForwardContext(meta, self.backend, self.pool.k_caches, self.pool.v_caches, self.cos[pos], self.sin[pos])
        input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64)).to(dev)
        padded_rows = logits_rows + [0] * (self.min_tokens - len(logits_rows))  # the lm_head matmul too
        logits = self.model(input_ids, ctx, torch.tensor(padded_rows, dtype=torch.int64, device=dev))

        tokens, logprobs = self._sample(logits, draws)
        return self._emit(batch, trees, item_slots, draws, tokens, logprobs)

    def _sample(self, logits: torch.Tensor, draws: list[tuple[Sequence, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        if not draws:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        dev = self.device
        params = [d[0].request.params for d in draws]
        st = SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev),
            keys=torch.tensor([d[0].key for d in draws], dtype=torch.int64, device=dev),
            positions=torch.tensor([d[2] for d in draws], dtype=torch.int64, device=dev),
            all_greedy=all(p.temperature == 0 for p in params),
            any_truncation=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        )
        rows = torch.tensor([d[1] for d in draws], dtype=torch.int64, device=dev)
        tokens, logprobs = sample(logits[rows], st)
        return tokens.cpu().numpy(), logprobs.cpu().numpy()

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
            rejected = np.setdiff1d(slots, kept, assume_unique=True)
            self.pool.release(rejected)
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
