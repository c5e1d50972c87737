"""How long a weight push takes, by method and model size.

    python recipes/bench_weight_sync.py                          # CPU: default model, broadcast (gloo) and disk
    python recipes/bench_weight_sync.py --models default,8b      # GPU: adds a Llama-3.1-8B-shaped random model
    python recipes/bench_weight_sync.py --methods ipc --models 8b --bucket-mb 0,128
    python recipes/bench_weight_sync.py --methods distributed --models 8b --dp-size 2   # 3+ GPUs: one push, 2 replicas
    python recipes/bench_weight_sync.py --methods distributed --models 8b,32b --tp-size 2   # 3+ GPUs: one push, 2 ranks
    python recipes/bench_weight_sync.py --methods distributed --models 30b-a3b   # 2+ GPUs: Qwen3-30B-A3B's 18,432 experts
    python recipes/bench_weight_sync.py --methods distributed --models 30b-a3b-tiny   # the same names, tiny: the per-tensor cost

The engine is a real `rollout serve` (started here, one per model, random weights for the
8B, 32B (Qwen2.5-32B) and 30B-A3B (Qwen3-MoE) shapes); a trainer subprocess holds the weights (the
default model's checkpoint, or random weights of the shape by the checkpoint's names, each expert's
own) and pushes them with `WeightPusher` over HTTP, as a training loop would. Reported per row: the trainer's wall time for `push()` (median of the
repeats after a warm-up push that also builds the group), the engine's receive and swap
times, and the effective bandwidth (bytes sent / push time).

Broadcast uses NCCL when the machine has a GPU for the trainer beside the server's (trainer on
cuda:0, the server's `--dp-size` x `--tp-size` ranks on cuda:1 on), else gloo through host memory (NCCL cannot put two ranks on one GPU; a colocated trainer pushes
by IPC). On one GPU, `ipc` shares the trainer's buffers with the engine; `disk` writes
safetensors to /dev/shm when it has room.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout.tools.launch import launched_server  # noqa: E402


# ---------------- trainer side (a subprocess) ----------------
# --models: random weights of these shapes (30b-a3b-tiny: the 30B-A3B's tensor names at a tiny width)
SHAPES = {"8b": "llama3-8b", "32b": "qwen2.5-32b", "30b-a3b": "qwen3-30b-a3b", "30b-a3b-tiny": "qwen3-30b-a3b-tiny"}


def trainer_tensors(model_dir: str, random_weights: bool, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from rollout.models.config import ModelConfig
    from rollout.models.loader import build_model, randomize
    from rollout.models.weights import iter_checkpoint

    if random_weights:
        cfg = ModelConfig.from_dir(model_dir)
        model = build_model(cfg, device, dtype)
        randomize(model, seed=1)
        # by the checkpoint's names: not a tied LM head, nor the stacked names a mixture of experts' tensors also go by
        skip = model.optional_weights()
        return [(name, t.view()) for name, t in model.weight_targets().items() if name not in skip]
    return [(n, t.to(device=device, dtype=dtype)) for n, t in iter_checkpoint(model_dir)]


def run_trainer(args: argparse.Namespace) -> None:
    from weight_sync import WeightPusher

    device = torch.device(args.trainer_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    named = trainer_tensors(args.model_dir, args.random, device, dtype)
    bucket_bytes = None if args.bucket_bytes == "auto" else int(args.bucket_bytes)
    pusher = WeightPusher(args.url, method=args.method, bucket_bytes=bucket_bytes, backend=args.backend, timeout_s=600)
    for i in range(args.repeats + 1):  # the first push also builds the group: a warm-up
        r = pusher.push(named)
        rx = r["responses"][0]
        print(json.dumps({"warmup": i == 0, "push_s": r["seconds"], "bytes": r["bytes"], "bucket_bytes": r["bucket_bytes"], "receive_s": rx["receive_s"],
                          "apply_s": rx["apply_s"], "engine_total_s": rx["total_s"], "numel": sum(t.numel() for _, t in named)}), flush=True)
    pusher.close()


# ---------------- engine side ----------------
@contextmanager
def serve(model_dir: str, device: str, dtype: str, random_weights: bool, dp_size: int, tp_size: int,
          base_gpu_id: int) -> Iterator[str]:
    """`rollout serve` for one model; yields its URL, stops it at the end."""
    args = ["--model", model_dir, "--device", device, "--dtype", dtype, "--spec", "off", "--kv-cache-tokens", "4096",
            "--dp-size", str(dp_size), "--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id)]
    if random_weights:
        args += ["--load-format", "dummy"]
    with launched_server(*args) as server:
        yield server.url


def bench(args: argparse.Namespace) -> None:
    from rollout.models.default_model import ensure_default_model
    from rollout.tools.bench import speed_model_dir

    cuda = torch.cuda.is_available() and args.device != "cpu"
    own_gpu = cuda and torch.cuda.device_count() > args.dp_size * args.tp_size  # a GPU for the trainer beside the engines'
    base_gpu_id = 1 if own_gpu else 0
    rows = []
    for model in args.models.split(","):
        if model == "default":
            model_dir, random_weights = str(ensure_default_model()), False
        elif model in SHAPES:
            model_dir, random_weights = speed_model_dir(SHAPES[model]), True
        else:
            raise SystemExit(f"--models: default or one of {', '.join(SHAPES)}, not {model!r}")
        dtype = "bfloat16" if cuda else "float32"
        with serve(model_dir, "cuda" if cuda else "cpu", dtype, random_weights, args.dp_size, args.tp_size, base_gpu_id) as url:
            for method in args.methods.split(","):
                if method == "ipc" and not cuda:
                    print(f"skip ipc for {model}: needs a GPU", file=sys.stderr)
                    continue
                backend, trainer_device = "gloo", "cuda:0" if cuda else "cpu"
                if method == "distributed" and own_gpu:
                    backend = "nccl"
                sizes = args.bucket_mb.split(",") if method != "disk" else ["auto"]  # buckets mean nothing on disk
                for bucket_mb in sizes:
                    bucket_bytes = "auto" if bucket_mb == "auto" else str(int(float(bucket_mb) * (1 << 20)))
                    cmd = [sys.executable, __file__, "--role", "trainer", "--url", url, "--model-dir", model_dir,
                           "--method", method, "--bucket-bytes", bucket_bytes, "--backend", backend,
                           "--trainer-device", trainer_device, "--dtype", dtype, "--repeats", str(args.repeats)]
                    if random_weights:
                        cmd.append("--random")
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                    if out.returncode != 0:
                        print(f"{model} {method}: trainer failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                        continue
                    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
                    timed = [r for r in runs if not r["warmup"]] or runs
                    med = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
                    rows.append({
                        "model": model, "dp": args.dp_size, "tp": args.tp_size, "params_m": timed[0]["numel"] / 1e6, "mb": timed[0]["bytes"] / 1e6, "dtype": dtype,
                        "method": method, "backend": backend if method == "distributed" else "-",
                        "bucket_mb": f"{timed[0]['bucket_bytes'] / (1 << 20):g}" if method != "disk" else "-", "push_s": med("push_s"),
                        "receive_s": med("receive_s"), "apply_s": med("apply_s"), "engine_s": med("engine_total_s"),
                        "gb_per_s": timed[0]["bytes"] / med("push_s") / 1e9, "repeats": len(timed),
                    })
                    print(json.dumps(rows[-1]), flush=True)
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"\nweight push on {device_name} ({torch.get_num_threads()} CPU threads)\n")
    # engine s: from the update's arrival at the engine (validated) to its answer; push s less it is the HTTP request and the
    # checks before, the answer after
    print("| model | replicas x ranks | params (M) | MB sent | method | backend | bucket MB | push s | engine s | receive s | swap s | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dp']} x {r['tp']} | {r['params_m']:.0f} | {r['mb']:.0f} | {r['method']} | {r['backend']} | {r['bucket_mb']} | "
              f"{r['push_s']:.3f} | {r['engine_s']:.3f} | {r['receive_s']:.3f} | {r['apply_s']:.3f} | {r['gb_per_s']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma list of default, 8b, 32b, 30b-a3b, 30b-a3b-tiny "
                    "(default: default on CPU, default,8b on GPU)")
    ap.add_argument("--methods", default=None, help="comma list of distributed, disk, ipc (default: all that the machine allows)")
    ap.add_argument("--bucket-mb", default="auto", help="comma list of bucket sizes in MB; 0 = one broadcast/handle per tensor; "
                    "auto = the pusher's default (128 for NCCL, 0 for gloo and IPC)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"])
    ap.add_argument("--dp-size", type=int, default=1, help="the server's replicas (rollout serve --dp-size): one push reaches all")
    ap.add_argument("--tp-size", type=int, default=1, help="each replica's tensor-parallel ranks (rollout serve --tp-size)")
    # trainer role (internal)
    ap.add_argument("--role", default="bench", choices=["bench", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--bucket-bytes", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-device", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--random", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trainer":
        return run_trainer(args)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.models = args.models or ("default,8b" if cuda else "default")
    args.methods = args.methods or ("distributed,ipc,disk" if cuda else "distributed,disk")
    bench(args)


if __name__ == "__main__":
    main()
