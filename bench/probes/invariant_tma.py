"""Can the batch-invariant product run a prefill chunk nearer cuBLAS with TMA loads, and keep its bits?

Deterministic mode's 8B b64 prefill step (4,096 tokens of 1k prompts) spends 108.0 ms in products
against cuBLAS's 79.9 (`session-20261130h/prefill-kernels-8b-b64.log`), most of the wall gap
(0.81x of the default mode against a 0.90x target). The invariant kernel (kernels/skinny_gemm.py)
loads its tiles with masked pointer loads. Here the same sums (tl.dot over BLOCK_K chunks in K's
order into one float32 accumulator) load through tensor descriptors (TMA), once a program a tile
and once persistent (one program an SM walking the tiles, GROUP_M row blocks a column block), and
each is timed inside a CUDA graph against cuBLAS and today's kernel on the Llama-3.1-8B shape's
products, with its output compared bitwise with today's kernel's (the rows a decode step computes
must keep their bits).

    python bench/probes/invariant_tma.py [--rows 4096] [--dtype bfloat16]
    python bench/probes/invariant_tma.py --stack 32   # a prefill step's products, layer after layer

`--stack L`: L layers' four products (each layer its own weights, as a step reads them) captured in
one CUDA graph and replayed, ms a replay: cuBLAS, the engine's kernel (`skinny_gemm.invariant_linear`,
TMA loads since 5d3bc6e) without and with programmatic dependent launch (the engine launches with it),
and this probe's TMA kernel (its tile stored by TMA), a program a tile and persistent. Alone (the table above) the probe's kernel ran
the 8B products at 0.96x of cuBLAS; in the engine's prefill step the engine's ran at 0.81x
(`session-20261201b/prefill-kernels-8b-b64.log`): this says whether the kernels or the step differ.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import pdl, skinny_gemm, sm_count
from kernels.skinny_gemm import graph_ms, invariant_tile

def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The engine's invariant product with its TMA loads off: the pointer loads."""
    tma_ready = skinny_gemm.tma_ready
    skinny_gemm.tma_ready = lambda *tensors: False
    try:
        return skinny_gemm.invariant_linear(x, w)
    finally:
        skinny_gemm.tma_ready = tma_ready


SHAPES = {  # N, K
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "default": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)},
}


@triton.jit
def _tma_kernel(x_desc, w_desc, y_desc, m, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
    row_blocks, col_blocks = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * col_blocks
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, PROGRAMS):  # (GPU only: the interpreter cannot)
        first_row_block = tile // per_group * GROUP_M
        group_rows = tl.minimum(row_blocks - first_row_block, GROUP_M)
        col_block = (tile % per_group) // group_rows
        row_block = first_row_block + tile % per_group % group_rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            x = x_desc.load([row_block * BLOCK_M, k0])
            w = w_desc.load([col_block * BLOCK_N, k0])
            acc = tl.dot(x, w.T, acc)
        y_desc.store([row_block * BLOCK_M, col_block * BLOCK_N], acc.to(y_desc.dtype))


def tma_linear(x: torch.Tensor, weight: torch.Tensor, persistent: bool, block_m=128, block_n=256, block_k=64,
               warps=8, stages=3, group_m=8) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(tiles, sm_count(x.device)) if persistent else tiles
    _tma_kernel[(programs,)](TensorDescriptor.from_tensor(x, [block_m, block_k]),
                             TensorDescriptor.from_tensor(weight, [block_n, block_k]),
                             TensorDescriptor.from_tensor(y, [block_m, block_n]), m, n, k, BLOCK_M=block_m,
                             BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, PROGRAMS=programs, num_warps=warps,
                             num_stages=stages)
    return y


def today_tile(x: torch.Tensor, w: torch.Tensor, persistent: bool) -> torch.Tensor:
    t = invariant_tile(x.shape[0], w.shape[0], x.device)
    return tma_linear(x, w, persistent, t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"], t["num_warps"], t["num_stages"])


VARIANTS = {  # (128 x 256 x 64 at 4 stages needs 262 KB of shared memory: over the H200's 227 KB)
    "tma, today's tile": lambda x, w: today_tile(x, w, False),
    "tma persistent, today's tile": lambda x, w: today_tile(x, w, True),
    "tma 128x256x64/8/3": lambda x, w: tma_linear(x, w, False),
    "tma persistent 128x256x64/8/3": lambda x, w: tma_linear(x, w, True),
    "tma persistent 128x128x64/8/4": lambda x, w: tma_linear(x, w, True, block_n=128, stages=4),
    "tma persistent 128x256x64/8/3 g16": lambda x, w: tma_linear(x, w, True, group_m=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4096")
    ap.add_argument("--shape", choices=SHAPES, default="8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stack", type=int, default=0, help="instead: this many layers' products in one graph")
    args = ap.parse_args()
    if args.stack:
        return stack(SHAPES[args.shape], int(args.rows.split(",")[0]), args.stack, getattr(torch, args.dtype))
    for rows in map(int, args.rows.split(",")):
        table(SHAPES[args.shape], rows, getattr(torch, args.dtype))


def table(shapes: dict, rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"| product (N x K), {rows} rows | variant | us | vs cuBLAS | vs today's invariant | bits = today's (today: row 0 = that row alone) |")
    print("|---|---|---|---|---|---|")
    totals: dict[str, float] = {}
    for name, (n, k) in shapes.items():
        x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k ** 0.5
        today = invariant_linear(x, w)
        alone = invariant_linear(x[:1], w)
        cublas_us = graph_ms(lambda: torch.nn.functional.linear(x, w)) * 1e3
        today_us = graph_ms(lambda: invariant_linear(x, w)) * 1e3
        tile = invariant_tile(rows, n, x.device)
        print(f"| {name} | today's tile {tile} | | | | |")
        timed = [("cuBLAS", cublas_us, None), ("today", today_us, torch.equal(today[:1], alone))]
        for variant, fn in VARIANTS.items():
            try:
                same = torch.equal(fn(x, w), today)
                timed.append((variant, graph_ms(lambda: fn(x, w)) * 1e3, same))
            except Exception as e:  # noqa: BLE001 (a variant Triton cannot build here is reported, not fatal)
                print(f"| {name} | {variant} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
        for variant, us, same in timed:
            totals[variant] = totals.get(variant, 0.0) + us
            print(f"| {name} ({n} x {k}) | {variant} | {us:.1f} | {cublas_us / us:.2f}x | {today_us / us:.2f}x | "
                  f"{'-' if same is None else same} |")
    print("\n| variant | a layer's four products, us | vs cuBLAS |")
    print("|---|---|---|")
    for variant, us in totals.items():
        print(f"| {variant} | {us:.1f} | {totals['cuBLAS'] / us:.2f}x |")


def stack(shapes: dict, rows: int, layers: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {k: torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen) for _, k in shapes.values()}
    weights = [{name: torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k ** 0.5
                for name, (n, k) in shapes.items()} for _ in range(layers)]

    def engine(x, w, with_pdl):
        pdl.set_enabled(with_pdl)
        try:
            return skinny_gemm.invariant_linear(x, w)
        finally:
            pdl.set_enabled(False)

    variants = {
        "cuBLAS": torch.nn.functional.linear,
        "engine's kernel, PDL off": lambda x, w: engine(x, w, False),
        "engine's kernel, PDL on": lambda x, w: engine(x, w, True),
        "probe's TMA kernel (TMA store)": lambda x, w: today_tile(x, w, False),
        "probe's TMA kernel, persistent": lambda x, w: today_tile(x, w, True),
    }
    print(f"| {layers} layers' products, {rows} rows | ms a replay | vs cuBLAS | bits = pointer loads' (first layer) |")
    print("|---|---|---|---|")
    first = {name: invariant_linear(inputs[k], weights[0][name]) for name, (_, k) in shapes.items()}
    timed = {}
    for variant, fn in variants.items():
        def step():
            for layer in weights:
                for name, (_, k) in shapes.items():
                    fn(inputs[k], layer[name])
        step()  # compile outside the capture
        same = all(torch.equal(fn(inputs[k], weights[0][name]), first[name]) for name, (_, k) in shapes.items())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        timed[variant] = sorted(ms[1:])[2]
        print(f"| {variant} | {timed[variant]:.2f} | {timed['cuBLAS'] / timed[variant]:.2f}x | "
              f"{'-' if variant == 'cuBLAS' else same} |", flush=True)
        del graph


if __name__ == "__main__":
    main()
