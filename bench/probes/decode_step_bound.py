"""What a decode step must at least take on a shape of `rollout bench --random-model`: each part's bytes over the
memory bandwidth or its FLOPs over the tensor cores' peak, whichever is longer, summed over the parts.

    python bench/probes/decode_step_bound.py --shape qwen3-30b-a3b --prompt-len 128 --output-len 256

The parts: the experts' weights (the distinct experts a layer's rows take, routing spread evenly, as random weights
route), the other products' weights (attention's, the router's, a dense MLP's, the LM head), and the KV cache the
step's attention reads (every sequence's context averaged over the output: prompt + (output - 1) / 2 keys). A bound
that counts weights alone (bytes at 4.8 TB/s) leaves out the last two; at 512 rows they are a quarter of the step.
Pure arithmetic: no GPU, no torch.
"""

from __future__ import annotations

import argparse

from rollout.tools.bench_args import SPEED_SHAPES

BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
PEAK_FLOPS = 989e12  # H200 SXM, dense bf16 tensor cores, FLOP/s
DTYPE_BYTES = 2


def step_parts(shape: dict, batch: int, prompt_len: int, output_len: int) -> dict[str, tuple[float, float]]:
    """Each part of one decode step of `batch` sequences: (bytes it reads, FLOPs it does)."""
    hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden  # qkv and o
    experts = shape.get("num_experts", 0)
    if experts:
        top_k, width = shape["num_experts_per_tok"], shape["moe_intermediate_size"]
        expert = 3 * hidden * width
        distinct = experts * (1 - (1 - top_k / experts) ** batch)  # expected, rows routed evenly and independently
        expert_part = (layers * distinct * expert * DTYPE_BYTES, 2.0 * layers * batch * top_k * expert)
        other = attn + experts * hidden  # (the router)
    else:
        expert_part = (0.0, 0.0)
        other = attn + 3 * hidden * shape["intermediate_size"]
    other_bytes = (layers * other + vocab * hidden) * DTYPE_BYTES
    other_flops = 2.0 * batch * (layers * other + vocab * hidden)
    context = prompt_len + (output_len - 1) / 2
    kv_bytes = batch * context * layers * 2 * kv_heads * head_dim * DTYPE_BYTES
    kv_flops = 2.0 * 2 * batch * context * layers * heads * head_dim  # q.k and p.v
    return {"experts' weights": expert_part, "other products' weights": (other_bytes, other_flops),
            "KV cache": (kv_bytes, kv_flops)}


def part_us(part: tuple[float, float]) -> float:
    return max(part[0] / BANDWIDTH, part[1] / PEAK_FLOPS) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SPEED_SHAPES))
    ap.add_argument("--batch-sizes", default="1,64,512")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    shape = SPEED_SHAPES[args.shape]
    print(f"{args.shape}, prompt {args.prompt_len} + output {args.output_len}, {BANDWIDTH / 1e12:.1f} TB/s, "
          f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s")
    names = list(step_parts(shape, 1, 1, 1))
    print("| batch | " + " | ".join(f"{n} us" for n in names) + " | step us | tok/s | weights alone: tok/s |")
    print("|---|" + "---|" * (len(names) + 3))
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        parts = step_parts(shape, batch, args.prompt_len, args.output_len)
        step = sum(part_us(p) for p in parts.values())
        weights = (parts["experts' weights"][0] + parts["other products' weights"][0]) / BANDWIDTH * 1e6
        cells = " | ".join(f"{part_us(p):,.1f}" for p in parts.values())
        print(f"| {batch} | {cells} | {step:,.1f} | {batch / step * 1e6:,.0f} | {batch / weights * 1e6:,.0f} |")


if __name__ == "__main__":
    main()
