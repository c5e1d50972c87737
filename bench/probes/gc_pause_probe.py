"""Garbage-collection pauses of an n-gram engine's rollouts on the CPU: 512 sequences x 48 tokens of a tiny
model, four rounds, with the heap as the engine leaves it (`plain`) or frozen after start (`freeze`:
gc.collect(), gc.freeze(), as SGLang's scheduler does). Run from the repository root:
`python bench/probes/gc_pause_probe.py plain|freeze`."""
import sys, time, tempfile, gc
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import make_tiny_model
from rollout import Engine, SamplingParams
path = Path(tempfile.mkdtemp()); make_tiny_model("llama", path)
prompts = [[5 + k % 50, 9, 13 + k % 7, 7, 11 + k % 13] * 4 for k in range(512)]
params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=1)
freeze = sys.argv[1] == "freeze"
e = Engine(model=str(path), spec="ngram", device="cpu", max_running_seqs=512, kv_cache_tokens=200_000)
if freeze:
    gc.collect(); gc.freeze()
times = []; start = {}
def cb(phase, info):
    if phase == "start": start["t"] = time.perf_counter()
    else: times.append((info["generation"], time.perf_counter() - start["t"]))
gc.callbacks.append(cb)
walls = []
for r in range(4):
    times.clear(); t = time.perf_counter(); e.generate(prompts, params); walls.append(time.perf_counter() - t)
    print(sys.argv[1], f"round {r}: wall {walls[-1]:.2f} s, gc {sum(d for _, d in times)*1e3:.1f} ms in {len(times)} ({sum(g == 2 for g, _ in times)} gen-2)", flush=True)
