"""How a Llama-family model splits over tensor-parallel ranks (Megatron's layout, as SGLang's).

Each rank holds its share of the attention heads and of the MLP's intermediate size, and of every
expert's in a mixture of experts (the fused q/k/v and gate/up projections column-parallel; o and
down row-parallel, each followed by one all-reduce, which the next norm does: `Shard.reduce_norm`)
and a contiguous slice of the
vocabulary (embedding and LM head). KV heads split like the query heads; with more ranks than KV
heads, each rank holds the one KV head its query heads read (replicated, SGLang's rule). Norms are
replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import fused
from rollout.models.config import ModelConfig


class Collectives(Protocol):
    """What the model needs of the ranks' group (rollout/engine/tensor_parallel.py)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None, round_once: bool) -> tuple[torch.Tensor, torch.Tensor]: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...  # [L, V] of each rank -> [L, size * V], rank order


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    group: Collectives | None = None  # None: one rank

    @staticmethod
    def check(cfg: ModelConfig, size: int, what: str = "the model") -> None:
        """Raise ValueError, naming the sizes, unless `cfg` (`what`: the model, or its draft head) splits over `size` ranks."""
        if size < 1:
            raise ValueError(f"tp_size must be >= 1 (got {size})")
        problems = []
        if cfg.num_heads % size:
            problems.append(f"its {cfg.num_heads} attention heads")
        kv = cfg.num_kv_heads
        if (kv >= size and kv % size) or (kv < size and size % kv):
            problems.append(f"its {kv} KV heads (split when tp_size divides them, replicated when they divide tp_size)")
        if cfg.intermediate_size % size:
            problems.append(f"its intermediate size {cfg.intermediate_size}")
        if cfg.num_experts and cfg.moe_intermediate_size % size:
            problems.append(f"its experts' intermediate size {cfg.moe_intermediate_size}")
        if problems:
            raise ValueError(f"{what} does not split over tp_size {size}: {size} does not fit " + "; ".join(problems))

    @property
    def alone(self) -> bool:
        return self.size == 1

    def heads(self, cfg: ModelConfig) -> int:
        return cfg.num_heads // self.size

    def kv_heads(self, cfg: ModelConfig) -> int:
        return max(1, cfg.num_kv_heads // self.size)

    def first_kv_head(self, cfg: ModelConfig) -> int:
        if cfg.num_kv_heads >= self.size:
            return self.rank * self.kv_heads(cfg)
        return self.rank * cfg.num_kv_heads // self.size  # the KV head of this rank's query heads

    def intermediate(self, cfg: ModelConfig) -> int:
        return cfg.intermediate_size // self.size

    def expert_intermediate(self, cfg: ModelConfig) -> int:
        """Each expert's share of its width on this rank (every rank holds every expert's share)."""
        return cfg.moe_intermediate_size // self.size

    def vocab_rows(self, cfg: ModelConfig) -> int:
        """Embedding and LM-head rows per rank: the vocabulary padded to a multiple of the ranks."""
        return -(-cfg.vocab_size // self.size)

    def vocab_slice(self, cfg: ModelConfig) -> slice:
        """The token ids this rank's rows stand for (the last rank's may be fewer than its rows)."""
        rows = self.vocab_rows(cfg)
        return slice(min(self.rank * rows, cfg.vocab_size), min((self.rank + 1) * rows, cfg.vocab_size))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_gather(x)

    def reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    out_dtype: torch.dtype | None = None, round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x summed over the ranks + residual), that sum): a row-parallel product's
        parts into the next norm (on the GPU one kernel: kernels/all_reduce_norm.py). The sum
        keeps the residual's dtype, the norm is rounded to `out_dtype` (default x's)."""
        if self.group is None:
            return fused.rms_norm(x, weight, eps, residual, out_dtype, round_once)
        return self.group.all_reduce_norm(x, residual, weight, eps, out_dtype, round_once)


ALONE = Shard()
