"""The model families, by the architecture name a checkpoint's config.json gives: a new family is a
module whose `MODEL` is its causal LM (the Llama-family decoder with its switches, rollout/models/llama.py,
or a subclass saying how its layers differ) and one line here."""

from __future__ import annotations

import importlib

from rollout.models.config import ModelConfig

FAMILIES = {
    "LlamaForCausalLM": "rollout.models.llama",
    "MistralForCausalLM": "rollout.models.llama",
    "Qwen2ForCausalLM": "rollout.models.llama",
    "Qwen3ForCausalLM": "rollout.models.llama",
    "MiMoForCausalLM": "rollout.models.llama",  # (a Qwen2 body with MTP layers: spec/draft_head.py)
    "Qwen3MoeForCausalLM": "rollout.models.qwen3_moe",
}
# a config.json that names no architecture: its model_type's
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mimo": "MiMoForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def model_class(cfg: ModelConfig) -> type:
    """The causal LM class of `cfg`'s family (ValueError naming the families for one not served)."""
    architecture = cfg.architecture or BY_MODEL_TYPE.get(cfg.model_type, "")
    module = FAMILIES.get(architecture)
    if module is None:
        raise ValueError(f"architecture {architecture!r} is not supported; this engine runs {', '.join(FAMILIES)}")
    return importlib.import_module(module).MODEL
