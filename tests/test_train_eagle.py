"""recipes/train_eagle.py on a tiny random target (CPU): the head learns the target's own
outputs, and what it writes is an EAGLE-3 checkpoint that spec/draft_head.py loads."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from tiny_models import make_tiny_model

from rollout import Engine
from spec.draft_head import default_aux_layers, load_head, unrolled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import train_eagle  # noqa: E402


def test_a_head_trained_on_the_targets_samples_learns_them_and_loads(tmp_path):
    make_tiny_model("llama", tmp_path / "target", layers=4)
    engine = Engine(model=str(tmp_path / "target"), spec="off", device="cpu", max_running_seqs=16)
    args = train_eagle.parse_args([
        "--out", str(tmp_path / "head"), "--device", "cpu", "--temperature", "0.7", "--max-new-tokens", "40",
        "--draft-vocab", "128", "--intermediate-size", "64", "--ttt", "2", "--steps", "200", "--batch", "4",
        "--lr", "1e-2",
    ])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 12))] for _ in range(16)]
    data = train_eagle.sample_data(engine, prompts, args)
    draft_ids = train_eagle.draft_vocabulary(data, args.draft_vocab, 512)
    responses = [t for ids, p in data for t in ids[p:]]
    assert len(draft_ids) == 128 and bool((draft_ids[1:] > draft_ids[:-1]).all())
    covered = sum(t in set(draft_ids.tolist()) for t in responses) / len(responses)
    assert covered > 0.5  # the tokens the target samples most

    head, records = train_eagle.train(engine, data, draft_ids, args, log=lambda line: None)
    assert records[-1]["loss"] < 0.8 * records[0]["loss"], records
    assert records[-1]["top1"] > records[0]["top1"] + 0.1, records  # it drafts the target's own choice more often

    layers = default_aux_layers(4)
    size = train_eagle.write_head(head, draft_ids, engine.model.config, layers, tmp_path / "head")
    loaded = load_head(tmp_path / "head", engine.model.config, layer=4)
    assert size > 0 and loaded.draft_to_target.tolist() == draft_ids.tolist()
    assert loaded.cfg.aux_layers == layers  # (from eagle_config, in SGLang's convention)
    target = train_eagle.Target(engine, layers)
    ids, _ = data[0]
    aux, _ = target(ids)
    tokens, cos, sin = torch.tensor(ids), engine.runner.cos, engine.runner.sin
    embed = engine.model.model.embed_tokens
    with torch.no_grad():
        (trained, _), = unrolled(head, embed, tokens[1:], aux[:-1], cos, sin)
        (read, _), = unrolled(loaded.float(), embed, tokens[1:], aux[:-1], cos, sin)
    assert (trained.argmax(-1) == read.argmax(-1)).float().mean() > 0.9  # the same head, in bf16


def test_the_heads_prompts_leave_out_the_benchmarks(tmp_path, monkeypatch):
    """The head trains on none of the prompts rollout bench measures: neither its ShareGPT batches
    (the first of the same shuffle) nor its arithmetic tasks (seed 0)."""
    import json

    from rollout.tools.datasets import arithmetic_tasks, sharegpt_prompts

    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"question number {i} please"}]}) + "\n"
                            for i in range(train_eagle.BENCH_HELD_OUT + 40)))
    seen: list[str] = []
    monkeypatch.setattr(train_eagle, "chat_prompt_ids", lambda tok, q: seen.append(q) or [1])
    args = train_eagle.parse_args(["--out", "-", "--prompts", "64", "--sharegpt", str(path)])
    assert len(train_eagle.prompts_for(SimpleNamespace(tokenizer=None), args)) == 64
    bench = set(sharegpt_prompts(train_eagle.BENCH_HELD_OUT, path=path)) | {t.question for t in arithmetic_tasks(64)}
    assert len(seen) == 64 and not bench & set(seen)
