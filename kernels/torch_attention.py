"""Reference attention in plain torch: pad every sequence, build a dense mask, call SDPA.

Slow but obviously correct on any device; CI runs it on the CPU and every fast backend is
held to it on random inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata


def dense_mask(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (seq_of_token [T], index_in_seq [T], allowed [T, max_kv_len] bool)."""
    device = meta.seq_rows.device
    qo = meta.qo_indptr.long()
    q_lens = qo[1:] - qo[:-1]
    num_tokens = int(meta.out_slots.shape[0])
    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), q_lens, output_size=num_tokens)
    index_in_seq = torch.arange(num_tokens, device=device) - qo[seq_of_token]
    num_cached = (meta.kv_lens.long() - q_lens)[seq_of_token]  # [T]
    cols = torch.arange(meta.max_kv_len, device=device)[None, :]  # [1, max_kv]
    new_index = cols - num_cached[:, None]  # [T, max_kv]: index among the new tokens, <0 for cached
    in_seq = new_index < q_lens[seq_of_token][:, None]
    if meta.tree_mask is None:
        among_new = new_index <= index_in_seq[:, None]
    else:
        bit = torch.bitwise_right_shift(meta.tree_mask[:, None], new_index.clamp(0, 63)) & 1
        among_new = bit.bool()
    allowed = in_seq & ((new_index < 0) | among_new)
    return seq_of_token, index_in_seq, allowed


class TorchAttention:
    def plan(self, meta: AttentionMetadata) -> None:
        seq_of_token, index_in_seq, allowed = dense_mask(meta)
        num_seqs, max_q = meta.num_seqs, meta.max_q_len
        mask = torch.zeros(num_seqs, max_q, meta.max_kv_len, dtype=torch.bool, device=allowed.device)
        mask[:, :, 0] = True  # padded query rows see one key, so softmax stays finite
        mask[seq_of_token, index_in_seq] = allowed
        cols = torch.arange(meta.max_kv_len, device=allowed.device)
        valid = cols[None, :] < meta.kv_lens.long()[:, None]
        slots = meta.slot_table[meta.seq_rows.long(), : meta.max_kv_len].long()
        self._slots = torch.where(valid, slots, 0)  # [B, max_kv]
        self._mask = mask[:, None]  # [B, 1, max_q, max_kv]
        self._seq_of_token = seq_of_token
        self._index_in_seq = index_in_seq

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache.index_copy_(0, meta.out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.out_slots, v.to(v_cache.dtype))
        num_heads, head_dim = q.shape[1], q.shape[2]
        q_pad = q.new_zeros(meta.num_seqs, meta.max_q_len, num_heads, head_dim)
        q_pad[self._seq_of_token, self._index_in_seq] = q
        keys = k_cache[self._slots].to(q.dtype)  # [B, max_kv, num_kv_heads, head_dim]
        values = v_cache[self._slots].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self._mask,
            scale=scale,
            enable_gqa=True,
        )  # [B, num_heads, max_q, head_dim]
        return out.transpose(1, 2)[self._seq_of_token, self._index_in_seq]
