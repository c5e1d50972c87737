"""What the engine needs to know about a checkpoint, read from an HF `config.json`.

One decoder covers the Llama family; the differences are switches here:
GQA (num_kv_heads), RoPE scaling, q/k RMSNorm (Qwen3), q/k/v bias (Qwen2), tied embeddings, and
mixture-of-experts layers (Qwen3-MoE: which layers, how many experts, how many a token takes).
Which model class builds a checkpoint is rollout/models/registry.py's, by its architecture.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mimo", "qwen3_moe")  # (mimo: a Qwen2 body with MTP layers)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    rope_scaling: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint ships (MiMo's model.mtp_layers.N.*)
    architecture: str = ""  # config.json's `architectures[0]` (rollout/models/registry.py picks the model class by it)
    num_experts: int = 0  # mixture of experts: the experts of a sparse layer (0: a dense model)
    num_experts_per_tok: int = 0  # the experts each token takes (top-k of the router's softmax)
    moe_intermediate_size: int = 0  # an expert's MLP width
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (the others: the dense MLP)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; this engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported; only silu")
        num_heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        use_window = raw.get("use_sliding_window", model_type == "mistral")
        experts = raw.get("num_experts") or raw.get("num_local_experts") or 0  # (transformers 5 writes the latter)
        step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(raw["num_hidden_layers"]) if experts and i not in dense and (i + 1) % step == 0)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=model_type in ("qwen2", "mimo") or bool(raw.get("attention_bias")),  # Qwen2 always has q/k/v bias
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            sliding_window=raw.get("sliding_window") if use_window else None,
            mtp_layers=raw.get("num_nextn_predict_layers", 0) or 0,
            architecture=(raw.get("architectures") or [""])[0],
            num_experts=experts,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=raw.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: a model is a local HF directory with config.json")
        return cls.from_dict(json.loads(config_file.read_text()))

    @property
    def max_context(self) -> int:
        """Longest sequence the model can attend over; a sliding window caps it (we keep full attention)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2], computed exactly as transformers does."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        rope, kind = self.rope_scaling, self.rope_scaling["rope_type"]
        if kind == "linear":
            inv_freq = inv_freq / rope["factor"]
        elif kind == "llama3":
            factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
            old_len = rope["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
            inv_freq = torch.where(is_medium, smoothed, scaled)
        return inv_freq
