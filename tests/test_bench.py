"""`rollout bench` end to end on the CPU: small, but every output it promises."""

import copy
import gc
import json

import pytest
import torch

from rollout.tools.bench import GcTimer, expected_prefix, match_chances
from rollout.tools.bench_args import TRAINER_STARTS
from rollout.tools.cli import main
from rollout.tools.mismatch import spread_in_rounding, start_trainer_weights


def test_bench_writes_json_markdown_and_plot_with_medians_of_repeats(default_model_dir, tmp_path, monkeypatch):
    from rollout.config import SamplingParams
    from rollout.tools import bench

    seeds, run_rollout = [], bench.run_rollout
    monkeypatch.setattr(bench, "run_rollout", lambda *a, seed, **k: seeds.append((a[4], seed)) or run_rollout(*a, seed=seed, **k))
    params, init = [], SamplingParams.__init__
    monkeypatch.setattr(SamplingParams, "__init__", lambda self, *a, **k: params.append(self) or init(self, *a, **k))
    main([
        "bench", "--device", "cpu", "--model", str(default_model_dir), "--workload", "grpo", "--prompt-set",
        "arithmetic", "--spec-modes", "off,ngram", "--batch-sizes", "2", "--n", "2", "--output-len", "8",
        "--repeats", "2", "--ignore-eos", "--out", str(tmp_path),
    ])
    (result,) = tmp_path.glob("grpo-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [(r["spec"], r["batch_size"], r["repeats"]) for r in rows] == [("off", 2, 2), ("ngram", 2, 2)]
    counts = ("batch_size", "prompts", "n", "output_tokens", "steps", "draft_steps")
    assert all(isinstance(r[k], int) for r in rows for k in counts)  # an even number of repeats: no 2.0 or 7.5
    off, ngram = rows
    assert off["output_tokens"] == ngram["output_tokens"] > 0  # greedy on the CPU: speculation changes no token
    assert params and all(p.ignore_eos for p in params)  # --ignore-eos: every sample runs to --output-len
    assert all(r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] for r in rows)
    assert off["draft_steps"] == 0  # (how many n-gram drafts depends on the measured costs)
    assert ngram["indexed"] == 1.0  # every sample's tokens are in its history row
    assert result.with_suffix(".md").exists() and result.with_suffix(".png").exists()
    measured = [s for i, s in enumerate(seeds) if i % 4 >= 2]  # a round: the warm-ups (off, n-gram), then the runs
    assert [spec for spec, _ in measured] == ["off", "ngram"] * 2
    assert measured[0][1] == measured[1][1] != measured[2][1] == measured[3][1]  # a round's seed is every mode's, rounds differ
    assert len({seed for _, seed in seeds}) == 4  # (warm-ups too: no round's samples are another's)


def test_the_mismatch_workload_tables_each_dtype_against_a_float32_trainer(default_model_dir, tmp_path):
    main([
        "bench", "--device", "cpu", "--model", str(default_model_dir), "--workload", "mismatch", "--spec-modes", "off",
        "--dtypes", "float32,float16", "--batch-sizes", "4", "--n", "2", "--output-len", "12", "--out", str(tmp_path),
        "--trainer-start", "served",
    ])
    (result,) = tmp_path.glob("mismatch-*.json")
    fp32, fp16 = json.loads(result.read_text())["rows"]
    assert (fp32["dtype"], fp16["dtype"]) == ("float32", "float16") and fp32["samples"] == fp16["samples"] == 4
    assert fp32["trainer"] == fp16["trainer"] == "served"
    assert fp32["logprob_mismatch_max"] < 1e-4 < fp16["logprob_mismatch_mean"] < 0.02  # the CPU's fp32 is HF's to 1e-4
    assert fp16["logprob_mismatch_mean"] <= fp16["logprob_mismatch_p99"] <= fp16["logprob_mismatch_max"]
    assert all(r["tokens_per_s"] > 0 and r["kl_k3"] >= 0 for r in (fp32, fp16))
    assert "vs fp32 trainer" in result.with_suffix(".md").read_text()


def test_the_rl_workload_reports_its_long_tail_and_plots_its_timeline(default_model_dir, tmp_path):
    main([
        "bench", "--device", "cpu", "--model", str(default_model_dir), "--workload", "rl", "--spec-modes", "off,ngram",
        "--batch-sizes", "4", "--n", "2", "--output-len", "12", "--out", str(tmp_path),
    ])
    (result,) = tmp_path.glob("rl-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {r["temperature"] for r in rows} == {1.0}  # rl samples at T = 1 unless told otherwise
    assert all(0 <= r["tail_s"] <= r["wall_s"] and r["gc_ms"] >= 0 for r in rows)
    assert rows[1]["indexed"] == 1.0
    assert list(tmp_path.glob("rl-*-timeline.png"))


def test_a_coupled_second_epoch_after_a_trainer_step_drafts_from_the_first(default_model_dir, tmp_path):
    # --spec-no-adaptive: every step drafts, whatever the CPU's timings say (the adaptive budget
    # weighs measured step costs, and on a loaded CI machine it may verify no drafts at all)
    main([
        "bench", "--device", "cpu", "--model", str(default_model_dir), "--workload", "rl", "--spec-modes", "off,ngram",
        "--batch-sizes", "4", "--n", "2", "--output-len", "24", "--keep-history", "--coupled-sampling", "--repeats", "1",
        "--spec-no-adaptive", "--spec-max-verify-tokens", "16", "--epoch-update", "1e-6", "--epoch-update-samples", "4",
        "--out", str(tmp_path),
    ])
    off, ngram = json.loads(next(tmp_path.glob("rl-*.json")).read_text())["rows"]
    assert off["output_tokens"] == ngram["output_tokens"]  # fp32 on the CPU: the same samples
    assert off["coupled_share"] == 0 < ngram["coupled_share"] <= 1


def test_gc_timer_times_collections_only_inside_its_block():
    pauses = []
    with GcTimer(on_pause=pauses.append) as timer:
        gc.collect()
        gc.collect()
    inside = timer.seconds
    gc.collect()
    assert inside > 0 and timer.seconds == inside
    assert len(pauses) >= 2 and sum(pauses) == pytest.approx(inside)  # each collection, reported as it ends


def test_engines_on_one_gpu_take_the_first_ones_pool_and_leave_room_for_their_graphs(monkeypatch):
    """The first of three engines takes a share of the memory free after the weights they share
    that leaves GRAPH_SHARE per later engine for graphs; the later ones take its pool in tokens
    (each pool as a share of the memory free before the weights left the Qwen3-30B-A3B shape's
    second engine too little to capture its graphs); a configured pool size is kept."""
    from types import SimpleNamespace

    from rollout.config import EngineConfig
    from rollout.tools import bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    fraction = bench.first_pool_fraction(0.85, 3, "auto")
    assert 3 * fraction + 2 * bench.GRAPH_SHARE == pytest.approx(0.85)
    first, later, fixed = EngineConfig(), EngineConfig(), EngineConfig(kv_cache_tokens=1000)
    bench.size_pool(first, None, fraction)
    built = SimpleNamespace(pool=SimpleNamespace(num_slots=40_001))  # (slot 0 is padding's)
    bench.size_pool(later, built, fraction)
    bench.size_pool(fixed, built, fraction)
    assert first.kv_cache_memory_fraction == fraction and first.kv_cache_tokens is None
    assert later.kv_cache_tokens == 40_000 and fixed.kv_cache_tokens == 1000
    assert bench.first_pool_fraction(0.85, 1, "auto") is None and bench.first_pool_fraction(0.85, 3, "cpu") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_spread_weights_round_to_the_served_ones_from_anywhere_in_their_interval(dtype):
    """--trainer-start spread: the trainer's float32 weights serve exactly the weights the engine
    holds, yet sit off the rounding ties (powers of two, zero and negatives included)."""
    t = torch.cat([torch.randn(100_000) * 0.05, torch.tensor([0.5, -0.5, 1.0, -2.0, 0.0, 0.0078125])])
    served = t.to(dtype).float()
    spread = spread_in_rounding(t, dtype, torch.Generator().manual_seed(0))
    assert torch.equal(spread.to(dtype).float(), served)
    moved = (spread - served).abs() / served.abs().clamp_min(1e-30)
    eps = torch.finfo(dtype).eps
    assert moved.max() < eps / 2 and moved.mean() > eps / 16  # within half a place, and spread over it
    assert torch.equal(spread_in_rounding(t, torch.float32, torch.Generator()), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_trainer_starts_from_the_checkpoint_the_served_weights_or_their_rounding_interval(dtype):
    """--trainer-start: 'checkpoint' keeps the float32 values, 'served' holds exactly what an engine
    in `dtype` serves, 'spread' serves it too from elsewhere in the interval; anything else is refused."""
    checkpoint = torch.nn.Linear(64, 32)
    starts = {}
    for start in TRAINER_STARTS:
        model = copy.deepcopy(checkpoint)
        start_trainer_weights(model, start, dtype)
        starts[start] = model.weight.detach()
    served = checkpoint.weight.detach().to(dtype).float()
    assert torch.equal(starts["checkpoint"], checkpoint.weight) and torch.equal(starts["served"], served)
    assert torch.equal(starts["spread"].to(dtype).float(), served) and not torch.equal(starts["spread"], served)
    with pytest.raises(ValueError, match="trainer start"):
        start_trainer_weights(checkpoint, "bf16", dtype)


def test_match_chances_are_those_of_draws_with_shared_gumbel_noise():
    """bench/coupling_bound.py's closed form: with the same Gumbel noise, old and new argmax agree
    on the old token x with chance 1 / sum_j max(p_j, q_j p_x / q_x); exact verification accepts
    x with min(1, q_x / p_x), never less often."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(2, 7, generator=g) * 1.5
    new = old + torch.randn(2, 7, generator=g) * 0.5
    noise = -torch.log(-torch.log(torch.rand(400_000, 7, generator=g)))
    for row in range(2):
        first, second = (old[row] + noise).argmax(-1), (new[row] + noise).argmax(-1)
        for x in range(7):
            drawn = first == x
            if drawn.sum() < 20_000:
                continue
            gumbel, exact = match_chances(old[row : row + 1], new[row : row + 1], torch.tensor([x]))
            assert float(gumbel) == pytest.approx(float((second[drawn] == x).float().mean()), abs=0.01)
            assert float(exact) >= float(gumbel) - 1e-6
    assert expected_prefix(torch.tensor([1.0, 0.5, 0.5])) == pytest.approx(1 + 0.5 + 0.25)
