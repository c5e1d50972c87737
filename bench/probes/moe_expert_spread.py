"""How a random-weight Qwen3-MoE's decode rows spread over its experts (the record behind
bench/results/session-20261129d/moe-expert-spread-cpu.log, cited in bench/RESULTS.md): the Qwen3-30B-A3B
shape's routing (128 experts, top-8) on a scaled-down body (hidden 256, 4 layers), 64 rows decoding on the CPU,
every sequence its own prompt (greedy, then sampled) against 8 prompts x 8 samples (grpo's shape). Run from the
repository root: `python bench/probes/moe_expert_spread.py`."""

from __future__ import annotations

import random

import torch

from kernels import fused_moe
from rollout import Engine, SamplingParams
from rollout.tools.bench import speed_model_dir
from rollout.tools.bench_args import SPEED_SHAPES

ROWS, LAST = 64, 8  # decode rows; the last steps averaged over


def main() -> None:
    shape = dict(SPEED_SHAPES["qwen3-30b-a3b"], hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, moe_intermediate_size=32)
    engine = Engine(model=speed_model_dir("moe-spread", shape), spec="off", device="cpu", max_running_seqs=ROWS,
                    load_format="dummy", seed=1)
    layers = shape["num_hidden_layers"]
    seen = []  # (rows, distinct experts, the busiest expert's rows), a layer's call each
    reference = fused_moe.experts_ref

    def counting(h, logits, *args, **kwargs):
        ids = logits.float().topk(shape["num_experts_per_tok"], dim=-1).indices
        seen.append((logits.shape[0], len(torch.unique(ids)), torch.bincount(ids.flatten()).max().item()))
        return reference(h, logits, *args, **kwargs)

    fused_moe.experts_ref = counting
    rng = random.Random(0)
    own = [[rng.randrange(10, 32000) for _ in range(32)] for _ in range(ROWS)]
    groups = [[rng.randrange(10, 32000) for _ in range(32)] for _ in range(ROWS // 8)]
    runs = [("64 prompts, T=0", own, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)),
            ("64 prompts, T=1", own, SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)),
            ("8 prompts x 8 samples, T=1", groups, SamplingParams(n=8, temperature=1.0, max_new_tokens=24, ignore_eos=True))]
    print("| rows | distinct experts a layer (of 128) | the busiest expert's rows (balanced: 4) |\n|---|---|---|")
    for name, prompts, params in runs:
        seen.clear()
        engine.generate(prompts, params)
        late = [r for r in seen if r[0] == ROWS][-LAST * layers:]
        print(f"| {name} | {sum(r[1] for r in late) / len(late):.1f} | {sum(r[2] for r in late) / len(late):.1f} |")


if __name__ == "__main__":
    main()
