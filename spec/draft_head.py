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
module reads and checks them against the target: a head for another model, a missing tensor
or one of the wrong shape is an error naming the field or the tensor, before anything loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rollout.models.config import ModelConfig
from rollout.models.weights import WeightError, checkpoint_files, checkpoint_specs

ARCHITECTURES = {"LlamaForCausalLMEagle3": "eagle3", "LlamaForCausalLMEagle": "eagle"}
VOCAB_MAPS = ("d2t", "t2d")  # EAGLE-3's integer/bool tensors, read apart from the weights


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle3" or "eagle"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # the head's lm_head rows (EAGLE-1: the target's vocabulary)

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
        )
        for field, have, want in (("target_hidden_size", cfg.target_hidden_size, target.hidden_size),
                                  ("vocab_size", cfg.vocab_size, target.vocab_size)):
            if have != want:
                raise ValueError(f"{config_file}: {field} is {have}, the target's is {want}: a head for another model")
        if kind == "eagle" and hidden != target.hidden_size:
            raise ValueError(f"{config_file}: hidden_size is {hidden}, the target's is {target.hidden_size}: "
                             "an EAGLE-1 head works in the target's width")
        if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"{config_file}: draft_vocab_size {cfg.draft_vocab_size} is not within the vocabulary ({cfg.vocab_size})")
        return cfg

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
