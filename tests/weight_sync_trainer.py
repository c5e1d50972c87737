"""A trainer process for the weight-sync tests: changes weights, pushes them, says what HF makes of them.

Run as `python weight_sync_trainer.py --url URL --model DIR [--hf] [--admin-key KEY] [--timeout S]`; reads one JSON command
per line on stdin and answers one JSON line on stdout:
  {"cmd": "push", "method": "distributed"|"disk"|"ipc", "perturb": "mlp"|"attn"|null, "version": "1",
   "bucket_bytes": N, "backend": "auto"|"gloo"|"nccl", "prompts": [[ids]], "max_new_tokens": N,
   "freeze_after": N}  (freeze_after: the trainer stops itself, SIGSTOP, once its N-th broadcast of the push is sent)
     -> {"ok": true, "result": {...}, "reference": [[ids]]}  (reference: HF greedy with the pushed weights)
     or {"ok": false, "error": "...", "status": N}
  {"cmd": "exit"}
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when run from anywhere


class TrainerProcess:
    """The test's handle on a trainer subprocess running this file (it loads while the test goes on)."""

    def __init__(self, url: str, model: Path, hf: bool, device: str = "cpu", admin_key: str | None = None, timeout_s: float = 60):
        cmd = [sys.executable, __file__, "--url", url, "--model", str(model), "--device", device, "--timeout", str(timeout_s)]
        cmd += (["--hf"] if hf else []) + (["--admin-key", admin_key] if admin_key else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = False

    def send(self, **cmd) -> None:
        if not self.ready:
            line = self.proc.stdout.readline()
            assert line and json.loads(line) == {"ready": True}, f"trainer did not start (exit code {self.proc.poll()})"
            self.ready = True
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"trainer exited with {self.proc.poll()}"
        return json.loads(line)

    def push(self, **cmd) -> dict:
        self.send(cmd="push", **cmd)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def perturb(named: dict[str, torch.Tensor], kind: str) -> None:
    """Deterministic changes a training step might make, in place: big enough to change greedy output."""
    with torch.no_grad():
        for name, t in named.items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            if kind == "mlp" and name.endswith("mlp.down_proj.weight") and layer % 3 == 0:
                t.mul_(1.5)
            elif kind == "attn" and layer in (0, 1) and (name.endswith("q_proj.weight") or name.endswith("v_proj.weight")):
                t.mul_(-1.0 if name.endswith("q_proj.weight") else 1.7)


def freeze_after(broadcasts: int) -> None:
    """A trainer that hangs mid-push, at a point of the test's choosing (a push over NVLink ends before a
    test can stop it from outside): the process stops itself once its `broadcasts`-th broadcast has gone out."""
    from weight_sync.group import WeightGroup

    start, count = WeightGroup.start_broadcast, itertools.count(1)

    def start_then_maybe_freeze(group, tensor):
        work = start(group, tensor)
        if next(count) == broadcasts:
            if tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)  # (what was started is sent)
            os.kill(os.getpid(), signal.SIGSTOP)
        return work

    WeightGroup.start_broadcast = start_then_maybe_freeze


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--hf", action="store_true", help="hold an HF model (for reference generations)")
    ap.add_argument("--device", default="cpu", help="where the trainer's weights live (cuda:N for IPC / NCCL)")
    ap.add_argument("--admin-key", default=None, help="the server's --admin-key")
    ap.add_argument("--timeout", type=float, default=60, help="seconds a push may take (the server gives up after it too)")
    args = ap.parse_args()
    from weight_sync import WeightPusher, WeightSyncError

    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        named = dict(hf.named_parameters())
    else:
        from rollout.models.weights import iter_checkpoint

        hf, named = None, dict(iter_checkpoint(args.model))
    if args.device != "cpu":
        torch.cuda.set_device(torch.device(args.device))
        if hf is not None:
            hf.to(args.device)
            named = dict(hf.named_parameters())
        else:
            named = {n: t.to(args.device) for n, t in named.items()}
    pushers: dict[tuple, WeightPusher] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd.get("perturb"):
            perturb(named, cmd["perturb"])
        if cmd.get("freeze_after"):
            freeze_after(cmd["freeze_after"])
        key = (cmd["method"], cmd.get("bucket_bytes", 1 << 20), cmd.get("backend", "auto"))
        if key not in pushers:
            pushers[key] = WeightPusher(args.url, method=key[0], bucket_bytes=key[1], backend=key[2],
                                        admin_key=args.admin_key, timeout_s=args.timeout)
        reply: dict = {"ok": True}
        try:
            reply["result"] = pushers[key].push(named.items(), version=cmd.get("version"))
        except WeightSyncError as e:
            reply = {"ok": False, "error": str(e), "status": e.status}
        if hf is not None and cmd.get("prompts"):
            reply["reference"] = []
            for p in cmd["prompts"]:
                ids = torch.tensor([p], device=hf.device)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cmd["max_new_tokens"], do_sample=False)
                reply["reference"].append(out[0, len(p):].tolist())
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
