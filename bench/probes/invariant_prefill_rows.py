"""Can batch-invariant attention take a prefill's rows in larger blocks and keep their bits?

Deterministic mode's 8B b64 prefill step (4,096 tokens: four 1k-token prompts) spends 13.1 ms in
attention against the default mode's 7.6 (`session-20261201b/prefill-kernels-8b-b64.log`). The
invariant kernel takes every step's rows in blocks of 16 (kernels/triton_attention.py), so that a
query's bits do not depend on the step: a prefill re-reads each key tile once per 4 tokens (the
8B shape's 4 heads a KV head), where the default prefill config reads it once per 32. The keys'
tiles (128), their order and the splits (every 2,048 keys) do not depend on the row block, and a
fully masked tile leaves a row's sums as they are; what may differ is the products' instruction
and the row reductions' order across threads, which only the GPU can say. Today's 16-row block
spreads its 4 warps along the keys; a block of 32 rows in 8 warps or 64 in 16 may keep that
arrangement for each 16-row slice, and with it the bits, while reading each key tile once a block.

Here the 8B shape's prefill chunk runs through the invariant kernel with blocks of 16 rows (today),
and with larger blocks, each output compared bitwise with today's, and timed in a CUDA graph against
the default mode's prefill config. A block that keeps every bit could serve prefills.

    python bench/probes/invariant_prefill_rows.py [--prompts 4] [--prompt-len 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
import triton

from kernels.attention import AttentionMetadata
from kernels.skinny_gemm import graph_ms
from kernels.triton_attention import LaunchConfig, TritonAttention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
# rows a block, warps, stages: today's first; then 4 warps along the keys a 16-row slice, as today's block has them (the
# products' layout a warp, and the row reductions' order, may then be today's), then fewer warps a slice
BLOCKS = [(16, 4, 2), (32, 8, 2), (64, 16, 2), (32, 4, 2), (64, 4, 2), (128, 8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype, n, length = getattr(torch, args.dtype), args.prompts, args.prompt_len
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = n * length
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", generator=g).to(dtype)
    k_cache = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=g).to(dtype)
    slots = torch.arange(tokens, device="cuda", dtype=torch.int32)
    meta = AttentionMetadata(
        seq_rows=torch.arange(n, device="cuda", dtype=torch.int32),
        kv_lens=torch.full((n,), length, device="cuda", dtype=torch.int32),
        qo_indptr=torch.arange(0, tokens + 1, length, device="cuda", dtype=torch.int32),
        slot_table=slots.view(n, length), out_slots=slots.long(), tree_mask=None, max_q_len=length, max_kv_len=length)
    scale = HEAD_DIM ** -0.5

    def run(backend: TritonAttention) -> tuple[torch.Tensor, float]:
        backend.plan(meta)
        out = backend.attend(q, k_cache, v_cache, meta, scale)
        return out, graph_ms(lambda: backend.attend(q, k_cache, v_cache, meta, scale)) * 1e3

    _, default_us = run(TritonAttention())
    print(f"| {n} x {length}-token prefill, variant | us | vs the default mode's | bits = 16-row blocks' |")
    print("|---|---|---|---|")
    print(f"| default mode (its prefill config) | {default_us:.1f} | 1.00x | - |")
    today = None
    for block_m, warps, stages in BLOCKS:
        backend = TritonAttention(batch_invariant=True)
        planned = backend._choose_config

        def choose(*shape, block_m=block_m, warps=warps, stages=stages, planned=planned):
            c = planned(*shape)
            rows = length * c.group
            return LaunchConfig(c.group, block_m, c.block_n, triton.cdiv(rows, block_m), c.num_splits, warps, stages)

        backend._choose_config = choose
        try:
            out, us = run(backend)
        except Exception as e:  # noqa: BLE001 (a block Triton cannot build here is reported, not fatal)
            print(f"| invariant, {block_m} rows / {warps} warps / {stages} stages | failed: {type(e).__name__}: "
                  f"{str(e)[:100]} | | |")
            continue
        today = out if today is None else today
        print(f"| invariant, {block_m} rows / {warps} warps / {stages} stages | {us:.1f} | {default_us / us:.2f}x | "
              f"{torch.equal(out, today)} |", flush=True)


if __name__ == "__main__":
    main()
