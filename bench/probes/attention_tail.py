"""Decode attention at a rollout's tail, alone: `--seqs` sequences of `--keys` cached keys each (rl 64 x 8's tail on the
default model: ~96 rows of ~2k keys, half the rollout's time), the Triton kernel in a CUDA graph replayed over
`--layers` K/V caches (a step's), device us a call and the K/V read's rate against the GPU's bandwidth, by
slot layout and launch choice.

    python bench/probes/attention_tail.py [--seqs 96] [--keys 2100] [--layouts interleaved,contiguous]
        [--variants default,n64,n256,stages2,stages3,stages4,warps8,splits1,splits2,splits4,invariant,invariant-stages3]

Layouts: `interleaved` is what a decode rollout leaves (each step hands every sequence the next free slot, so
consecutive keys of a sequence lie --seqs slots apart, each key a separate 128-byte read a head); `contiguous`
gives each sequence one run of slots (a prefill's, or a pool that reserved per-sequence runs). Variants change one
launch choice of `TritonAttention._choose_config` (nN: N keys a tile; stagesN: N pipeline stages; warps8;
splitsN: N key splits and the merge; splits1: no merge), on the default or the batch-invariant kernel
(`invariant*`). A b1 step of the Qwen3-30B-A3B shape (its graphs planned for 8,192 keys: 32 splits):
`--seqs 1 --keys 384 --heads 32 --kv-heads 4 --dim 128 --max-kv-len 8192 --calls 48 --layers 48`. CPU smoke run:
`TRITON_INTERPRET=1 python bench/probes/attention_tail.py --device cpu --seqs 2 --keys 100 --layers 2 --dtype float32`
(the interpreter's bfloat16 is not the GPU's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from kernels import triton_attention
from kernels.attention import AttentionMetadata
from kernels.torch_attention import TorchAttention

VARIANTS = {  # name -> (the batch-invariant backend?, changes to its LaunchConfig)
    "default": (False, {}),
    "n64": (False, {"block_n": 64}),
    "n256": (False, {"block_n": 256}),
    "stages2": (False, {"num_stages": 2}),
    "stages3": (False, {"num_stages": 3}),
    "stages4": (False, {"num_stages": 4}),
    "warps8": (False, {"num_warps": 8}),
    "splits1": (False, {"num_splits": 1}),
    "splits2": (False, {"num_splits": 2}),
    "splits4": (False, {"num_splits": 4}),
    "invariant": (True, {}),
    "invariant-stages3": (True, {"num_stages": 3}),
}


def slot_table(seqs: int, keys: int, layout: str, device: torch.device) -> torch.Tensor:
    """[seqs, keys] slots (slot 0 left out, as the pool does): key t of sequence s at 1 + t * seqs + s (interleaved)
    or 1 + s * keys + t (contiguous)."""
    t = torch.arange(keys, device=device)
    s = torch.arange(seqs, device=device)[:, None]
    table = t * seqs + s if layout == "interleaved" else s * keys + t
    return (1 + table).to(torch.int32)


def backend(variant: str) -> triton_attention.TritonAttention:
    batch_invariant, changes = VARIANTS[variant]
    attention = triton_attention.TritonAttention(batch_invariant=batch_invariant)
    choose = attention._choose_config
    attention._choose_config = lambda *a: dataclasses.replace(choose(*a), **changes)
    return attention


def run(args: argparse.Namespace, layout: str, variant: str, bandwidth: float) -> str:
    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    slots = 1 + args.seqs * args.keys
    # one K/V pair a layer, as a step reads them: a single pair replayed would sit partly in L2
    device_gen = torch.Generator(device=device).manual_seed(0)  # (drawn there: 30 layers' K/V on the host took minutes)
    caches = [tuple(torch.randn(slots, args.kv_heads, args.dim, generator=device_gen, device=device, dtype=args.dtype)
                    for _ in range(2)) for _ in range(args.layers)]
    q = torch.randn(args.seqs, args.heads, args.dim, generator=gen).to(device, args.dtype)
    shorter = torch.randint(0, int(args.spread * args.keys) + 1, (args.seqs,), generator=gen)
    kv_lens = (args.keys - shorter).to(device, torch.int32)  # a tail's sequences are of different lengths
    bound = args.max_kv_len or args.keys
    meta = AttentionMetadata(
        seq_rows=torch.arange(args.seqs, dtype=torch.int32, device=device),
        kv_lens=kv_lens,
        qo_indptr=torch.arange(args.seqs + 1, dtype=torch.int32, device=device),
        slot_table=torch.nn.functional.pad(slot_table(args.seqs, args.keys, layout, device), (0, bound - args.keys)),
        out_slots=torch.zeros(args.seqs, dtype=torch.int64, device=device),
        tree_mask=None, max_q_len=1, max_kv_len=bound)
    scale = args.dim ** -0.5
    attention = backend(variant)
    attention.plan(meta)
    k_cache, v_cache = caches[0]
    out = attention.attend(q, k_cache, v_cache, meta, scale)
    ref = TorchAttention()
    ref.plan(meta)
    err = (out.float() - ref.attend(q, k_cache, v_cache, meta, scale).float()).abs().max().item()
    config = attention.launch_config(args.heads, args.kv_heads, args.dim, args.dtype, device)
    if device.type != "cuda":
        return f"| {layout} | {variant} | {config.num_splits} | - | - | {err:.1e} |"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(args.calls):
            attention.attend(q, *caches[call % args.layers], meta, scale, out=out)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(args.iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.calls)
    us = sorted(times)[len(times) // 2]
    read = 2 * int(kv_lens.sum()) * args.kv_heads * args.dim * k_cache.element_size()
    rate = read / us / 1e6  # TB/s
    return f"| {layout} | {variant} | {config.num_splits} | {us:.1f} | {rate:.2f} ({rate / bandwidth:.0%}) | {err:.1e} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=96)
    p.add_argument("--keys", type=int, default=2100)
    p.add_argument("--max-kv-len", type=int, default=8192, help="the bound a captured graph plans with (0: --keys)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", default="interleaved,contiguous")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--calls", type=int, default=30, help="calls a graph replays (a step's layers)")
    p.add_argument("--layers", type=int, default=30, help="K/V caches the calls take in turn (a step's layers)")
    p.add_argument("--spread", type=float, default=0.0, help="sequences up to this share of --keys shorter")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=4.8, help="the GPU's memory bandwidth, TB/s (H200: 4.8)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.device == "cpu":  # (the interpreter's scalars as the tests patch them)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        import triton_kernels  # noqa: F401
    print(f"\n{args.seqs} sequences x {args.keys} keys, {args.heads} / {args.kv_heads} heads of {args.dim}, "
          f"{args.dtype}, graphs planned for {args.max_kv_len or args.keys} keys, {args.layers} layers' K/V, "
          f"up to {args.spread:.0%} shorter\n")
    print("| layout | variant | splits | us a call | K/V read TB/s (of the bound) | max abs err vs torch |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        for variant in args.variants.split(","):
            print(run(args, layout, variant, args.bandwidth), flush=True)


if __name__ == "__main__":
    main()
