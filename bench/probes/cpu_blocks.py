"""The CPU probe behind bench/RESULTS.md's CPU-products row (a record, not a tool): the CPU's products
(kernels/skinny_gemm.py `_cpu_linear`: 8-row blocks in one batched product, a weight over twice
CPU_WEIGHT_CHUNK_BYTES a chunk of rows at a time; its log ran at 4 MiB) against F.linear called on
each 8-row block over the whole weight (the definition it replaced, the same bits where the weight is
not chunked), for the default model's shapes, in turns. `python bench/probes/cpu_blocks.py`."""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.skinny_gemm import CPU_BLOCK_ROWS, _cpu_linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(block, weight) for block in x.split(CPU_BLOCK_ROWS)])


def ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
print("| product | rows | per block, ms | _cpu_linear, ms | ratio | same bits |\n|---|---|---|---|---|---|")
gen = torch.Generator().manual_seed(0)
for name, (n, k) in SHAPES.items():
    weight = torch.randn(n, k, generator=gen)
    for rows in (8, 72, 256):
        x = torch.randn(rows, k, generator=gen)
        repeats = 5 if name == "lm_head" else 30
        old, new = per_block(x, weight), _cpu_linear(x, weight, None)  # (and a warm-up)
        before = ms(lambda: per_block(x, weight), repeats)
        after = ms(lambda: _cpu_linear(x, weight, None), repeats)
        print(f"| {name} | {rows} | {before:.2f} | {after:.2f} | {before / after:.2f}x | {torch.equal(old, new)} |")
