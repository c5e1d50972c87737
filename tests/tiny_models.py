"""Random-weight HF checkpoints of each supported architecture, small enough for CPU tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=2,
    bos_token_id=1,
    initializer_range=0.2,  # wide enough that greedy decoding wanders instead of repeating one token
)
CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    # layer 0 a mixture of 4 experts (each token takes 2), layer 1 the dense MLP (mlp_only_layers)
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, moe_intermediate_size=48, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word str(i): enough for an engine that is fed token ids."""
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="0", bos_token="1", eos_token="2")


def make_tiny_model(kind: str, path: Path, seed: int = 0, layers: int | None = None, intermediate_size: int | None = None):
    """Save a random `kind` model with its tokenizer under `path`; returns the HF model (fp32, eval)."""
    torch.manual_seed(seed)
    config = CONFIGS[kind]()
    if layers is not None:
        config.num_hidden_layers = layers
    if intermediate_size is not None:
        config.intermediate_size = intermediate_size
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return model
