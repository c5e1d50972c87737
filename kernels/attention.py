"""Attention over the token-granular paged KV cache: the metadata every backend reads.

The KV cache is one pool of slots per layer, `k_cache[num_slots, num_kv_heads, head_dim]`.
A sequence owns a row of the slot table; the KV of sequence b is
`k_cache[slot_table[seq_rows[b], :kv_lens[b]]]`: its cached tokens, then this step's new
tokens. A layer first writes the new tokens' K/V at `out_slots` (`forward` does both; the model
writes them in its fused RoPE kernel and calls `attend`), then attends.

Within the new tokens, attention is causal (prefill chunks, plain decode) or follows a
draft tree (`tree_mask`): bit j of `tree_mask[t]` says query t may attend the j-th new
token of its own sequence (its ancestors and itself). Trees hold at most 64 tokens.
Every query attends to all of its sequence's cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

MAX_TREE_TOKENS = 64


@dataclass
class AttentionMetadata:
    """Planned once per forward step on the host; read by every layer."""

    seq_rows: torch.Tensor  # [B] int32: row of each sequence in slot_table
    kv_lens: torch.Tensor  # [B] int32: cached + new tokens of each sequence
    qo_indptr: torch.Tensor  # [B+1] int32: new tokens of b are rows qo_indptr[b]:qo_indptr[b+1]
    slot_table: torch.Tensor  # [max_rows, max_context] int32, owned by the KV pool
    out_slots: torch.Tensor  # [T] int64: slot receiving each new token's K/V
    tree_mask: torch.Tensor | None  # [T] int64 bitmask over own sequence's new tokens; None = causal
    max_q_len: int  # host-side bounds, so backends never read them back from the device
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_rows.shape[0]


class AttentionBackend(Protocol):
    """One object per engine; `plan` once per step, `forward` once per layer."""

    def plan(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim] to write into; allocated when None
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at meta.out_slots, then `attend`."""
        ...

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # this step's K/V already written (the model fuses that into RoPE)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ...

