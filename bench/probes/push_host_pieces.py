"""The host's share of a push of Qwen3-30B-A3B's tensor names (18,432 experts and the rest) at a tiny width, piece by
piece, on the CPU: the metadata's checks, the trainer's packing of every bucket and the receiver's unpacking (128-MB
buckets), and the engine's swap. What is measured is per-tensor work, not bytes. Run it on two trees in turns:
`cd TREE && python REPO/bench/probes/push_host_pieces.py TREE` (best of 3 each; the tree's own code)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]) / "recipes")]
from bench_weight_sync import trainer_tensors  # noqa: E402

from rollout import Engine  # noqa: E402
from rollout.tools.bench import speed_model_dir  # noqa: E402
from weight_sync.buckets import pack, parse_specs, plan_buckets, unpack  # noqa: E402
from weight_sync.pusher import WeightPusher  # noqa: E402


def best_ms(f, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        f()
        times.append(time.perf_counter() - began)
    return min(times) * 1e3


def main() -> None:
    model = speed_model_dir("qwen3-30b-a3b-tiny")
    named = trainer_tensors(model, True, torch.device("cpu"), torch.float32)
    engine = Engine(model=model, spec="off", device="cpu", load_format="dummy")
    names, shapes = [n for n, _ in named], [list(t.shape) for _, t in named]
    specs = parse_specs(names, ["float32"] * len(names), shapes)
    layout = plan_buckets(specs, 128 << 20)
    tensors = [t for _, t in named]
    bufs = [pack(b, tensors, specs) for b in layout]
    staged = [x for b, buf in zip(layout, bufs) for x in unpack(b, buf, specs)]
    triples = [(s.name, s.shape, s.dtype) for s in specs]
    pusher = WeightPusher(transports=[None])
    payload = json.dumps({"names": names, "dtypes": ["float32"] * len(names), "shapes": shapes})
    rows = {
        "name and describe the tensors (trainer)": lambda: pusher.describe(named),
        "the metadata to JSON and back": lambda: json.loads(json.dumps(json.loads(payload))),
        "parse the metadata": lambda: parse_specs(names, ["float32"] * len(names), shapes),
        "check it against the model": lambda: engine.weights.check(triples),
        "plan the buckets": lambda: plan_buckets(specs, 128 << 20),
        "pack (trainer)": lambda: [pack(b, tensors, specs, out=buf) for b, buf in zip(layout, bufs)],
        "unpack (receiver)": lambda: [unpack(b, buf, specs) for b, buf in zip(layout, bufs)],
        "swap (engine)": lambda: engine.update_weights_staged(triples, staged, engine.weight_version + 1, recompute_kv=False),
    }
    print(f"{len(specs)} tensors, {len(layout)} bucket(s)")
    for label, f in rows.items():
        print(f"| {label} | {best_ms(f):.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
