"""Learned draft heads as users have them on disk (issue 25): EAGLE-3 and EAGLE-1/2 checkpoints.

A head is an HF directory (config.json and safetensors) trained for one target model:

- EAGLE-3 (`"architectures": ["LlamaForCausalLMEagle3"]`, as SpecForge, SGLang and vLLM publish
  them): `fc` maps the target's low, middle and high hidden states (3 x target_hidden_size)
  to the head's width; one decoder layer, `midlayer.*`, whose attention reads the normalised
  token embedding and hidden state side by side (q/k/v over 2 x hidden_size; `input_layernorm`
  for the embedding, `hidden_norm` for the hidden state); `norm`; an `lm_head` over a draft
  vocabulary of `draft_vocab_size` tokens, with `d2t` (draft id -> target id, stored as the
  difference) and `t2d` (which target ids the draft vocabulary has).
- EAGLE-1/2 (`"architectures": ["LlamaForCausalLMEagle"]`): `fc` (with bias) maps the token
  embedding and the target's last hidden state (2 x hidden_size) to hidden_size; one decoder
  layer, `layers.0.*`, without an input norm; the target's own `lm_head`.

Both may carry `embed_tokens` or borrow the target's; names may carry a `model.` prefix. This
module reads and checks them against the target (a head for another model, a missing tensor
or one of the wrong shape is an error naming the field or the tensor, before anything loads)
and builds `DraftHead`, one decoder layer over the paged KV cache like the target's (its KV
is one more layer of the pool, addressed by the same slots as the target's tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from rollout.models.config import ModelConfig
from rollout.models.llama import MLP, Attention, ForwardContext, Linear, RMSNorm, WeightTarget, layer_targets, vocab_logits
from rollout.models.sharding import ALONE, Shard
from rollout.models.weights import WeightError, check_weights, checkpoint_files, checkpoint_specs, copy_weights, iter_checkpoint

ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "LlamaForCausalLMEagle": "eagle"}
VOCAB_MAPS = ("d2t", "t2d")  # EAGLE-3's integer/bool tensors, read apart from the weights


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle3", "eagle" (EAGLE-1) or "mtp" (a checkpoint's own multi-token-prediction layer)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # the head's lm_head rows (EAGLE-1: the target's vocabulary)
    # the target layers whose entering hidden states fc reads (EAGLE-3: three; EAGLE-1: the number
    # of layers, which stands for the last layer's output after the final norm)
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> "HeadConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: a draft head is a local HF directory with config.json")
        raw = json.loads(config_file.read_text())
        archs = raw.get("architectures") or []
        kind = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if kind is None:
            raise ValueError(f"{config_file}: architectures {archs} name no supported draft head "
                             f"({', '.join(ARCHITECTURES)})")

        def need(field: str) -> int:
            if field not in raw:
                raise ValueError(f"{config_file}: {field} is missing")
            return raw[field]

        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{config_file}: num_hidden_layers is {raw['num_hidden_layers']}; heads of one layer are supported")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        cfg = cls(
            kind=kind, hidden_size=hidden, intermediate_size=need("intermediate_size"), num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), target_hidden_size=raw.get("target_hidden_size") or hidden,
            vocab_size=need("vocab_size"),
            draft_vocab_size=(raw.get("draft_vocab_size") or raw["vocab_size"]) if kind == "eagle3" else raw["vocab_size"],
            aux_layers=_aux_layers(raw, target.num_layers) if kind == "eagle3" else (target.num_layers,),
        )
        for field, have, want in (("target_hidden_size", cfg.target_hidden_size, target.hidden_size),
                                  ("vocab_size", cfg.vocab_size, target.vocab_size)):
            if have != want:
                raise ValueError(f"{config_file}: {field} is {have}, the target's is {want}: a head for another model")
        if cfg.head_dim != target.head_dim:
            raise ValueError(f"{config_file}: head_dim is {cfg.head_dim}, the target's is {target.head_dim}: "
                             "the head shares the target's RoPE tables")
        if float(raw.get("rope_theta", target.rope_theta)) != target.rope_theta:
            raise ValueError(f"{config_file}: rope_theta is {raw['rope_theta']}, the target's is {target.rope_theta}")
        if kind == "eagle" and hidden != target.hidden_size:
            raise ValueError(f"{config_file}: hidden_size is {hidden}, the target's is {target.hidden_size}: "
                             "an EAGLE-1 head works in the target's width")
        if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"{config_file}: draft_vocab_size {cfg.draft_vocab_size} is not within the vocabulary ({cfg.vocab_size})")
        return cfg

    @classmethod
    def mtp(cls, target: ModelConfig) -> "HeadConfig":
        """The first MTP layer of the target's own checkpoint (MiMo's `model.mtp_layers.0.*`): a
        decoder layer of the target's shape reading its last hidden state after the final norm."""
        if not target.mtp_layers:
            raise ValueError(f"--spec mtp: the model ({target.model_type}) ships no MTP layers (num_nextn_predict_layers)")
        return cls(kind="mtp", hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps, target_hidden_size=target.hidden_size,
                   vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size, aux_layers=(target.num_layers,))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every floating-point tensor of the head, by its checkpoint name (without `model.`)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        if self.kind == "eagle3":
            layer, attn_in = "midlayer", 2 * h
            out = {"fc.weight": (h, 3 * self.target_hidden_size), "norm.weight": (h,),
                   "lm_head.weight": (self.draft_vocab_size, h),
                   f"{layer}.input_layernorm.weight": (h,), f"{layer}.hidden_norm.weight": (h,)}
        else:
            layer, attn_in = "layers.0", h
            out = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
        out.update({
            f"{layer}.self_attn.q_proj.weight": (q, attn_in), f"{layer}.self_attn.k_proj.weight": (kv, attn_in),
            f"{layer}.self_attn.v_proj.weight": (kv, attn_in), f"{layer}.self_attn.o_proj.weight": (h, q),
            f"{layer}.post_attention_layernorm.weight": (h,),
            f"{layer}.mlp.gate_proj.weight": (i, h), f"{layer}.mlp.up_proj.weight": (i, h),
            f"{layer}.mlp.down_proj.weight": (h, i),
        })
        return out


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose entering hidden states EAGLE-3 reads when its config names none: SGLang's
    [2, L // 2, L - 3]; three distinct ones for models of fewer than 6 layers (tests)."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 6 else (1, num_layers // 2, num_layers - 1)


def _aux_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """config.json's `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's and SpecForge's
    convention: the layers whose outputs are read, one before the layers entered), or the default."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layers(num_layers)
    entered = tuple(int(i) + 1 for i in ids)
    if len(entered) != 3 or not all(0 <= i < num_layers for i in entered):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids}: three layers of the target's {num_layers} are needed")
    return entered


def check_head(path: str | Path, cfg: HeadConfig) -> list[str]:
    """The head's tensor names as stored, checked against `cfg`: every tensor present with its
    shape (`embed_tokens.weight` optional, the target's otherwise), EAGLE-3's vocabulary maps
    of the draft vocabulary's size; raises WeightError listing every problem."""
    want = cfg.shapes()
    optional = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    maps = {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)} if cfg.kind == "eagle3" else {}
    problems, names, seen = [], [], set()
    for stored, shape, dtype in checkpoint_specs(path):
        name = stored.removeprefix("model.")
        expected = want.get(name) or optional.get(name) or maps.get(name)
        if expected is None:
            problems.append(f"unknown tensor {stored!r}")
        elif tuple(shape) != expected:
            problems.append(f"{stored}: shape {tuple(shape)} != {expected} (from config.json)")
        elif name not in maps and not dtype.is_floating_point:
            problems.append(f"{stored}: dtype {dtype} is not a floating-point type")
        else:
            names.append(stored)
            seen.add(name)
    missing = sorted((set(want) | set(maps)) - seen)
    if missing:
        problems.append(f"missing {', '.join(missing[:4])}" + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    if problems:
        raise WeightError(f"draft head {path} rejected: " + "; ".join(problems[:8]))
    return names


def read_vocab_map(path: str | Path, cfg: HeadConfig) -> torch.Tensor:
    """EAGLE-3's draft id -> target id [draft_vocab_size] int64 (the identity for EAGLE-1)."""
    if cfg.kind != "eagle3":
        return torch.arange(cfg.draft_vocab_size)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():
                if stored.removeprefix("model.") == "d2t":
                    d2t = f.get_tensor(stored).long() + torch.arange(cfg.draft_vocab_size)
                    if int(d2t.min()) < 0 or int(d2t.max()) >= cfg.vocab_size:
                        raise WeightError(f"draft head {path}: d2t maps draft ids outside the vocabulary ({cfg.vocab_size})")
                    return d2t
    raise WeightError(f"draft head {path}: missing d2t")


class DraftHead(nn.Module):
    """The head's layer. `forward(input_ids, hidden, ctx)`: the tokens' embeddings (the head's
    own, or the target's, `embed`) with the hidden state before each (EAGLE-3: the target's three
    concatenated, or the head's own output when it drafts on; EAGLE-1: the target's last) ->
    (logits over the draft vocabulary [T, draft_vocab] float32, the head's hidden state [T, H]).

    Under tensor parallelism (`shard`) the layer is split as the target's layers are (its
    attention heads, KV heads and MLP across the ranks, an all-reduce after each), so its KV
    fits the pool's layer of this rank's heads; the rest is replicated (fc, norms, an EAGLE-3
    head's own vocabulary), and logits over the target's vocabulary are gathered as the
    target's are. Every rank then drafts the same tokens from the same inputs."""

    def __init__(self, cfg: HeadConfig, target: ModelConfig, layer: int, shard: Shard = ALONE):
        super().__init__()
        self.cfg, self.shard = cfg, shard
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        shape = replace(target, hidden_size=h, intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads,
                        num_kv_heads=cfg.num_kv_heads, rms_norm_eps=eps, attention_bias=False, qk_norm=False,
                        num_layers=1)
        eagle3, mtp = cfg.kind == "eagle3", cfg.kind == "mtp"
        if mtp:  # (MiMo's MTP layer is the target's decoder layer: its q/k/v bias included)
            shape = replace(shape, attention_bias=target.attention_bias)
        Shard.check(shape, shard.size, "the draft head")
        self.shape = shape
        self.fc = nn.Linear((3 * cfg.target_hidden_size) if eagle3 else 2 * h, h, bias=cfg.kind == "eagle")
        self.self_attn = Attention(shape, layer, shard)  # `layer`: the head's layer of the KV pool
        if mtp:  # input_proj over [norm(hidden), norm(embedding)], then a pre-norm layer and a final norm
            self.token_norm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
            self.input_layernorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps)
        if eagle3:  # q/k/v read the normalised embedding and hidden state side by side
            self.self_attn.qkv_proj = Linear(2 * h, self.self_attn.q_size + 2 * self.self_attn.kv_size, bias=False)
            self.input_layernorm = RMSNorm(h, eps)
            self.hidden_norm = RMSNorm(h, eps)
            self.norm = RMSNorm(h, eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(shape, shard)
        self.embed_tokens: nn.Embedding | None = None  # set by load_head when the checkpoint has its own

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                embed: nn.Embedding, lm_head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        e = (self.embed_tokens or embed)(input_ids)
        if self.cfg.kind == "mtp":
            residual = self.fc(torch.cat([self.hidden_norm(hidden), self.token_norm(e)], dim=-1))
            x = self.input_layernorm(residual)
        elif self.cfg.kind == "eagle3":
            h = self.fc(hidden) if hidden.shape[-1] != self.cfg.hidden_size else hidden
            x = torch.cat([self.input_layernorm(e), self.hidden_norm(h)], dim=-1)
            residual = h
        else:
            x = residual = self.fc(torch.cat([e, hidden], dim=-1))  # (EAGLE-1's layer has no input norm)
        attended = self.shard.all_reduce(self.self_attn(self.self_attn.qkv_proj(x), ctx)) + residual
        out = self.shard.all_reduce(self.mlp(self.mlp.gate_up_proj(self.post_attention_layernorm(attended)))) + attended
        if self.cfg.kind == "eagle3":
            return self.lm_head(self.norm(out)).float(), out
        if self.cfg.kind == "mtp":  # (its normed output is the next step's hidden state, as the target's is its)
            out = self.norm(out)
        logits = torch.nn.functional.linear(out, lm_head_weight)  # the target's lm_head (this rank's rows)
        return vocab_logits(self.shard, logits, self.shape.vocab_size).float(), out

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint name (without `model.`) mapped to where it is stored."""
        kind = self.cfg.kind
        layer = {"eagle3": "midlayer", "eagle": "layers.0", "mtp": "mtp_layers.0"}[kind]
        out = {
            ("mtp_layers.0.input_proj.weight" if kind == "mtp" else "fc.weight"): WeightTarget(self.fc.weight),
            f"{layer}.post_attention_layernorm.weight": WeightTarget(self.post_attention_layernorm.weight),
            **layer_targets(f"{layer}.", self.self_attn, self.mlp, self.shape, self.shard,
                            qkv_in=2 * self.cfg.hidden_size if kind == "eagle3" else None),
        }
        if kind == "eagle3":
            out.update({
                f"{layer}.input_layernorm.weight": WeightTarget(self.input_layernorm.weight),
                f"{layer}.hidden_norm.weight": WeightTarget(self.hidden_norm.weight),
                "norm.weight": WeightTarget(self.norm.weight), "lm_head.weight": WeightTarget(self.lm_head.weight),
            })
        elif kind == "mtp":
            out.update({
                f"{layer}.token_layernorm.weight": WeightTarget(self.token_norm.weight),
                f"{layer}.hidden_layernorm.weight": WeightTarget(self.hidden_norm.weight),
                f"{layer}.input_layernorm.weight": WeightTarget(self.input_layernorm.weight),
                f"{layer}.final_layernorm.weight": WeightTarget(self.norm.weight),
            })
        else:
            out["fc.bias"] = WeightTarget(self.fc.bias)
        return out


def load_mtp(path: str | Path, target: ModelConfig, layer: int, dtype: torch.dtype = torch.float32,
             shard: Shard = ALONE) -> DraftHead:
    """The first MTP layer of the target checkpoint at `path` (`model.mtp_layers.0.*`), checked
    like the target's weights, on the CPU in `dtype` (this rank's part of it under `shard`)."""
    head = DraftHead(HeadConfig.mtp(target), target, layer, shard).to(dtype)
    targets = head.weight_targets()
    mine = [(n.removeprefix("model."), shape, dt) for n, shape, dt in checkpoint_specs(path)
            if n.startswith("model.mtp_layers.0.")]
    check_weights(targets, mine, require_all=True)
    copy_weights(targets, ((n.removeprefix("model."), t) for n, t in iter_checkpoint(path) if n.startswith("model.mtp_layers.0.")))
    head.register_buffer("draft_to_target", torch.arange(target.vocab_size))
    return head


def load_head(path: str | Path, target: ModelConfig, layer: int, dtype: torch.dtype = torch.float32,
              shard: Shard = ALONE) -> DraftHead:
    """The head at `path`, checked against `target`, on the CPU in `dtype` (this rank's part of it
    under `shard`); `layer`: its KV pool layer."""
    cfg = HeadConfig.from_dir(path, target)
    names = set(check_head(path, cfg))
    head = DraftHead(cfg, target, layer, shard).to(dtype)
    targets = head.weight_targets()
    with torch.no_grad():
        for stored, tensor in iter_checkpoint(path):
            name = stored.removeprefix("model.")
            if stored not in names or name in VOCAB_MAPS:
                continue
            if name == "embed_tokens.weight":
                head.embed_tokens = nn.Embedding(*tensor.shape, dtype=dtype)
                head.embed_tokens.weight.copy_(tensor)
            else:
                targets[name].view().copy_(targets[name].take(tensor))
    head.register_buffer("draft_to_target", read_vocab_map(path, cfg))
    return head


def unrolled(head: DraftHead, embed: nn.Embedding, ids: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, steps: int = 1,
             lm_head_weight: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The head in plain, differentiable torch over one sequence, unrolled as drafting a chain
    unrolls it (EAGLE-3's training-time test): recipes/train_eagle.py trains through it, and
    the tests hold `DraftHead` over the paged cache to its first step.

    ids [T]: the token after each position; hidden [T, width]: the target's hidden states there;
    cos, sin [>= T + steps - 1, head_dim] by position. Step j predicts at positions t < T - j,
    standing at t + j: its input is the embedding of ids[t + j] and step j - 1's output at t
    (step 0: hidden[t]); it attends to step 0's keys at positions <= t and to steps 1..j's keys
    at t (the drafts before it in the chain). Returns (logits [T - j, draft vocab], output
    [T - j, H]) per step."""
    # the parameters themselves (or their rows), not WeightTarget.view()'s detached data: trained through
    p = {name: t.param if t.rows is None else t.param[t.rows] for name, t in head.weight_targets().items()}
    cfg, eagle3, mtp = head.cfg, head.cfg.kind == "eagle3", head.cfg.kind == "mtp"
    layer = {"eagle3": "midlayer", "eagle": "layers.0", "mtp": "mtp_layers.0"}[cfg.kind]
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    emb = head.embed_tokens or embed

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def rotate(x, at):  # x [heads, n, hd] at positions `at`
        c, s, half = cos[at], sin[at], hd // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    t_all = ids.shape[0]
    keys, values, out, h = [], [], [], hidden
    for j in range(steps):
        n = t_all - j
        e, h = emb(ids[j : j + n]).to(hidden.dtype), h[:n]
        if eagle3:
            if j == 0:
                h = h @ p["fc.weight"].T
            x, residual = torch.cat([rms(e, p[f"{layer}.input_layernorm.weight"]), rms(h, p[f"{layer}.hidden_norm.weight"])], -1), h
        elif mtp:
            residual = torch.cat([rms(h, p[f"{layer}.hidden_layernorm.weight"]), rms(e, p[f"{layer}.token_layernorm.weight"])],
                                 -1) @ p[f"{layer}.input_proj.weight"].T
            x = rms(residual, p[f"{layer}.input_layernorm.weight"])
        else:
            x = residual = torch.cat([e, h], -1) @ p["fc.weight"].T + p["fc.bias"]
        at = torch.arange(j, j + n, device=ids.device)
        def proj(name):  # (q/k/v biases: MTP layers of a Qwen2 body)
            y = x @ p[f"{layer}.self_attn.{name}.weight"].T
            return y + p[f"{layer}.self_attn.{name}.bias"] if f"{layer}.self_attn.{name}.bias" in p else y

        q = rotate(proj("q_proj").view(n, nh, hd).transpose(0, 1), at)
        k = rotate(proj("k_proj").view(n, nkv, hd).transpose(0, 1), at)
        v = proj("v_proj").view(n, nkv, hd).transpose(0, 1)
        keys.append(k.repeat_interleave(nh // nkv, 0))
        values.append(v.repeat_interleave(nh // nkv, 0))
        scale = hd ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        s0 = (q @ keys[0][:, :n].transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))  # [nh, n, n]
        chain = [(q * keys[i][:, :n]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # [nh, n, 1] each
        w = torch.softmax(torch.cat([s0, *chain], dim=-1), dim=-1)
        o = w[..., :n] @ values[0][:, :n]
        for i in range(1, j + 1):
            o = o + w[..., n + i - 1 : n + i] * values[i][:, :n]
        attended = o.transpose(0, 1).reshape(n, nh * hd) @ p[f"{layer}.self_attn.o_proj.weight"].T + residual
        m = rms(attended, p[f"{layer}.post_attention_layernorm.weight"])
        gate, up = m @ p[f"{layer}.mlp.gate_proj.weight"].T, m @ p[f"{layer}.mlp.up_proj.weight"].T
        h = (torch.nn.functional.silu(gate) * up) @ p[f"{layer}.mlp.down_proj.weight"].T + attended
        if mtp:
            h = rms(h, p[f"{layer}.final_layernorm.weight"])
        logits = rms(h, p["norm.weight"]) @ p["lm_head.weight"].T if eagle3 else h @ lm_head_weight.T
        out.append((logits, h))
    return out
