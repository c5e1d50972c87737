"""The user's story end to end: GRPO steps through the server, a weight push after each."""

from __future__ import annotations

import sys
from pathlib import Path

import requests
import torch
from server_process import running_server
from transformers import AutoTokenizer
from wandb_records import history

from rollout.tools.launch import launched_router

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import grpo  # noqa: E402

ACCEPTANCE_KEYS = ["rollout/spec_accept_rate", "rollout/spec_accept_length", "rollout/spec_draft_tokens",
                   "rollout/spec_accept_rate/ngram", "rollout/spec_draft_tokens/ngram"]


def test_two_grpo_steps_push_weights_log_acceptance_and_serve_the_new_weights(default_model_dir, tmp_path, monkeypatch):
    """Through sglang-router, in front of a server of two replicas: every replica takes the pushes."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))  # the user's, over --out
    with running_server(str(default_model_dir), "--kv-cache-tokens", "16384", "--spec", "ngram",
                        "--spec-no-adaptive", "--dp-size", "2") as server, launched_router([server.url]) as router:
        args = grpo.parse_args(["--server", router.url, "--steps", "2", "--prompts", "2", "--n", "2",
                                "--max-new-tokens", "16", "--device", "cpu", "--out", str(tmp_path / "out"), "--lr", "1e-4"])
        result = grpo.run(args)

        replicas = requests.get(server.url + "/server_info").json()["replicas"]
        assert [r["weight_version"] for r in replicas] == ["2", "2"]
        assert [r.weight_version for r in result.records] == [1, 2]
        assert all(r.mismatch["logprob_mismatch_mean"] < 1e-3 for r in result.records)  # fp32 on both sides

        assert result.run_dir.is_relative_to(tmp_path / "wandb-dir"), result.run_dir
        rows = history(result.run_dir)
        assert [row["_step"] for row in rows] == [1, 2]
        for row in rows:
            for key in ACCEPTANCE_KEYS + ["grpo/reward", "rollout/weight_sync_s", "rollout/tokens_per_s"]:
                assert key in row, key
        assert sum(row["rollout/spec_draft_tokens"] for row in rows) > 0
        assert (result.run_dir / "grpo.png").stat().st_size > 0

        # what the server now generates comes from the trainer's latest weights
        prompt = "What is 12 + 30?"
        out = requests.post(server.url + "/generate", json={
            "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}).json()
        assert out["meta_info"]["output_token_weight_versions"] == ["2"] * len(out["output_ids"])
        ids = torch.tensor([AutoTokenizer.from_pretrained(default_model_dir).encode(prompt)])
        expected = result.policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        assert out["output_ids"] == expected[0, ids.shape[1]:].tolist()


def test_the_recipes_figure_has_integer_steps_a_legend_clear_of_the_axes_and_names_the_drafters():
    mismatch = {"logprob_mismatch_mean": 0.01, "logprob_mismatch_p99": 0.05, "logprob_mismatch_max": 0.2, "kl_k3": 1e-4}
    records = [grpo.StepRecord(step=k, reward=0.1 * k, mismatch=mismatch, rollout_s=2.0 / k,
                               tokens_per_s=100.0, weight_version=k, weight_sync_s=0.1,
                               spec={"rollout/spec_accept_rate/ngram": 0.3, "rollout/spec_accept_rate/eagle": 0.2})
               for k in (1, 2)]
    fig = grpo.figure(records)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks = [t for ax in fig.axes for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    assert "accept rate, ngram drafts" in labels and "accept rate, eagle drafts" in labels, labels
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_tightbbox(renderer)), "the legend covers an axis or its labels"


def test_the_recipe_rolls_out_coupled_in_float16_with_tis_and_compares_with_a_spec_off_server(default_model_dir, tmp_path,
                                                                                              monkeypatch):
    """--coupled-sampling --dataset-size: the second step meets the first step's prompts, drawn with
    the same noise, and drafts from them; --compare-spec-off times the same rollout without speculation.
    --dtype float16 serves and pushes float16 (the trainer keeps float32), --tis 2.0 weights the loss;
    every step logs the mismatch against the trainer."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    args = grpo.parse_args(["--model", str(default_model_dir), "--steps", "1", "--final-rollout", "--prompts", "2",
                            "--n", "2", "--max-new-tokens", "12", "--dataset-size", "2", "--device", "cpu",
                            "--spec", "ngram", "--spec-no-adaptive", "--coupled-sampling", "--compare-spec-off",
                            "--dtype", "float16", "--tis", "2.0", "--out", str(tmp_path), "--lr", "1e-6"])
    result = grpo.run(args)
    first, second = result.records
    assert first.off_tokens_per_s > 0 and second.off_tokens_per_s > 0
    assert second.spec["rollout/spec_draft_tokens/coupled"] > 0
    assert second.spec["rollout/spec_accept_rate/coupled"] > 0.5
    rows = history(result.run_dir)
    assert [row["_step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0 < row["grpo/logprob_mismatch_mean"] < 0.01  # float16 against the float32 trainer
        assert row["grpo/logprob_mismatch_mean"] <= row["grpo/logprob_mismatch_p99"] <= row["grpo/logprob_mismatch_max"]
        assert row["grpo/kl_k3"] >= 0
