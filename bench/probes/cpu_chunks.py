"""The CPU probe behind kernels/skinny_gemm.py's CPU_WEIGHT_CHUNK_BYTES (a record, not a tool): the
default model's greedy decode on the CPU, one engine, at b1 / b8 / b64 / b256, each chunk size in turn,
two cycles; tok/s medians, and each size against 4 MiB (the size before it).
`OMP_NUM_THREADS=1 python bench/probes/cpu_chunks.py` (~8 min on the 2-core machine)."""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels.skinny_gemm as skinny_gemm  # noqa: E402
from rollout.config import SamplingParams  # noqa: E402
from rollout.engine.engine import Engine  # noqa: E402

SIZES = [4 << 20, 2 << 20, 1 << 20, 512 << 10, 256 << 10]
BATCHES = [(1, 24), (8, 24), (64, 16), (256, 8)]  # (sequences, new tokens each)

engine = Engine(model="default", device="cpu", spec="off", max_running_seqs=256)
prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(256)]
rates: dict[tuple[int, int], list[float]] = {}
for _cycle in range(2):
    for size in SIZES:
        skinny_gemm.CPU_WEIGHT_CHUNK_BYTES = size
        for b, new in BATCHES:
            began = time.perf_counter()
            engine.generate(prompts[:b], SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))
            rates.setdefault((size, b), []).append(new * b / (time.perf_counter() - began))
for b, _ in BATCHES:
    base = statistics.median(rates[(SIZES[0], b)])
    cells = [f"{size >> 10} KiB {statistics.median(rates[(size, b)]):.1f} ({statistics.median(rates[(size, b)]) / base:.2f}x)"
             for size in SIZES]
    print(f"b{b}: " + "  ".join(cells))
