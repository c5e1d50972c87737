"""Draft heads on disk (spec/draft_head.py): EAGLE-3 and EAGLE-1 layouts of random tiny heads
load, and a head for another model or a broken one is an error naming the field or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rollout.models.config import ModelConfig
from rollout.models.weights import WeightError
from spec.draft_head import HeadConfig, check_head, read_vocab_map

TARGET = ModelConfig.from_dict(dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
DRAFT_VOCAB = 96


def write_head(path, kind: str, prefix: str = "", drop: str | None = None, config: dict | None = None,
               reshape: str | None = None):
    """A random head of `kind` under `path` (its tensors from its own config's shapes)."""
    raw = dict(architectures=["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLMEagle"],
               hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=1, vocab_size=512, rms_norm_eps=1e-5)
    if kind == "eagle3":
        raw.update(draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64)
    raw.update(config or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    cfg = HeadConfig.from_dir(path, TARGET)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in cfg.shapes().items()}
    if kind == "eagle3":
        targets = torch.randperm(512, generator=gen)[:DRAFT_VOCAB].sort().values
        tensors["d2t"] = targets - torch.arange(DRAFT_VOCAB)
        tensors["t2d"] = torch.zeros(512, dtype=torch.bool).index_fill_(0, targets, True)
    if reshape:
        tensors[reshape] = torch.randn(3, 3)
    if drop:
        del tensors[drop]
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return targets if kind == "eagle3" else None


@pytest.mark.parametrize("kind, prefix", [("eagle3", ""), ("eagle3", "model."), ("eagle", ""), ("eagle", "model.")])
def test_heads_of_each_supported_layout_load(tmp_path, kind, prefix):
    targets = write_head(tmp_path, kind, prefix)
    cfg = HeadConfig.from_dir(tmp_path, TARGET)
    assert cfg.kind == kind
    names = check_head(tmp_path, cfg)
    assert len(names) == len(cfg.shapes()) + (2 if kind == "eagle3" else 0)
    vocab = read_vocab_map(tmp_path, cfg)
    if kind == "eagle3":
        assert cfg.draft_vocab_size == DRAFT_VOCAB and vocab.tolist() == targets.tolist()
    else:
        assert vocab.tolist() == list(range(512))  # the target's own lm_head


@pytest.mark.parametrize("config, field", [
    (dict(vocab_size=1000), "vocab_size is 1000, the target's is 512"),
    (dict(target_hidden_size=32), "target_hidden_size is 32, the target's is 64"),
    (dict(architectures=["LlamaForCausalLM"]), "architectures ['LlamaForCausalLM'] name no supported draft head"),
    (dict(num_hidden_layers=2), "num_hidden_layers is 2"),
    (dict(draft_vocab_size=4096), "draft_vocab_size 4096 is not within the vocabulary"),
])
def test_a_head_for_another_model_is_refused_naming_the_field(tmp_path, config, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        write_head(tmp_path, "eagle3", config=config)


def test_an_eagle1_head_must_work_in_the_targets_width(tmp_path):
    with pytest.raises(ValueError, match="hidden_size is 32, the target's is 64"):
        write_head(tmp_path, "eagle", config=dict(hidden_size=32, target_hidden_size=64))


@pytest.mark.parametrize("drop, reshape, message", [
    ("midlayer.hidden_norm.weight", None, "missing midlayer.hidden_norm.weight"),
    ("d2t", None, "missing d2t"),
    (None, "fc.weight", r"fc.weight: shape \(3, 3\) != \(64, 192\)"),
])
def test_a_broken_head_is_refused_naming_the_tensor(tmp_path, drop, reshape, message):
    write_head(tmp_path, "eagle3", drop=drop, reshape=reshape)
    with pytest.raises(WeightError, match=message):
        check_head(tmp_path, HeadConfig.from_dir(tmp_path, TARGET))


def test_a_vocabulary_map_outside_the_targets_vocabulary_is_refused(tmp_path):
    write_head(tmp_path, "eagle3")
    cfg = HeadConfig.from_dir(tmp_path, TARGET)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 512  # every draft id maps past the vocabulary
    save_file(tensors, str(tmp_path / "model.safetensors"))
    check_head(tmp_path, cfg)  # shapes are right...
    with pytest.raises(WeightError, match="d2t maps draft ids outside the vocabulary"):
        read_vocab_map(tmp_path, cfg)  # ... the map is not
