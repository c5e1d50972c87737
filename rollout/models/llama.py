"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Tokens of all sequences in a step are flattened: hidden states are [num_tokens, hidden].
q/k/v and gate/up projections are fused into one matmul each; `weight_targets` maps the
HF checkpoint names (the names a trainer pushes) onto the fused parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import fused, skinny_gemm
from kernels.attention import AttentionBackend, AttentionMetadata
from rollout.models.config import ModelConfig


@dataclass
class ForwardContext:
    """Everything a layer needs besides its own weights, for one forward step."""

    meta: AttentionMetadata
    backend: AttentionBackend
    k_caches: list[torch.Tensor]  # per layer [num_slots, num_kv_heads, head_dim]
    v_caches: list[torch.Tensor]
    cos: torch.Tensor  # [num_tokens, head_dim], already gathered at the tokens' positions
    sin: torch.Tensor
    attn_out: torch.Tensor | None = None  # [num_tokens, num_heads, head_dim] reused by every layer (CUDA graphs)
    # a draft head's inputs (spec/draft_head.py): the hidden state entering each of these layers
    # (the one before's output; EAGLE-3 takes three, [2, L // 2, L - 3] as SGLang captures them),
    # written side by side into aux_hidden [num_tokens, len(aux_layers) * hidden]
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor lands: a parameter, or a row range of a fused one."""

    param: nn.Parameter
    rows: slice | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.rows is None:
            return tuple(self.param.shape)
        return (self.rows.stop - self.rows.start, *self.param.shape[1:])

    def view(self) -> torch.Tensor:
        return self.param.data if self.rows is None else self.param.data[self.rows]


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode) may take the skinny-GEMM kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_gemm.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def then(self, proj: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None):
        """(proj(norm(x + residual)), x + residual), the residual optional: one kernel at decode."""
        return skinny_gemm.norm_linear(x, residual, self.weight, self.eps, proj.weight, proj.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the qkv projection of the normalised input (the layer fuses the norm into it)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.k_caches[self.layer], ctx.v_caches[self.layer]
        q = fused.rope_and_store(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, ctx.meta.out_slots)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, out=ctx.attn_out)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """From the gate/up projection of the normalised input (the layer fuses the norm into it)."""
        return self.down_proj(fused.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """Returns (this layer's output, the residual stream before it); their sum is the hidden state."""
        qkv, residual = self.input_layernorm.then(self.self_attn.qkv_proj, x, residual)
        gate_up, residual = self.post_attention_layernorm.then(self.mlp.gate_up_proj, self.self_attn(qkv, ctx), residual)
        return self.mlp(gate_up), residual


class DecoderBody(nn.Module):
    """Named `model` inside the causal LM, so parameter names follow the HF layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        ctx: ForwardContext,
        logits_indices: torch.Tensor | None,  # [L] rows of the T tokens whose next-token logits are wanted; None: all
    ) -> torch.Tensor:  # [L, vocab] float32
        x, residual = self.model.embed_tokens(input_ids), None
        hidden = self.config.hidden_size
        for i, layer in enumerate(self.model.layers):
            if i in ctx.aux_layers:
                k = ctx.aux_layers.index(i)
                ctx.aux_hidden[:, k * hidden : (k + 1) * hidden].copy_(x if residual is None else x + residual)
            x, residual = layer(x, residual, ctx)
        last = len(self.model.layers)
        if last in ctx.aux_layers:  # (past the last layer: its output after the final norm, EAGLE-1's feature)
            k = ctx.aux_layers.index(last)
            ctx.aux_hidden[:, k * hidden : (k + 1) * hidden].copy_(self.model.norm(x + residual))
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        logits, _ = skinny_gemm.norm_linear(x, residual, self.model.norm.weight, self.model.norm.eps, self.lm_head_weight)
        return logits.float()

    def to_host(self) -> None:
        """Move the weights to pinned host memory (`.to(device)` brings them back): the GPU is freed
        for a colocated trainer; the parameters stay the same objects, so weight targets stay valid."""
        with torch.no_grad():
            for p in self.parameters():
                if p.device.type != "cpu":
                    host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                    host.copy_(p.data)
                    p.data = host

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every HF tensor name this model accepts, mapped to where it is stored."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.model.embed_tokens.weight),
            "model.norm.weight": WeightTarget(self.model.norm.weight),
            "lm_head.weight": WeightTarget(self.lm_head_weight),
        }
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            targets[p + "input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
            targets[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attention_layernorm.weight)
            qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
            for name, rows in qkv_rows.items():
                targets[f"{p}self_attn.{name}.weight"] = WeightTarget(attn.qkv_proj.weight, rows)
                if cfg.attention_bias:
                    targets[f"{p}self_attn.{name}.bias"] = WeightTarget(attn.qkv_proj.bias, rows)
            targets[p + "self_attn.o_proj.weight"] = WeightTarget(attn.o_proj.weight)
            if cfg.qk_norm:
                targets[p + "self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
                targets[p + "self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
            targets[p + "mlp.gate_proj.weight"] = WeightTarget(mlp.gate_up_proj.weight, slice(0, inter))
            targets[p + "mlp.up_proj.weight"] = WeightTarget(mlp.gate_up_proj.weight, slice(inter, 2 * inter))
            targets[p + "mlp.down_proj.weight"] = WeightTarget(mlp.down_proj.weight)
        return targets
