"""Speculation is lossless, helps where it should, indexes every token, and reports what it did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import count_chained, draft_every_other_step
from scipy.stats import chisquare
from wandb_records import history

from kernels.tree_accept import accept_trees_ref
from rollout import Engine, SamplingParams, SpecConfig
from rollout.engine.sampler import SamplingTensors, sample, sequence_key
from rollout.tools.datasets import arithmetic_tasks, chat_prompt_ids
from rollout.tools.wandb_log import WandbLogger

QUESTIONS = [
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list, then the same for the product.",
    arithmetic_tasks(1, seed=3)[0].question,
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def spec_engine(default_model_dir):
    return Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")


@pytest.fixture(scope="module")
def prompts(default_engine):
    return [chat_prompt_ids(default_engine.tokenizer, q) for q in QUESTIONS]


def run(engine, prompts, params):
    return [o for group in engine.generate(prompts, params, return_logprob=True) for o in group]


def test_spec_on_matches_spec_off_greedy_with_groups_and_stop_strings(default_engine, spec_engine, prompts):
    params = [
        SamplingParams(temperature=0, max_new_tokens=40),
        SamplingParams(temperature=0, max_new_tokens=40, n=2),
        SamplingParams(temperature=0, max_new_tokens=40, stop=["\n\n", "5"]),
        SamplingParams(temperature=0, max_new_tokens=40, stop=[","], n=2),
    ]
    off, on = run(default_engine, prompts, params), run(spec_engine, prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    for a, b in zip(off, on):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    drafted = sum(o.spec["draft_tokens"] for o in on)
    accepted = sum(o.spec["accepted_tokens"] for o in on)
    assert drafted > 0 and accepted > 0  # not vacuous: drafts were made and taken


def test_sampled_outputs_spec_on_equal_spec_off_for_every_seed(default_engine, spec_engine, prompts):
    """With counter-based randomness each token is drawn with the same key either way, so the
    first-k-token distributions agree because the draws agree, seed by seed."""
    params = SamplingParams(n=8, temperature=1.0, top_p=0.95, max_new_tokens=12, seed=11)
    off, on = run(default_engine, prompts[:2], params), run(spec_engine, prompts[:2], params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert len({tuple(o.token_ids[:4]) for o in off}) > 4  # really sampling
    assert sum(o.spec["accepted_tokens"] for o in on) > 0


def test_an_engine_recovered_from_a_failed_step_drafts_from_the_scan_table_its_runner_reads(default_engine, default_model_dir,
                                                                                           prompts):
    """recover() forgets the index in place: the runner (and any CUDA graph it captured) reads the
    same scan table the index writes, so drafting goes on, losslessly."""
    engine = Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")
    params = SamplingParams(temperature=0, max_new_tokens=30)
    run(engine, prompts[:1], params)
    scan = engine.spec.index.scan
    engine.add_request(prompts[1], params)
    engine.step()
    assert [r.rid for r in engine.recover()] and engine.pool.used_slots == 0
    assert engine.spec.index.scan is scan and engine.runner.drafters.get("ngram").settings.scan is scan
    assert (scan == -1).all() and engine.spec.index.history_rows_used == 0
    on, off = run(engine, prompts, params), run(default_engine, prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert sum(o.spec["accepted_tokens"] for o in on) > 0


def test_a_decode_step_chained_after_a_verify_step_changes_no_output(default_engine, default_model_dir, prompts):
    """The overlap schedule launches a decode step before the verify step it follows is collected:
    its input token, position and KV slot come from the accepted paths found on the device."""
    engine = Engine(model=str(default_model_dir), spec=SpecConfig(method="ngram", adaptive=False), device="cpu")
    draft_every_other_step(engine)
    chained = count_chained(engine)
    greedy = [SamplingParams(temperature=0, max_new_tokens=40, n=2), SamplingParams(temperature=0, max_new_tokens=40, stop=[","])]
    sampled = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=16, seed=5)
    for params, some in ((greedy * 2, prompts), (sampled, prompts[:2])):
        off, on = run(default_engine, some, params), run(engine, some, params)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
        for a, b in zip(off, on):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert chained[1] > 10 and engine.stats()["rollout/spec_accepted_tokens"] > 10
    assert engine.pool.used_slots == 0


def node_logits(prefix: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed toy target model: logits after `prefix`, different for every prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(vocab, generator=g) * 1.5


def test_tree_verification_emits_exactly_the_target_distribution():
    """Monte Carlo over 200k keys: the first two tokens emitted through a draft tree by the step's
    accept walk (plus the next plain step when the walk stops at the root) follow p(x) p(y | x)."""
    vocab, trials = 5, 200_000
    # root -> {1, 3}; 1 -> {0}; 3 -> {2, 4}; node 6 is padding
    tokens = torch.tensor([7, 1, 3, 0, 2, 4, 0])
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, -2])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 1])
    ancestors = torch.tensor([1, 0b11, 0b101, 0b1011, 0b10101, 0b100101, 0b1000001])
    prefixes = [(), (1,), (3,), (1, 0), (3, 2), (3, 4), ()]
    keys = torch.tensor([sequence_key(99, i) for i in range(trials)], dtype=torch.int64)
    targets = torch.stack(
        [torch.from_numpy(draw_at(node_logits(p, vocab).expand(trials, vocab), keys, int(d)))
         for p, d in zip(prefixes, depths.tolist())], dim=1,
    )  # [trials, nodes]
    n = len(tokens)
    expand = lambda t: t.expand(trials, n).contiguous()  # noqa: E731
    out, _, length, _ = accept_trees_ref(
        expand(parents), expand(ancestors), expand(depths), expand(tokens), targets, torch.zeros(trials, n),
        torch.zeros(trials, dtype=torch.int32), torch.zeros(trials, n, dtype=torch.long),
        torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
        padding_row=0,  # (every sequence sits in the padding row: only the outputs are read)
    )
    first = out[:, 0].numpy()
    second = np.where(length.numpy() > 1, out[:, 1].numpy(), -1)
    stopped = second < 0  # the walk emitted only the bonus: the next plain step draws at position 1
    cont = torch.stack([node_logits((int(x),), vocab) for x in first[stopped]])
    second[stopped] = draw_at(cont, keys[stopped], position=1)

    p1 = torch.softmax(node_logits((), vocab) / 0.8, -1).double()
    expected = np.array([[p1[x] * torch.softmax(node_logits((x,), vocab) / 0.8, -1).double()[y] for y in range(vocab)]
                         for x in range(vocab)]).ravel() * trials
    observed = np.bincount(first * vocab + second, minlength=vocab * vocab)
    expected *= observed.sum() / expected.sum()  # float32 softmax sums to 1 only within rounding
    assert chisquare(observed, expected).pvalue > 0.001
    assert 0 < (length > 1).float().mean() < 1  # drafts were accepted, and rejected


def draw_at(logits_rows: torch.Tensor, keys: torch.Tensor, position: int) -> np.ndarray:
    n = len(logits_rows)
    st = SamplingTensors(
        temperature=torch.full((n,), 0.8), top_k=torch.full((n,), -1, dtype=torch.int64), top_p=torch.ones(n),
        min_p=torch.zeros(n), keys=keys, positions=torch.full((n,), position), all_greedy=False, any_truncation=False,
    )
    return sample(logits_rows, st)[0].numpy()


def test_sibling_sharing_raises_accept_length(default_model_dir, capsys):
    task = arithmetic_tasks(1, seed=0)[0]
    lengths = {}
    for share in (True, False):
        eng = Engine(model=str(default_model_dir), device="cpu",
                     spec=SpecConfig(method="ngram", share_siblings=share, adaptive=False), kv_cache_tokens=8192)
        prompt = chat_prompt_ids(eng.tokenizer, task.question)
        eng.generate([prompt], SamplingParams(n=8, temperature=0.7, max_new_tokens=24, seed=5))
        lengths[share] = eng.stats()["rollout/spec_accept_length"]
    with capsys.disabled():
        print(f"\naccept length, 8 samples at T=0.7: with sibling sharing {lengths[True]:.3f}, "
              f"without {lengths[False]:.3f}")
    assert lengths[True] > lengths[False]


def test_acceptance_statistics_reach_stats_and_wandb(spec_engine, prompts, tmp_path):
    spec_engine.reset_stats()
    outs = run(spec_engine, prompts[:2], SamplingParams(temperature=0, max_new_tokens=24))
    stats = spec_engine.stats()
    assert stats["rollout/spec_draft_tokens"] == sum(o.spec["draft_tokens"] for o in outs) > 0
    assert stats["rollout/spec_draft_tokens/ngram"] == stats["rollout/spec_draft_tokens"]
    assert 0 < stats["rollout/spec_accept_rate"] <= 1 and stats["rollout/spec_accept_length"] >= 1
    logger = WandbLogger("rollout-test", directory=tmp_path)
    logger.log(stats, step=1)
    logger.finish()
    (row,) = history(logger.run_dir)
    for key in ["rollout/spec_accept_rate", "rollout/spec_accept_length", "rollout/spec_draft_tokens",
                "rollout/spec_accept_rate/ngram", "rollout/spec_draft_tokens/ngram", "rollout/tokens_per_s",
                "rollout/weight_version", "rollout/weight_sync_s"]:
        assert row[key] == pytest.approx(stats[key])


