"""The batch-invariant product's tile (deterministic inference, coupled sampling), by shape.

A decode step's products of the default model and of the Llama-3.1-8B shape at several row counts:
cuBLAS (what the default mode runs at those rows) against the invariant Triton kernel
(kernels/skinny_gemm.py) under each candidate tile and under the tile its rule picks
(`invariant_tile`), each call on the next of cold copies of the weight inside a CUDA graph, as a
step streams its layers. The `alike` column: the first row of the widest product against the same
row alone, bitwise, for every tile. `--across`: whether the tiles agree with each other bitwise,
which is what lets the tile follow the rows.

    python bench/invariant_tiles.py --rows 1,64,512
    python bench/invariant_tiles.py --across   # whether the tiles agree with each other, bitwise
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.gemm_choice import products
from kernels.skinny_gemm import cold_copies, cublas_linear, graph_ms, invariant_linear, invariant_tile
from rollout.models.default_model import ensure_default_model
from rollout.tools.bench_args import SPEED_SHAPES

CANDIDATES = {  # BLOCK_M x BLOCK_N x BLOCK_K / warps / stages
    f"{m}x{n}x{k}/{w}/{s}": dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for m, n, k, w, s in [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                          (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 64, 128, 4, 3), (64, 32, 128, 4, 4),
                          (128, 64, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,512")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--across", action="store_true", help="instead: whether every tile gives a row the same bits")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    if args.across:
        return across_tiles(rows)
    models = {"default": json.loads((ensure_default_model() / "config.json").read_text()),
              "llama3-8b": SPEED_SHAPES["llama3-8b"]}
    print("| model | product | N x K | rows | cuBLAS us | " + " | ".join(CANDIDATES)
          + " | best | best / cuBLAS | rule's tile | rule / cuBLAS | alike |")
    print("|---" * (10 + len(CANDIDATES)) + "|", flush=True)
    for model, config in models.items():
        for name, (n, k) in products(1, config).items():
            out_dtype = torch.float32 if name == "lm_head" else None  # (the engine's logits)
            w = torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5
            copies = cold_copies(w)
            alike = all(same_alone(w, max(rows), tile, out_dtype) for tile in CANDIDATES.values())
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device="cuda")

                def per_product(product) -> float:
                    return graph_ms(lambda: [product(x, c) for c in copies]) / len(copies)  # noqa: B023

                cublas = per_product(lambda x, c: cublas_linear(x, c, None, out_dtype))  # noqa: B023
                tiles = {label: per_product(lambda x, c: invariant_linear(x, c, None, out_dtype, tile))  # noqa: B023
                         for label, tile in CANDIDATES.items()}
                best = min(tiles, key=tiles.get)
                rule = next(label for label, tile in CANDIDATES.items() if tile == invariant_tile(m, n, x.device))
                print(f"| {model} | {name} | {n} x {k} | {m} | {cublas * 1e3:.1f} | "
                      + " | ".join(f"{t * 1e3:.1f}" for t in tiles.values())
                      + f" | {best} | {tiles[best] / cublas:.2f} | {rule} | {tiles[rule] / cublas:.2f} | {alike} |",
                      flush=True)
            del w, copies
            torch.cuda.empty_cache()


def across_tiles(rows: list[int]) -> None:
    """Whether the candidate tiles give each output the same bits (a tile could then follow the rows
    too): the 8B shape's products and odd ones, bf16 and fp16, to the input's dtype and to float32."""
    shapes = list(products(1).values()) + [(1000, 600), (50, 3000)]
    print("| dtype | out | N x K | rows | tiles alike with the first |\n|---|---|---|---|---|", flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        for out_dtype in (None, torch.float32):
            for n, k in shapes:
                w = torch.randn(n, k, dtype=dtype, device="cuda") / k**0.5
                for m in rows:
                    x = torch.randn(m, k, dtype=dtype, device="cuda")
                    first, *rest = (invariant_linear(x, w, None, out_dtype, tile) for tile in CANDIDATES.values())
                    alike = [label for label, y in zip(list(CANDIDATES)[1:], rest) if torch.equal(first, y)]
                    print(f"| {str(dtype)[6:]} | {str(out_dtype or dtype)[6:]} | {n} x {k} | {m} | "
                          f"{len(alike)} of {len(rest)}{'' if len(alike) == len(rest) else ': ' + ', '.join(alike)} |",
                          flush=True)


def same_alone(weight: torch.Tensor, rows: int, tile: dict, out_dtype: torch.dtype | None) -> bool:
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    batched = invariant_linear(x, weight, None, out_dtype, tile)[:1]
    return torch.equal(batched, invariant_linear(x[:1], weight, None, out_dtype, tile))


if __name__ == "__main__":
    main()
