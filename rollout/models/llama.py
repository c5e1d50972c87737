"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

Tokens of all sequences in a step are flattened: hidden states are [num_tokens, hidden].
q/k/v and gate/up projections are fused into one matmul each; `weight_targets` maps the
HF checkpoint names (the names a trainer pushes) onto the fused parameters. Under tensor
parallelism a model holds one rank's shard (rollout/models/sharding.py): the same names map
onto this rank's part of each tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from torch.nn import functional as F

from kernels import fused, skinny_gemm
from kernels.attention import AttentionBackend, AttentionMetadata
from rollout.models.config import ModelConfig
from rollout.models.sharding import ALONE, Shard


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

    def keep_aux(self, layer: int, hidden: torch.Tensor) -> None:
        """`hidden` [num_tokens, hidden] into its columns of aux_hidden, if the head reads `layer`'s."""
        if layer in self.aux_layers:
            k, width = self.aux_layers.index(layer), hidden.shape[1]
            self.aux_hidden[:, k * width : (k + 1) * width].copy_(hidden)


@dataclass(frozen=True)
class WeightTarget:
    """Where one HF tensor lands: a parameter, or a row range of a fused one, or of one `expert`'s
    slice of a stacked one ([experts, ...]: a mixture of experts' weights). Under tensor parallelism
    only this rank's `part` of the tensor (a dimension and an index range) lands there, and `full`
    is the whole tensor's shape (the shape a trainer pushes). A part of several ranges is their
    concatenation (a fused gate/up tensor's gate rows and up rows of this rank)."""

    param: nn.Parameter
    rows: slice | None = None
    part: tuple[int, slice | tuple[slice, ...]] | None = None
    full: tuple[int, ...] | None = None
    expert: int | None = None

    @cached_property  # (a parameter's shape stays, wherever release_memory moves its data)
    def shape(self) -> tuple[int, ...]:
        """The HF tensor's shape."""
        if self.full is not None:
            return self.full
        base = tuple(self.param.shape) if self.expert is None else tuple(self.param.shape[1:])
        if self.rows is None:
            return base
        return (self.rows.stop - self.rows.start, *base[1:])

    def view(self) -> torch.Tensor:
        data = self.param.data if self.expert is None else self.param.data[self.expert]
        return data if self.rows is None else data[self.rows]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the HF tensor: cut here from the whole one, or as read (`read_part`)."""
        if self.part is None or tuple(tensor.shape) != self.shape:
            return tensor
        dim, index = self.part
        pieces = [tensor.narrow(dim, s.start, s.stop - s.start) for s in ranges(index)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    @property
    def kept(self) -> float:
        """The share of the HF tensor this rank keeps."""
        if self.part is None:
            return 1.0
        dim, index = self.part
        return sum(s.stop - s.start for s in ranges(index)) / self.shape[dim]


def ranges(index: slice | tuple[slice, ...]) -> tuple[slice, ...]:
    """A part's index ranges (WeightTarget.part)."""
    return index if isinstance(index, tuple) else (index,)


def _cut(shard: Shard, param: nn.Parameter, rows: slice | None, dim: int, index: slice, full: tuple[int, ...],
         expert: int | None = None) -> WeightTarget:
    """The target of a tensor of shape `full` of which this rank keeps `index` along `dim`."""
    if shard.alone:
        return WeightTarget(param, rows, expert=expert)
    return WeightTarget(param, rows, (dim, index), full, expert)


def layer_targets(prefix: str, attn: "Attention", mlp: "MLP", cfg: ModelConfig, sh: Shard,
                  qkv_in: int | None = None) -> dict[str, WeightTarget]:
    """The targets of a decoder layer's attention and MLP products (`prefix`: the names' start):
    q/k/v and gate/up cut by rows, o and down by columns, each rank's part. `qkv_in`: q/k/v's
    input width when it is not the hidden size (an EAGLE-3 head reads two hidden states)."""
    return {**attention_targets(prefix, attn, cfg, sh, qkv_in), **mlp.targets(prefix + "mlp.", cfg, sh)}


def attention_targets(prefix: str, attn: "Attention", cfg: ModelConfig, sh: Shard,
                      qkv_in: int | None = None) -> dict[str, WeightTarget]:
    hd, hidden = cfg.head_dim, cfg.hidden_size
    q, kv = sh.heads(cfg) * hd, sh.kv_heads(cfg) * hd
    q_part = slice(sh.rank * q, (sh.rank + 1) * q)
    kv_part = slice(sh.first_kv_head(cfg) * hd, sh.first_kv_head(cfg) * hd + kv)
    targets = {}
    qkv = {"q_proj": (slice(0, q), q_part, cfg.num_heads * hd), "k_proj": (slice(q, q + kv), kv_part, cfg.num_kv_heads * hd),
           "v_proj": (slice(q + kv, q + 2 * kv), kv_part, cfg.num_kv_heads * hd)}
    for name, (at, part, size) in qkv.items():
        targets[f"{prefix}self_attn.{name}.weight"] = _cut(sh, attn.qkv_proj.weight, at, 0, part, (size, qkv_in or hidden))
        if attn.qkv_proj.bias is not None:
            targets[f"{prefix}self_attn.{name}.bias"] = _cut(sh, attn.qkv_proj.bias, at, 0, part, (size,))
    targets[prefix + "self_attn.o_proj.weight"] = _cut(sh, attn.o_proj.weight, None, 1, q_part, (hidden, cfg.num_heads * hd))
    if cfg.qk_norm:
        targets[prefix + "self_attn.q_norm.weight"] = WeightTarget(attn.q_norm.weight)
        targets[prefix + "self_attn.k_norm.weight"] = WeightTarget(attn.k_norm.weight)
    return targets


def gate_up_down_targets(prefix: str, gate_up: nn.Parameter, down: nn.Parameter, width: int, cfg: ModelConfig,
                         sh: Shard, expert: int | None = None) -> dict[str, WeightTarget]:
    """An MLP's (or one expert's) gate, up and down of `width` (the whole width, before the ranks
    split it): gate and up into the fused gate_up's row halves, each rank its part of the width."""
    inter, hidden = width // sh.size, cfg.hidden_size
    part = slice(sh.rank * inter, (sh.rank + 1) * inter)
    return {
        prefix + "gate_proj.weight": _cut(sh, gate_up, slice(0, inter), 0, part, (width, hidden), expert),
        prefix + "up_proj.weight": _cut(sh, gate_up, slice(inter, 2 * inter), 0, part, (width, hidden), expert),
        prefix + "down_proj.weight": _cut(sh, down, None, 1, part, (hidden, width), expert),
    }


def vocab_logits(shard: Shard, logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each rank's slice of the vocabulary's logits, side by side on every rank, less the padding."""
    if shard.alone:
        return logits
    logits = shard.all_gather(logits)
    return logits[:, :vocab].contiguous() if logits.shape[1] != vocab else logits


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode) may take the skinny-GEMM kernel; batch-invariant
    products when its model is (`CausalLM.make_batch_invariant`)."""

    batch_invariant = False
    float32_output = False  # its float32 accumulator, not rounded (CausalLM.keep_float32's activations)
    # its output's one consumer adds up partial sums over slices of K (skinny_gemm.linear_into_sum): the residual add
    # + norm (`RMSNorm.add`) after a decoder layer's o and down products at one rank, rope after its qkv product
    into_sum = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.into_sum and not (self.batch_invariant or self.float32_output) and self.bias is None:
            return skinny_gemm.linear_into_sum(x, self.weight)
        out_dtype = torch.float32 if self.float32_output else None
        return skinny_gemm.linear(x, self.weight, self.bias, out_dtype, invariant=self.batch_invariant)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None, shard: Shard,
            out_dtype: torch.dtype | None = None, round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), where x is this rank's part of a row-parallel
        product (summed over the ranks here); with no residual, x is whole (the embedding). The
        sum keeps the residual's dtype; the norm is rounded to `out_dtype` (default x's), once with
        `round_once` (`fused.rms_norm`)."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps, out_dtype=out_dtype, round_once=round_once), x
        return shard.reduce_norm(x, residual, self.weight, self.eps, out_dtype, round_once)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = ALONE):
        super().__init__()
        self.layer = layer
        self.shard = shard
        self.num_heads, self.num_kv_heads, self.head_dim = shard.heads(cfg), shard.kv_heads(cfg), cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.qkv_proj.into_sum = True  # (rope adds up its partial sums, at any TP size: each rank's heads are whole)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the qkv projection of the normalised input, this rank's part of the output (the
        ranks' parts sum to it: the next norm sums them, `RMSNorm.add`)."""
        num_tokens = qkv.shape[0]
        lead = qkv.shape[:-1]  # ([T], or [T, slices] of a few-row product's partial sums: Linear.into_sum)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None  # (in the rope kernel)
        k_cache, v_cache = ctx.k_caches[self.layer], ctx.v_caches[self.layer]
        parts_dtype = self.qkv_proj.weight.dtype if qkv.dim() == 3 else None
        q = fused.rope_and_store(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, ctx.meta.out_slots, norms, k_cache.dtype,
                                 parts_dtype)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, out=ctx.attn_out)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = ALONE):
        super().__init__()
        self.shard = shard
        self.intermediate_size = shard.intermediate(cfg)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """From the gate/up projection of the normalised input, this rank's part of the output (as `Attention`'s)."""
        return self.down_proj(fused.silu_mul(gate_up, self.down_proj.weight.dtype))

    def block(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's part of the MLP's output for the normalised hidden states `h` (a decoder layer's call)."""
        return self(self.gate_up_proj(h))

    def targets(self, prefix: str, cfg: ModelConfig, sh: Shard) -> dict[str, WeightTarget]:
        return gate_up_down_targets(prefix, self.gate_up_proj.weight, self.down_proj.weight, cfg.intermediate_size, cfg, sh)

    def aliases(self, prefix: str) -> set[str]:
        """Names of its targets that stand for weights others already name (none here)."""
        return set()


class VocabEmbedding(nn.Embedding):
    """The embedding rows of this rank's slice of the vocabulary; the ranks' lookups are summed
    (a token's row is on one rank, the others add zeros)."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ALONE):
        super().__init__(shard.vocab_rows(cfg), cfg.hidden_size)
        self.shard = shard
        self.first = shard.vocab_slice(cfg).start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.alone:
            return super().forward(ids)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.shard.all_reduce(x)


class DecoderLayer(nn.Module):
    residual_dtype: torch.dtype | None = None  # the residual stream's, when not the activations' (CausalLM.keep_float32)
    input_dtype: torch.dtype | None = None  # the norms' outputs, when not their inputs' (float32 products' outputs)

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = ALONE, mlp: nn.Module | None = None):
        """`mlp`: the layer's MLP when it is not the dense one (a mixture of experts': rollout/models/registry.py)."""
        super().__init__()
        self.layer, self.shard = layer, shard
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg, shard)
        if shard.alone:  # (under tensor parallelism the products' parts go to the all-reduce whole)
            self.self_attn.o_proj.into_sum = True
            if isinstance(self.mlp, MLP):
                self.mlp.down_proj.into_sum = True
            else:  # (a mixture of experts': each row's picks, qwen3_moe.SparseMoE)
                self.mlp.into_sum = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """Returns (this rank's part of this layer's output, the residual stream before it): the
        hidden state is the ranks' parts summed plus the residual. `x`: the layer before's, or
        with no residual the embedding."""
        once = self.input_dtype is not None  # (float32 between the products: the norms' weights too)
        h, residual = self.input_layernorm.add(x, residual, self.shard, self.input_dtype, once)
        if self.residual_dtype is not None:
            residual = residual.to(self.residual_dtype)  # (the embedding, at the first layer; after, a no-op)
        ctx.keep_aux(self.layer, residual)  # (the hidden state entering this layer)
        h, residual = self.post_attention_layernorm.add(self.self_attn(self.self_attn.qkv_proj(h), ctx), residual, self.shard,
                                                        self.input_dtype, once)
        return self.mlp.block(h), residual


class DecoderBody(nn.Module):
    """Named `model` inside the causal LM, so parameter names follow the HF layout."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ALONE, mlp_of=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, shard)
        mlp_of = mlp_of or (lambda layer: None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, mlp_of(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The Llama family's causal LM; a family whose layers differ (a mixture of experts) says how in
    `layer_mlp` (rollout/models/registry.py)."""

    def __init__(self, cfg: ModelConfig, shard: Shard = ALONE):
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.model = DecoderBody(cfg, shard, lambda layer: self.layer_mlp(cfg, layer, shard))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_rows(cfg), bias=False)

    batch_invariant = False
    fp32_lm_head = False  # the LM head's input in float32 (keep_float32)
    shared = False  # served by more than one engine of this process (Engine's share_weights_with)

    def layer_mlp(self, cfg: ModelConfig, layer: int, shard: Shard) -> nn.Module | None:
        """Layer `layer`'s MLP, if not the dense one."""
        return None

    def make_batch_invariant(self) -> None:
        """Every product of a token's row the same bits whatever else its step holds
        (kernels/skinny_gemm.py): coupled sampling's later rollouts verify as draft trees the
        tokens its earlier ones decoded, and must draw them alike."""
        self.batch_invariant = True
        for module in self.modules():
            if isinstance(module, Linear):
                module.batch_invariant = True

    def keep_float32(self, residual: bool, lm_head: bool, activations: bool = False) -> None:
        """Float32 islands in a half-precision model, none of which reads more weight bytes: the
        residual stream between sublayers (each sublayer still reads and writes the dtype), the
        LM head's input (the final norm's output, through a float32 product over the served weight),
        and with `activations` (which implies both) everything between the products: the attention
        and dense MLP products write their float32 accumulators, and rope, SiLU x up and the norms
        work on them, rounding once to the dtype where a product or the KV cache reads it. Each
        cuts half precision's logprob noise against a float32 trainer (docs/numerics.md)."""
        residual, lm_head = residual or activations, lm_head or activations
        for layer in self.model.layers:
            layer.residual_dtype = torch.float32 if residual else None
            layer.input_dtype = layer.self_attn.qkv_proj.weight.dtype if activations else None
            products = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(layer.mlp, MLP):  # (a mixture of experts' layer writes its output in the dtype)
                products += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
            # (a norm rounds partial sums and picks to the residual's dtype: a float32 stream would skip the dtype's
            # rounding; rope, after qkv, rounds them to the product's)
            for linear in products:
                linear.float32_output = activations
                linear.into_sum = linear.into_sum and not (residual and linear is not layer.self_attn.qkv_proj)
            if not isinstance(layer.mlp, MLP):
                layer.mlp.into_sum = layer.mlp.into_sum and not residual
        self.fp32_lm_head = lm_head

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
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        last = len(self.model.layers)  # (past the last layer: its output after the final norm, EAGLE-1's feature)
        every_row = last in ctx.aux_layers
        if logits_indices is not None and not every_row:  # (else the final norm of the logits' rows alone)
            x, residual = x[logits_indices], residual[logits_indices]
        h, _ = self.model.norm.add(x, residual, self.shard, torch.float32 if self.fp32_lm_head else None)
        ctx.keep_aux(last, h)
        if logits_indices is not None and every_row:
            h = h[logits_indices]
        # float32 out of the accumulator, not rounded to bf16 (steps of 0.06 at a logit near 10):
        # the logprobs a trainer gets are exact to float32. (It did not keep coupled rollouts
        # aligned: their draws part over activations upstream; bench/RESULTS.md.)
        if self.fp32_lm_head:
            logits = skinny_gemm.float32_input_linear(h, self.lm_head_weight, invariant=self.batch_invariant)
        else:
            logits = skinny_gemm.linear(h, self.lm_head_weight, out_dtype=torch.float32, invariant=self.batch_invariant)
        return vocab_logits(self.shard, logits, self.config.vocab_size)

    def to_host(self) -> None:
        """Move the weights to pinned host memory (`.to(device)` brings them back): the GPU is freed
        for a colocated trainer; the parameters stay the same objects, so weight targets stay valid."""
        with torch.no_grad():
            for p in self.parameters():
                if p.device.type != "cpu":
                    host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                    host.copy_(p.data)
                    p.data = host

    def optional_weights(self) -> set[str]:
        """Target names a checkpoint may leave out: the LM head when tied to the embedding, and the
        names that stand for weights others name (a mixture of experts' stacked experts)."""
        names = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        for i, layer in enumerate(self.model.layers):
            names |= layer.mlp.aliases(f"model.layers.{i}.mlp.")
        return names

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every HF tensor name this model accepts, mapped to where (this rank's part of) it is stored."""
        cfg, sh = self.config, self.shard
        hidden = cfg.hidden_size
        vocab = sh.vocab_slice(cfg)
        rows = slice(0, vocab.stop - vocab.start)  # (the last rank's slice may leave padding rows)
        targets = {
            "model.embed_tokens.weight": _cut(sh, self.model.embed_tokens.weight, rows, 0, vocab, (cfg.vocab_size, hidden)),
            "model.norm.weight": WeightTarget(self.model.norm.weight),
            "lm_head.weight": _cut(sh, self.lm_head_weight, rows, 0, vocab, (cfg.vocab_size, hidden)),
        }
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            targets[p + "input_layernorm.weight"] = WeightTarget(layer.input_layernorm.weight)
            targets[p + "post_attention_layernorm.weight"] = WeightTarget(layer.post_attention_layernorm.weight)
            targets.update(layer_targets(p, layer.self_attn, layer.mlp, cfg, sh))
        return targets


MODEL = CausalLM  # (rollout/models/registry.py)
