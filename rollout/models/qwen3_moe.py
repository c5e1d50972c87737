"""Qwen3-MoE: the Qwen3 decoder whose sparse layers' MLP is a mixture of experts.

A token's router logits (the hidden state times `mlp.gate.weight`) go through a float32 softmax over
the experts; it takes the `num_experts_per_tok` likeliest, their weights renormalised to sum to one
when `norm_topk_prob`, and its output is the weighted sum of those experts' SiLU MLPs, as
transformers computes it. The layers in `mlp_only_layers`, and those off the `decoder_sparse_step`,
keep the dense MLP (ModelConfig.sparse_layers).

The experts' weights are stacked: gate and up fused per expert, [experts, 2 x width, hidden], and
down [experts, hidden, width]; a checkpoint's or a trainer's per-expert tensors
(`mlp.experts.{e}.{gate,up,down}_proj.weight`) land in their expert's slice, and transformers 5's
stacked ones (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) whole. Under tensor parallelism
each rank holds every expert's share of the width (as the dense MLP's) and its output is its part,
summed by the next norm's all-reduce: one all-reduce a layer.

The experts run in kernels/fused_moe.py: on the GPU fused Triton kernels that read only the
experts a step's rows took, elsewhere its torch reference (every expert over every row).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_moe
from rollout.models.config import ModelConfig
from rollout.models.llama import CausalLM, Linear, WeightTarget, gate_up_down_targets
from rollout.models.sharding import Shard


class SparseMoE(nn.Module):
    # its output's one consumer is the residual add + norm, which may take each row's picks and sum them
    # (fused_moe.experts' `into_sum`): a decoder layer's at one rank
    into_sum = False

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        width = shard.expert_intermediate(cfg)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router (every rank's whole)
        self.gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * width, cfg.hidden_size))  # [E, 2 x width, hidden]
        self.down = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, width))  # [E, hidden, width]

    def block(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of the experts' output for the normalised hidden states `h` [T, hidden]."""
        invariant = self.gate.batch_invariant  # (CausalLM.make_batch_invariant sets it on every Linear)
        return fused_moe.layer(h, self.gate.weight, self.gate_up, self.down, self.top_k, self.norm_topk_prob,
                               invariant=invariant, into_sum=self.into_sum)

    def targets(self, prefix: str, cfg: ModelConfig, sh: Shard) -> dict[str, WeightTarget]:
        """The router, each expert's tensors by the checkpoint's names, and the layer's experts stacked as
        transformers 5 holds them (what its `named_parameters()` push: `experts.gate_up_proj`
        [E, 2 x width, hidden], gate rows then up rows, and `experts.down_proj` [E, hidden, width])."""
        width, experts = cfg.moe_intermediate_size, cfg.num_experts
        targets = {prefix + "gate.weight": WeightTarget(self.gate.weight)}
        for e in range(experts):
            targets.update(gate_up_down_targets(f"{prefix}experts.{e}.", self.gate_up, self.down, width, cfg, sh, expert=e))
        if sh.alone:
            targets[prefix + "experts.gate_up_proj"] = WeightTarget(self.gate_up)
            targets[prefix + "experts.down_proj"] = WeightTarget(self.down)
            return targets
        mine = slice(sh.rank * (width // sh.size), (sh.rank + 1) * (width // sh.size))
        gate_and_up = (mine, slice(width + mine.start, width + mine.stop))  # (this rank's gate rows, its up rows)
        targets[prefix + "experts.gate_up_proj"] = WeightTarget(self.gate_up, part=(1, gate_and_up),
                                                                full=(experts, 2 * width, cfg.hidden_size))
        targets[prefix + "experts.down_proj"] = WeightTarget(self.down, part=(2, mine), full=(experts, cfg.hidden_size, width))
        return targets

    def aliases(self, prefix: str) -> set[str]:
        """The stacked names: a checkpoint names each expert instead."""
        return {prefix + "experts.gate_up_proj", prefix + "experts.down_proj"}


class Qwen3MoeCausalLM(CausalLM):
    def layer_mlp(self, cfg: ModelConfig, layer: int, shard: Shard) -> nn.Module | None:
        return SparseMoE(cfg, shard) if layer in cfg.sparse_layers else None


MODEL = Qwen3MoeCausalLM
