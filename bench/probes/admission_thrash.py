"""The CPU probe behind bench/results/session-20261128e/admission-thrash-cpu.log (a record, not a tool): a tiny random
Llama (tests/tiny_models.py), 32 prompts x 8 samples at T=1.0 of up to 300 tokens, EOS stopping them, on a KV pool far below
the groups' worst case, admission with and without the reserve for growth (--schedule-conservativeness 1 and 0).
`python bench/probes/admission_thrash.py 8000` from the repository root."""
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]
from rollout import Engine, SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

model = Path(tempfile.mkdtemp()) / "llama"
make_tiny_model("llama", model)
rng = random.Random(0)
prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 60))] for _ in range(32)]
params = SamplingParams(n=8, temperature=1.0, max_new_tokens=300, seed=7)
for conservativeness in (0.0, 1.0):
    engine = Engine(model=str(model), spec="off", device="cpu", kv_cache_tokens=int(sys.argv[1]), max_model_len=1024,
                    schedule_conservativeness=conservativeness)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    tokens = sum(len(o.token_ids) for g in outs for o in g)
    print(f"kv {sys.argv[1]} conservativeness {conservativeness:g}: {time.perf_counter() - t0:.1f} s, {tokens} tokens, "
          f"{engine.scheduler.num_preempted} preemptions, {engine.stats()['rollout/steps']} steps, "
          f"{sum(r.prefill for r in engine.step_log)} prefill steps", flush=True)
