"""From a model directory to a model on the device: build, load (`default_model.resolve_model_path`
turns a `--model` argument into the directory)."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.models.config import ModelConfig
from rollout.models.llama import CausalLM
from rollout.models.registry import model_class
from rollout.models.sharding import ALONE, Shard
from rollout.models.weights import (
    check_weights,
    checkpoint_specs,
    copy_weights,
    iter_checkpoint,
)


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Shard = ALONE) -> CausalLM:
    """Parameters allocated on the device (this rank's shard of them), zero: load or randomise
    next (a rank's padding rows of the vocabulary stay zero). Cast while still on the meta device:
    allocated in float32 first, the Qwen3-30B-A3B shape took 122 GB to build its 61 GB of bf16."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg, shard).to(dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    for p in model.parameters():
        p.zero_()
    return model


MTP_PREFIX = "model.mtp_layers."  # a checkpoint's multi-token-prediction layers: a draft head's (spec/draft_head.py)


def load_checkpoint(model: CausalLM, path: Path) -> None:
    targets = model.weight_targets()
    optional = model.optional_weights()
    specs = [s for s in checkpoint_specs(path) if not s[0].startswith(MTP_PREFIX)]
    check_weights(targets, specs, require_all=True, optional=optional)
    copy_weights(targets, ((n, t) for n, t in iter_checkpoint(path, targets) if not n.startswith(MTP_PREFIX)))


def randomize(model: CausalLM, seed: int) -> None:
    """Random weights for speed work on model shapes we hold no checkpoint for."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
