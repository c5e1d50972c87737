import os
import sys
from pathlib import Path

# tests import their helpers (tiny_models, ...) by plain module name
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    from rollout.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """transformers' own model on the same directory, fp32: the reference for greedy tokens and logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    from rollout import Engine

    return Engine(model=str(default_model_dir), spec="off", device="cpu")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (tests/tiny_models.py), shared read-only by every test that asks."""
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path)
    return path
