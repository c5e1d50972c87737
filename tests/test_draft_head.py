"""Draft heads on disk (spec/draft_head.py): EAGLE-3 and EAGLE-1 layouts of random tiny heads
load, and a head for another model or a broken one is an error naming the field or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tiny_models import make_tiny_model

from kernels.attention import AttentionMetadata
from kernels.torch_attention import TorchAttention
from rollout.engine.model_runner import rope_tables
from rollout.models.config import ModelConfig
from rollout.models.llama import ForwardContext
from rollout.models.loader import build_model, load_checkpoint
from rollout.models.weights import WeightError
from spec.draft_head import DraftHead, HeadConfig, check_head, load_head, read_vocab_map, unrolled

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
    tensors = {name: 0.2 * torch.randn(shape, generator=gen) for name, shape in cfg.shapes().items()}
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
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}), "eagle_aux_hidden_state_layer_ids"),
])
def test_a_head_for_another_model_is_refused_naming_the_field(tmp_path, config, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        write_head(tmp_path, "eagle3", config=config)


def test_an_eagle1_head_must_work_in_the_targets_width(tmp_path):
    with pytest.raises(ValueError, match="hidden_size is 32, the target's is 64"):
        write_head(tmp_path, "eagle", config=dict(hidden_size=32, head_dim=16, target_hidden_size=64))


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


def _one_sequence(slots: torch.Tensor) -> tuple[AttentionMetadata, TorchAttention]:
    """A prefill of one sequence whose tokens go to `slots`, planned on the reference backend."""
    t = len(slots)
    meta = AttentionMetadata(seq_rows=torch.zeros(1, dtype=torch.int32), kv_lens=torch.tensor([t], dtype=torch.int32),
                             qo_indptr=torch.tensor([0, t], dtype=torch.int32), slot_table=slots[None].to(torch.int32),
                             out_slots=slots, tree_mask=None, max_q_len=t, max_kv_len=t)
    backend = TorchAttention()
    backend.plan(meta)
    return meta, backend


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_the_head_layer_over_the_paged_cache_matches_it_written_out(tmp_path, kind):
    write_head(tmp_path, kind, prefix="model.")
    head = load_head(tmp_path, TARGET, layer=1)
    gen = torch.Generator().manual_seed(1)
    t = 7
    ids = torch.randint(0, 512, (t,), generator=gen)
    width = 3 * 64 if kind == "eagle3" else 64
    hidden = torch.randn(t, width, generator=gen)
    embed = torch.nn.Embedding(512, 64)
    lm_head_weight = torch.randn(512, 64, generator=gen)
    slots = torch.randperm(32, generator=gen)[:t]  # the sequence's tokens where the pool put them
    meta, backend = _one_sequence(slots)
    cos, sin = rope_tables(TARGET, t, torch.device("cpu"))
    caches = [torch.zeros(32, 2, 16) for _ in range(2)]  # layer 0: the target's (unused here), layer 1: the head's
    ctx = ForwardContext(meta, backend, caches, [torch.zeros(32, 2, 16) for _ in range(2)], cos, sin)
    with torch.no_grad():
        logits, out = head(ids, hidden, ctx, embed, lm_head_weight)
        (want_logits, want_out), = unrolled(head, embed, ids, hidden, cos, sin, 1, lm_head_weight)
    assert logits.shape == (t, DRAFT_VOCAB if kind == "eagle3" else 512)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert caches[0].abs().sum() == 0 and caches[1].abs().sum() > 0  # its KV went to its own layer


def test_an_mtp_layer_over_the_paged_cache_matches_it_written_out():
    """MiMo's MTP layer (input_proj over the normed hidden state and embedding, a Qwen2 decoder
    layer with q/k/v biases, a final norm, the target's lm_head) over one sequence in permuted
    slots, against the layer written out in plain torch."""
    target = ModelConfig.from_dict(dict(model_type="mimo", vocab_size=512, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_nextn_predict_layers=1))
    head = DraftHead(HeadConfig.mtp(target), target, layer=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if p.dim() == 1 and p.shape[0] == 64 else 0.0))
    assert "mtp_layers.0.self_attn.q_proj.bias" in head.weight_targets()
    t = 7
    ids = torch.randint(0, 512, (t,), generator=gen)
    hidden = torch.randn(t, 64, generator=gen)
    embed = torch.nn.Embedding(512, 64)
    lm_head_weight = torch.randn(512, 64, generator=gen)
    slots = torch.randperm(32, generator=gen)[:t]
    meta, backend = _one_sequence(slots)
    cos, sin = rope_tables(target, t, torch.device("cpu"))
    caches = [torch.zeros(32, 2, 16) for _ in range(2)]
    ctx = ForwardContext(meta, backend, caches, [torch.zeros(32, 2, 16) for _ in range(2)], cos, sin)
    with torch.no_grad():
        logits, out = head(ids, hidden, ctx, embed, lm_head_weight)
        (want_logits, want_out), = unrolled(head, embed, ids, hidden, cos, sin, 1, lm_head_weight)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no MTP layers"):
        HeadConfig.mtp(TARGET)


def test_the_target_hands_a_head_the_hidden_states_entering_its_layers_as_hf_computes_them(tmp_path):
    """EAGLE-3 reads the target's hidden state entering three of its layers: transformers'
    `hidden_states[i]` (the embeddings for layer 0); EAGLE-1 its last, after the final norm."""
    hf = make_tiny_model("llama", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    load_checkpoint(model, tmp_path)
    t = 9
    ids = torch.randint(3, 512, (t,), generator=torch.Generator().manual_seed(2))
    slots = torch.arange(t)
    meta, backend = _one_sequence(slots)
    cos, sin = rope_tables(cfg, t, torch.device("cpu"))
    caches = lambda: [torch.zeros(t, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]  # noqa: E731
    aux = torch.zeros(t, 3 * cfg.hidden_size)
    last = cfg.num_layers  # (EAGLE-1's feature: the last layer's output after the final norm)
    ctx = ForwardContext(meta, backend, caches(), caches(), cos, sin, aux_layers=(1, 0, last), aux_hidden=aux)
    with torch.no_grad():
        model(ids, ctx, None)
        want = hf(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux[:, :64], want[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[:, 64:128], want[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[:, 128:], want[last][0], atol=1e-5, rtol=1e-5)


def test_the_unrolled_head_drafts_a_chain_as_the_paged_head_does(tmp_path):
    """Step 1 of `unrolled` (what training sees) at position t is a draft after the root t: the
    paged head over positions 0..t, then one more row at t + 1 whose input is the next token and
    the head's own output at t, attending to all of them."""
    write_head(tmp_path, "eagle3")
    head = load_head(tmp_path, TARGET, layer=0)
    gen = torch.Generator().manual_seed(3)
    t_all, root = 8, 4
    ids = torch.randint(0, 512, (t_all,), generator=gen)
    hidden = torch.randn(t_all, 3 * 64, generator=gen)
    embed = torch.nn.Embedding(512, 64)
    cos, sin = rope_tables(TARGET, t_all + 1, torch.device("cpu"))
    with torch.no_grad():
        steps = unrolled(head, embed, ids, hidden, cos, sin, steps=2)
        k, v = [torch.zeros(32, 2, 16)], [torch.zeros(32, 2, 16)]
        slots = torch.arange(1, root + 3)
        meta, backend = _one_sequence(slots[: root + 1])
        ctx = ForwardContext(meta, backend, k, v, cos[: root + 1], sin[: root + 1])
        _, out = head(ids[: root + 1], hidden[: root + 1], ctx, embed)
        meta = AttentionMetadata(seq_rows=torch.zeros(1, dtype=torch.int32), kv_lens=torch.tensor([root + 2], dtype=torch.int32),
                                 qo_indptr=torch.tensor([0, 1], dtype=torch.int32), slot_table=slots[None].to(torch.int32),
                                 out_slots=slots[root + 1 :], tree_mask=None, max_q_len=1, max_kv_len=root + 2)
        backend.plan(meta)
        ctx = ForwardContext(meta, backend, k, v, cos[root + 1 : root + 2], sin[root + 1 : root + 2])
        logits, _ = head(ids[root + 1 : root + 2], out[root : root + 1], ctx, embed)
    torch.testing.assert_close(logits[0], steps[1][0][root], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(steps[1][0][root], steps[0][0][root + 1], atol=1e-3)  # (not step 0 at t + 1)
