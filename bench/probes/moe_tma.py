"""Do the fused MoE's expert products read their weights faster by TMA than by pointer loads?

Issue 64's b512 row runs the Qwen3-30B-A3B shape's MoE layer at 356.8 us against a 251.7 us bound
(nearly every expert's weights read once a step at 4.8 TB/s). The expert products
(kernels/fused_moe.py `_expert_gemm_kernel`) load a block's gathered rows and its expert's weight
tiles by masked pointer loads. The rows are gathered (TMA gathers are Blackwell's), but the weight
tiles are plain 2-D boxes of [experts x rows, K]: here they load through a tensor descriptor,
every other line of the kernel as it is. Each config of the kernel's autotune list is timed both
ways inside a CUDA graph, gate/up (with SiLU) and down (with the routing weight), at the block of
rows the engine picks; the best of each is kept, and the outputs are compared bitwise.

    python bench/probes/moe_tma.py [--rows 1,64,512,4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.moe_kernels import BANDWIDTH, EXPERTS, HIDDEN, TOP_K, WIDTH, graph_us
from kernels import fused_moe, pdl

CONFIGS = [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (32, 256, 4, 3),
           (16, 256, 4, 3)]  # BLOCK_N, BLOCK_K, warps, stages (fused_moe's autotune list)


@triton.jit
def _expert_gemm_tma_kernel(a_ptr, w_desc, out_ptr, slots_ptr, block_expert_ptr, counts_ptr, starts_ptr, weights_ptr,
                            n, k, stride_a, rows_per_expert, stride_out, A_DIV: tl.constexpr, GATED: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_for_previous(PDL)
    blk = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk)
    used = expert >= 0
    expert = tl.maximum(expert, 0)
    end = tl.load(starts_ptr + expert) + tl.load(counts_ptr + expert)
    slot = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = slot < tl.where(used, end, 0)
    pick = tl.load(slots_ptr + slot, mask=row_ok, other=0)
    a_rows = a_ptr + (pick // A_DIV).to(tl.int64)[:, None] * stride_a
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_row = expert * rows_per_expert + tl.program_id(0) * BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(used, k, 0)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < k), other=0.0)
        acc = tl.dot(a, w_desc.load([w_row, k0]).T, acc)
        if GATED:
            up = tl.dot(a, w_desc.load([w_row + n, k0]).T, up)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        g = acc.to(dtype).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    else:
        weight = tl.load(weights_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pick.to(tl.int64)[:, None] * stride_out + cols[None, :], y.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


def product(route, a, w, out, gated: bool, config, tma: bool) -> None:
    bn, bk, warps, stages = config
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    grid = (triton.cdiv(n, bn), route.num_blocks)
    common = dict(A_DIV=route.top_k if gated else 1, GATED=gated, BLOCK_M=route.block, BLOCK_N=bn, BLOCK_K=bk,
                  num_warps=warps, num_stages=stages, **pdl.launch_args())
    tail = (route.slots, route.block_expert, route.counts, route.starts, route.weights, n, k, a.stride(0))
    if tma:
        desc = TensorDescriptor.from_tensor(w.view(-1, k), [bn, bk])
        _expert_gemm_tma_kernel[grid](a, desc, out, *tail, w.shape[1], out.stride(0), **common)
    else:
        fused_moe._expert_gemm_kernel[grid](a, w, out, *tail, w.stride(0), w.stride(1), out.stride(0), IEEE=False,
                                            **common)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,512,4096")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    pdl.set_enabled(pdl.supported(torch.device("cuda")))
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda") / HIDDEN**0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda") / WIDTH**0.5).to(dtype)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    print("| rows | block | product | pointer loads us (best config) | TMA weights us (best config) | speedup (pointer / TMA) "
          "| same bits | both products / bound |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        h = torch.randn(rows, HIDDEN, device="cuda").to(dtype)
        route = fused_moe.Route(torch.randn(rows, EXPERTS, device="cuda").to(dtype), TOP_K, True, dtype)
        mid = torch.empty(rows * TOP_K, WIDTH, dtype=dtype, device="cuda")
        picks = torch.empty(rows * TOP_K, HIDDEN, dtype=dtype, device="cuda")
        bound = len(torch.unique(route.ids)) * expert_bytes / BANDWIDTH * 1e6
        totals = {False: 0.0, True: 0.0}
        for name, a, w, out, gated in [("gate/up", h, gate_up, mid, True), ("down", mid, down, picks, False)]:
            best = {}
            results = {}
            for tma in (False, True):
                timed = []
                for config in CONFIGS:
                    try:
                        timed.append((graph_us(lambda: product(route, a, w, out, gated, config, tma)), config))  # noqa: B023
                    except Exception as e:  # noqa: BLE001 (a config Triton cannot build here is skipped)
                        print(f"| {rows} | | {name} {'TMA' if tma else 'pointer'} {config} | failed: {type(e).__name__} |")
                best[tma] = min(timed)
                out.zero_()
                product(route, a, w, out, gated, best[tma][1], tma)
                results[tma] = out.clone()
                totals[tma] += best[tma][0]
            same = torch.equal(results[False], results[True])
            print(f"| {rows} | {route.block} | {name} | {best[False][0]:.1f} {best[False][1]} | {best[True][0]:.1f} "
                  f"{best[True][1]} | {best[False][0] / best[True][0]:.2f}x | {same} | |", flush=True)
        print(f"| {rows} | | both | {totals[False]:.1f} | {totals[True]:.1f} | {totals[False] / totals[True]:.2f}x | | "
              f"{totals[False] / bound:.2f} -> {totals[True] / bound:.2f} |", flush=True)


if __name__ == "__main__":
    main()
