"""The CPU probe behind bench/results/session-20261129/single-e2e-cpu.log (a record, not a tool): a decode step's
wall on the CPU when the forward and the draw cost next to nothing (step_profile.py's host-probe shape), so that it is
the host's own work: 64 prompts x 8 samples x 256 tokens, spec off, two rounds after a warm-up, the median decode step
and the collector's time. Run it on two trees in turns (`cd TREE && PYTHONPATH=TREE python
REPO/bench/probes/host_step_probe.py TREE`), the shape taken from this repository's step_profile.py."""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this repository's bench/, for the shape)

from step_profile import HOST_PROBE  # noqa: E402

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.engine.engine import freeze_heap  # noqa: E402
from rollout.tools.bench import GcTimer, speed_model_dir  # noqa: E402

model = speed_model_dir("host-probe", HOST_PROBE)
engine = Engine(model=model, spec="off", device="cpu", max_running_seqs=512, load_format="dummy")
freeze_heap()
prompts = [[(7 * i + j) % 500 + 3 for j in range(40)] for i in range(64)]
params = SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=0, ignore_eos=True)
engine.generate(prompts, params)
for r in range(2):
    engine.reset_stats()
    with GcTimer() as gc_time:
        began = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - began
    steps = [s.wall_ms for s in engine.step_log if not s.prefill]
    print(f"{sys.argv[1].split('/')[-1]} off round {r}: wall {wall:.2f} s, median step {statistics.median(steps):.2f} ms, "
          f"gc {gc_time.seconds * 1e3:.1f} ms")
