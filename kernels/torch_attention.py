"""Reference attention in plain torch: pad every sequence, build a dense mask, two matmuls per KV
head over its query heads.

Slow but obviously correct on any device; CI runs it on the CPU and every fast backend is
held to it on random inputs. It is also batch-invariant on the CPU: it computes in
float64, so a row's result does not depend on the step's shape (with the linear layers in
equal row blocks, kernels/skinny_gemm.py), and a draft-tree verify step reproduces plain
decoding to the last bit.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata


def dense_mask(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (seq_of_token [T'], index_in_seq [T'], allowed [T', max_kv_len] bool) for the T' tokens
    that belong to a sequence (the first qo_indptr[-1]; a step's rows past them are left over)."""
    device = meta.seq_rows.device
    qo = meta.qo_indptr.long()
    q_lens = qo[1:] - qo[:-1]
    num_tokens = int(qo[-1])  # (a host sync: this is the reference)
    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), q_lens, output_size=num_tokens)
    index_in_seq = torch.arange(num_tokens, device=device) - qo[seq_of_token]
    num_cached = (meta.kv_lens.long() - q_lens)[seq_of_token]  # [T]
    cols = torch.arange(meta.max_kv_len, device=device)[None, :]  # [1, max_kv]
    new_index = cols - num_cached[:, None]  # [T, max_kv]: index among the new tokens, <0 for cached
    in_seq = new_index < q_lens[seq_of_token][:, None]
    if meta.tree_mask is None:
        among_new = new_index <= index_in_seq[:, None]
    else:
        bit = torch.bitwise_right_shift(meta.tree_mask[:num_tokens, None], new_index.clamp(0, 63)) & 1
        among_new = bit.bool()
    allowed = in_seq & ((new_index < 0) | among_new)
    return seq_of_token, index_in_seq, allowed


class TorchAttention:
    def plan(self, meta: AttentionMetadata) -> None:
        longest = int(meta.kv_lens.max()) if meta.num_seqs else 0
        if longest > meta.max_kv_len:  # keys past the bound would be dropped without a word
            raise ValueError(f"a sequence's {longest} keys exceed the step's bound max_kv_len={meta.max_kv_len}")
        seq_of_token, index_in_seq, allowed = dense_mask(meta)
        q_rows = meta.max_q_len
        mask = torch.zeros(meta.num_seqs, q_rows, meta.max_kv_len, dtype=torch.bool, device=allowed.device)
        mask[:, :, 0] = True  # padded query rows see one key, so softmax stays finite
        mask[seq_of_token, index_in_seq] = allowed
        cols = torch.arange(meta.max_kv_len, device=allowed.device)
        valid = cols[None, :] < meta.kv_lens.long()[:, None]
        slots = meta.slot_table[meta.seq_rows.long(), : meta.max_kv_len].long()
        self._slots = torch.where(valid, slots, 0)  # [B, max_kv]
        self._mask = mask[:, None]  # [B, 1, q_rows, max_kv]
        self._q_rows = q_rows
        self._seq_of_token = seq_of_token
        self._index_in_seq = index_in_seq

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        k_cache.index_copy_(0, meta.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_slots, v.to(v_cache.dtype))
        return self.attend(q, k_cache, v_cache, meta, scale, out)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        num_seqs, rows, (num_heads, head_dim), kv_heads = meta.num_seqs, self._q_rows, q.shape[1:], k_cache.shape[1]
        group = num_heads // kv_heads
        # In float64 throughout: BLAS picks its kernel, and the softmax its vector grouping, by the
        # shape (query rows, key count), so their rounding varies from step to step; the extra
        # precision absorbs that, and steps of different shapes agree to the last bit.
        q_pad = torch.zeros(num_seqs, rows, num_heads, head_dim, dtype=torch.float64, device=q.device)
        q_pad[self._seq_of_token, self._index_in_seq] = q[: len(self._seq_of_token)].double()
        # the query heads of a KV head (h // group) together, [B, kv_heads, group * rows, head_dim]:
        # each KV head's keys are read once, not copied for each of its query heads
        q_grouped = q_pad.view(num_seqs, rows, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q_grouped = q_grouped.reshape(num_seqs, kv_heads, group * rows, head_dim)
        keys = k_cache[self._slots].to(q.dtype).double().permute(0, 2, 3, 1)  # [B, kv_heads, head_dim, max_kv]
        values = v_cache[self._slots].to(q.dtype).double().transpose(1, 2)  # [B, kv_heads, max_kv, head_dim]
        scores = (torch.matmul(q_grouped, keys) * scale).view(num_seqs, kv_heads, group, rows, -1)
        probs = scores.masked_fill(~self._mask[:, :, None], float("-inf")).softmax(dim=-1)
        result = torch.matmul(probs.view(num_seqs, kv_heads, group * rows, -1), values)
        result = result.view(num_seqs, kv_heads, group, rows, head_dim).permute(0, 3, 1, 2, 4)
        result = result.reshape(num_seqs, rows, num_heads, head_dim)[self._seq_of_token, self._index_in_seq].to(q.dtype)
        if len(result) < len(q):  # rows left over: zeros
            result = torch.cat([result, result.new_zeros(len(q) - len(result), num_heads, head_dim)])
        return result if out is None else out.copy_(result)
