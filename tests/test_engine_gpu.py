"""The engine on a CUDA GPU: Triton attention, fused kernels, CUDA graphs. Run with `pytest -m gpu`.

Equality checks run in float32 (cuBLAS without TF32; the attention kernels use 3xTF32), where
different batch shapes still round alike often enough for greedy tokens to agree; bf16 is
checked for sanity and closeness of logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_probes import count_chained, draft_every_other_step

from rollout import Engine, SamplingParams
from rollout.engine.prefill_graphs import BUCKETS
from rollout.tools.datasets import arithmetic_tasks, chat_prompt_ids
from spec.step import to_device
from spec.token_table import TokenTable

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

QUESTIONS = [t.question for t in arithmetic_tasks(4, seed=1)] + [
    "Write a Python function that checks whether a string is a palindrome.",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "List the first five prime numbers.",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def engines(default_model_dir):
    make = lambda **kw: Engine(
        model=str(default_model_dir), device="cuda", dtype="float32", kv_cache_tokens=100_000, **kw
    )
    return {
        "graphs_spec_off": make(spec="off"),
        "graphs_no_overlap": make(spec="off", overlap_schedule=False),
        "eager_spec_off": make(spec="off", cuda_graphs=False),
        "graphs_spec_on": make(spec="ngram"),
    }


@pytest.fixture(scope="module")
def prompts(engines):
    return [chat_prompt_ids(engines["graphs_spec_off"].tokenizer, q) for q in QUESTIONS]


def run(engine, prompts, **params):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, **params), return_logprob=True)
    return [o for group in outs for o in group]


def agreement(a, b) -> float:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a)


def test_greedy_matches_hf_on_gpu_fp32(engines, prompts, hf_default):
    hf = hf_default.to("cuda")
    ours = run(engines["graphs_spec_off"], prompts, temperature=0)
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
        assert o.token_ids == ref[0, len(p):].tolist()
    hf.to("cpu")


def test_cuda_graphs_match_eager(engines, prompts):
    a = run(engines["graphs_spec_off"], prompts, temperature=0)
    b = run(engines["eager_spec_off"], prompts, temperature=0)
    assert agreement(a, b) == 1.0


def test_prefill_graphs_of_a_request_alone_match_eager(engines, prompts, hf_default):
    """A request alone prefills by replaying its token bucket's graph (rollout/engine/prefill_graphs.py);
    its tokens are the eager prefill's and HF's, its logprobs the eager ones' within float32 noise."""
    graphs = engines["graphs_spec_off"].runner.prefill_graphs
    assert graphs is not None and len(graphs._graphs) == len(BUCKETS)
    gen = torch.Generator().manual_seed(9)
    long = torch.randint(100, 20000, (300,), generator=gen).tolist()  # (bucket 512, from a start of 0)
    for prompt in [*prompts, long]:
        a, b = (run(engines[k], [prompt], temperature=0)[0] for k in ("graphs_spec_off", "eager_spec_off"))
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    hf = hf_default.to("cuda")
    ids = torch.tensor([prompts[0]], device="cuda")
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
    assert run(engines["graphs_spec_off"], [prompts[0]], temperature=0)[0].token_ids == ref[0, len(prompts[0]):].tolist()
    hf.to("cpu")


def test_decode_graphs_over_a_long_context_match_eager(engines):
    """A graph's attention splits the keys for the pool's full context, and spreads each step's
    real keys over the splits; with a context of ~1,000 tokens the tokens stay those of eager steps."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 20000, (1000,), generator=gen).tolist()
    a = run(engines["graphs_spec_off"], [prompt], temperature=0)
    assert agreement(a, run(engines["eager_spec_off"], [prompt], temperature=0)) == 1.0


def test_overlap_schedule_matches_waiting_for_every_step(engines, prompts):
    """Chained graph launches (input tokens read on the device) give the tokens of steps that
    wait for the host; sampled runs may differ where a chained step's batch still holds a
    sequence that stopped, which changes the padded graph and float32 rounding."""
    engine = engines["graphs_spec_off"]
    launch, collect = engine.runner.launch_decode, engine.runner.collect
    chained = count_chained(engine)
    try:
        a = run(engine, prompts, temperature=0)
        sampled = run(engine, prompts, temperature=1.0, n=4, seed=11)
    finally:
        engine.runner.launch_decode, engine.runner.collect = launch, collect
    assert chained[0] > MAX_NEW
    assert agreement(a, run(engines["graphs_no_overlap"], prompts, temperature=0)) == 1.0
    assert agreement(sampled, run(engines["graphs_no_overlap"], prompts, temperature=1.0, n=4, seed=11)) >= 0.9


def test_spec_on_matches_spec_off_greedy_and_sampled(engines, prompts):
    """Greedy agrees exactly. Sampled sequences agree but for rare draws that land within
    float32 rounding of a CDF boundary: cuBLAS rounds a verify step's larger matmuls
    differently from a decode step's (the CPU path is batch-invariant and agrees exactly)."""
    off = run(engines["graphs_spec_off"], prompts, temperature=0)
    on = run(engines["graphs_spec_on"], prompts, temperature=0)
    assert agreement(off, on) == 1.0
    for x, y in zip(off, on):
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-3
    off = run(engines["graphs_spec_off"], prompts, temperature=1.0, n=4, seed=7)
    on = run(engines["graphs_spec_on"], prompts, temperature=1.0, n=4, seed=7)
    assert agreement(off, on) >= 0.9
    assert engines["graphs_spec_on"].stats()["rollout/spec_accepted_tokens"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_generates_finite_logprobs_close_to_fp32(default_model_dir, engines, prompts, dtype):
    half = Engine(model=str(default_model_dir), device="cuda", spec="ngram", kv_cache_tokens=100_000, dtype=dtype)
    a = run(half, prompts, temperature=0)
    b = run(engines["graphs_spec_off"], prompts, temperature=0)
    assert all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in a)
    # half-precision rounding flips near-ties and 135M parameters diverge from there: compare the first tokens
    assert sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b)) >= len(a) - 1
    assert max(abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(a, b)) < 0.1


@pytest.mark.parametrize("slices", [2, 4])
def test_products_split_over_k_into_their_consumer_keep_the_tokens(default_model_dir, prompts, monkeypatch, slices):
    """The qkv, o and down products of few rows as float32 partial sums over slices of K, which rope
    or the next norm adds up (kernels/skinny_gemm.py `linear_into_sum`), against the products whole:
    bf16's first greedy tokens and their logprobs alike, in CUDA graphs."""
    from kernels import skinny_gemm

    outs, calls = {}, []
    split = skinny_gemm.split_k_partials
    monkeypatch.setattr(skinny_gemm, "split_k_partials", lambda *args: calls.append(args[2]) or split(*args))
    for chosen in (0, slices):
        monkeypatch.setattr(skinny_gemm, "_split_k", {})
        monkeypatch.setattr(skinny_gemm, "_fastest_split_k", lambda *args, chosen=chosen: chosen)
        engine = Engine(model=str(default_model_dir), device="cuda", spec="off", kv_cache_tokens=100_000,
                        dtype="bfloat16")
        outs[chosen] = run(engine, prompts, temperature=0)
        del engine
    assert calls and set(calls) == {slices}
    a, b = outs[0], outs[slices]
    assert sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b)) >= len(a) - 1
    assert max(abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(a, b)) < 0.05


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_programmatic_dependent_launch_changes_no_bit(default_model_dir, prompts, monkeypatch, dtype):
    """PDL only lets a kernel be launched early and wait on the device for the one before it:
    tokens and logprobs are bitwise those of plain launches. Half precision, with every product on
    the Triton GEMM so that whole layers chain."""
    from kernels import pdl, skinny_gemm

    monkeypatch.setattr(skinny_gemm, "_use_triton", {})
    monkeypatch.setattr(skinny_gemm, "_triton_is_faster", lambda *args: True)
    monkeypatch.setattr(skinny_gemm, "_split_k", {})  # (o and down into their norms in 2 slices, with either launch)
    monkeypatch.setattr(skinny_gemm, "_fastest_split_k", lambda *args: 2)
    before, outs = pdl.enabled(), {}
    try:
        for on in (False, True):
            engine = Engine(model=str(default_model_dir), device="cuda", spec="off", kv_cache_tokens=100_000, pdl=on,
                            dtype=dtype)
            assert pdl.enabled() == on
            outs[on] = run(engine, prompts, temperature=0) + run(engine, prompts, temperature=1.0, n=2, seed=3)
            del engine
    finally:
        pdl.set_enabled(before)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_coupled_half_precision_rollouts_compute_a_token_alike_in_any_step(default_model_dir, prompts, dtype):
    """Coupled sampling makes the engine batch-invariant (products of one tile, keys split by
    position): in half precision a second rollout with the same weights equals the first and accepts
    every coupled draft, and after a push speculation on equals off, tokens and logprobs bitwise."""
    make = lambda spec: Engine(model=str(default_model_dir), device="cuda", kv_cache_tokens=100_000, spec=spec,
                               coupled_sampling=True, spec_adaptive=False, dtype=dtype)
    on, off = make("ngram"), make("off")
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=256, ignore_eos=True)
    rollout = lambda engine: [(o.token_ids, o.logprobs) for g in engine.generate(prompts, params, return_logprob=True)
                              for o in g]
    first = rollout(on)
    on.reset_stats()
    assert rollout(on) == first
    stats = on.stats()
    assert stats["rollout/spec_accept_rate/coupled"] == 1.0
    assert stats["rollout/spec_draft_tokens/coupled"] > 0.5 * len(first) * params.max_new_tokens
    assert rollout(off) == first
    gen = torch.Generator(device="cuda").manual_seed(5)
    pushed = [(name, w + 0.02 * w.abs().mean() * torch.randn(w.shape, generator=gen, device="cuda").to(w.dtype))
              for name, w in ((name, t.view()) for name, t in on.model.weight_targets().items())
              if name.endswith("mlp.down_proj.weight")]
    for engine in (on, off):
        engine.update_weights(pushed, version=1)
    assert rollout(on) == rollout(off) != first


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_decode_steps_chained_after_verify_steps_match_spec_off(default_model_dir, engines, prompts, cuda_graphs):
    """A decode step launched before the verify step it follows is collected reads its input token,
    position and KV slot from the accepted paths found on the device; drafting every other step
    makes that the common case."""
    engine = Engine(model=str(default_model_dir), device="cuda", dtype="float32", kv_cache_tokens=100_000,
                    spec="ngram", cuda_graphs=cuda_graphs)
    draft_every_other_step(engine)
    chained = count_chained(engine)
    off = run(engines["graphs_spec_off"], prompts, temperature=0)
    on = run(engine, prompts, temperature=0)
    assert agreement(off, on) == 1.0
    for x, y in zip(off, on):
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-3
    accepted = engine.stats()["rollout/spec_accepted_tokens"]
    assert chained[1] > 10 and accepted > 10, (chained, accepted)
    assert engine.pool.used_slots == 0


def test_penalized_greedy_with_speculation_matches_without(engines, prompts):
    """Penalties run eagerly (no graph) and in verification too: greedy tokens agree either way."""
    params = dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.3, logit_bias={29: 2.0})
    off = run(engines["graphs_spec_off"], prompts, **params)
    assert agreement(off, run(engines["graphs_spec_off"], prompts, temperature=0)) < 1.0  # the edits matter
    on = run(engines["graphs_spec_on"], prompts, **params) + run(engines["graphs_spec_on"], prompts, **params)
    assert agreement(off + off, on) == 1.0


def test_release_and_resume_memory_free_the_pool_and_the_weights_and_change_no_output(default_model_dir, prompts):
    engine = Engine(model=str(default_model_dir), device="cuda", dtype="float32", kv_cache_tokens=100_000, spec="off")
    before = run(engine, prompts, temperature=0)
    kv = engine.pool.nbytes
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    released = engine.release_memory(None)
    print(f"released {released['freed_bytes'] / 2**20:.1f} MiB: KV pool {kv / 2**20:.1f} MiB, weights {weights / 2**20:.1f} MiB")
    assert released["freed_bytes"] >= kv + weights and set(released["released"]) == {"weights", "kv_cache", "cuda_graph"}
    resumed = engine.resume_memory(None)
    assert resumed["released"] == [] and engine.runner.graphs.captured
    assert agreement(before, run(engine, prompts, temperature=0)) == 1.0


def test_steps_after_admission_never_make_the_host_wait_for_the_device(engines, prompts):
    """Once every prompt is in, decode and verify steps chain: nothing but a step's one result copy
    may wait for the device (torch's sync debug mode raises on a blocking copy or an `.item()`).
    Samples of different lengths finish throughout, so their rows leave the index as history."""
    engine = engines["graphs_spec_on"]
    reqs = [engine.add_request(p, SamplingParams(n=4, temperature=1.0, max_new_tokens=16 + 8 * i, seed=i))
            for i, p in enumerate(prompts)]
    while engine.scheduler.waiting:
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while not all(r.finished for r in reqs):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.spec.index.history_rows_used > 0


def test_host_writes_to_the_device_leave_the_step_in_flight_running():
    """The token table's and the index's flushes (after samples finish) and the slot table's
    commits copy host arrays to the device while a step may still run: they must queue behind it,
    not wait for it. The sync debug mode above does not see this: the copies are from pageable
    memory, where CUDA says the driver "may synchronize with the stream" (on the H200 of
    2026-11-26 it did not). A kernel spinning for ~0.5 s stands in for the step."""
    dev = torch.device("cuda")
    table = TokenTable(live_rows=4, history_rows=2, capacity=32, device=dev)
    values = np.random.default_rng().integers(0, 1000, 12)
    table.write(np.zeros(12, dtype=np.int64), np.arange(12), values)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    copied = to_device(values, dev)
    table.keep(0, table.history_start, 12, 3)
    table.flush()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running
    assert copied.tolist() == values.tolist() and table.read(table.history_start) == values.tolist()
