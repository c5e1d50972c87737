"""The host's cost of a push of Qwen3-30B-A3B's 18,432 expert tensors (48 layers x 128 experts x gate,
up, down) by their checkpoint names, into an engine on the CPU: the shape's tensor count with tiny
tensors (hidden 64, expert width 16), so that what is measured is the per-tensor work (names,
checks, targets, copies), not bytes. Run from the repository root: `python bench/probes/moe_push_host_cost.py`."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "tests")
import tiny_models  # noqa: E402

from rollout import Engine  # noqa: E402

LAYERS, EXPERTS, WIDTH = 48, 128, 16


def main() -> None:
    small = tiny_models.CONFIGS["qwen3_moe"]

    def shape():
        c = small()
        c.num_experts, c.num_experts_per_tok, c.mlp_only_layers, c.moe_intermediate_size = EXPERTS, 8, [], WIDTH
        return c

    tiny_models.CONFIGS["qwen3_moe"] = shape
    path = Path(tempfile.mkdtemp())
    sd = tiny_models.make_tiny_model("qwen3_moe", path, layers=LAYERS).state_dict()
    tensors = []
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = sd[prefix + "gate_up_proj"], sd[prefix + "down_proj"]
        for e in range(EXPERTS):
            tensors += [(f"{prefix}{e}.gate_proj.weight", gate_up[e, :WIDTH].clone()),
                        (f"{prefix}{e}.up_proj.weight", gate_up[e, WIDTH:].clone()),
                        (f"{prefix}{e}.down_proj.weight", down[e].clone())]
    engine = Engine(model=str(path), spec="off", device="cpu")
    for version in (1, 2, 3):
        t = time.perf_counter()
        engine.update_weights(tensors, version=version)
        print(f"push {version} of {len(tensors)} tensors: {time.perf_counter() - t:.3f} s")
    engine.close()


if __name__ == "__main__":
    main()
