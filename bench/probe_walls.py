"""Where a grpo b512 rollout's wall time goes (T=0, 64 prompts x 8, 256 new tokens), n-gram against
the hybrid with a draft head, six rollouts each: prefill and decode steps, the slowest steps, and
whether the head was awake before and after (GPU; no heap freezing, so Python's collector shows).

    python bench/probe_walls.py HEAD_DIR
"""
import sys
import time
from types import SimpleNamespace

from rollout import Engine, SamplingParams
from rollout.tools.bench import workload_prompts

head = sys.argv[1]
for mode in ("ngram", "auto"):
    kw = {"spec_draft_model": head} if mode == "auto" else {}
    engine = Engine(model="default", spec=mode, max_running_seqs=512, kv_cache_tokens=400_000, **kw)
    opts = SimpleNamespace(workload="grpo", n=8, prompt_set="mixed", seed=0)
    prompts, n = workload_prompts(opts, engine.tokenizer, 512)
    for k in range(6):
        params = SamplingParams(n=n, temperature=0.0, max_new_tokens=256, seed=k)
        engine.step_log.clear()
        awake = engine.spec.cycle.awake if engine.spec.cycle else None
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        log = engine.step_log
        pre = sum(r.wall_ms for r in log if r.prefill)
        dec = [r for r in log if not r.prefill]
        slow = sorted(dec, key=lambda r: -r.wall_ms)[:3]
        print(f"{mode:5} rollout {k}: wall {wall * 1e3:.0f} ms, prefill {pre:.0f} ms in {len(log) - len(dec)} steps, "
              f"decode {sum(r.wall_ms for r in dec):.0f} ms in {len(dec)} steps (median "
              f"{sorted(r.wall_ms for r in dec)[len(dec) // 2]:.2f}), slowest "
              f"{[(round(r.wall_ms, 1), r.num_seqs, r.draft_rows) for r in slow]}, head awake {awake}->"
              f"{engine.spec.cycle.awake if engine.spec.cycle else None}", flush=True)
    del engine
