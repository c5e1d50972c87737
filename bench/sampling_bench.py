"""GPU time of drawing one token per logits row (kernels/sampling.py): the fused kernels against
the torch reference (`rollout.sampler.sample_reference`), each captured alone in a CUDA graph.

    python bench/sampling_bench.py

Logits are fresh random float32 rows over the default model's vocabulary (49,152); `greedy`
graphs take the argmax and its logprob, `sample` graphs draw at temperature 1.
"""

from __future__ import annotations

import torch
from tree_accept_bench import REPLAYS, replay_us

from rollout.sampler import SamplingTensors, sample, sample_reference

ROWS = [1, 8, 64, 128, 256, 512]
VOCAB = 49152


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: us per replay of a graph holding only the draw ({REPLAYS} replays)")
    print("| rows | mode | fused kernels | torch reference | ratio |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, generator=g, device="cuda") * 4
        for mode in ("greedy", "sample"):
            st = SamplingTensors(
                temperature=torch.full((rows,), 0.0 if mode == "greedy" else 1.0, device="cuda"),
                top_k=torch.zeros(rows, dtype=torch.int64, device="cuda"),
                top_p=torch.ones(rows, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                keys=torch.randint(0, 2**32, (rows,), generator=g, device="cuda"),
                positions=torch.arange(rows, device="cuda"),
                all_greedy=mode == "greedy", any_truncation=False,
            )
            fused = replay_us(lambda: sample(logits, st))
            ref = replay_us(lambda: sample_reference(logits, st))
            print(f"| {rows} | {mode} | {fused:.1f} | {ref:.1f} | {ref / fused:.1f}x |")


if __name__ == "__main__":
    main()
