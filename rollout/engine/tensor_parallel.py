"""Tensor parallelism: one engine over N ranks, a process per GPU (NCCL; gloo on the CPU).

Every rank runs the whole engine (scheduler, token table, n-gram index, drafter, sampler,
accept walk) over its shard of the model (rollout/models/sharding.py). The ranks' collectives
leave every rank the same logits, so the same draws, the same accepted drafts and the same
host bookkeeping: the engine is deterministic given its calls. Rank 0 (the `Leader`) is the
engine the caller holds; it sends every call that changes the engine's state (requests added
and aborted, steps, weight swaps, memory) down a pipe to the other ranks (`Follower`), which
replay them in order. The inputs that are not calls are the plan of each decode step and
whether a prefill step runs the draft head: the speculation budget and the head's cycle weigh
measured step times, which differ by rank, so rank 0's choices travel with the step.

Why replay rather than broadcast what the host lays out for each step: a step's host work
(scheduling, emitting, stop checks) is the same code on every rank and costs no collective;
rank 0 writes one small message per step to a pipe and never waits for it, while a broadcast of
the step's arrays would put a blocking host-side collective in every step, and the other ranks
would need a second, layout-driven path through the runner. Messages are JSON, not pickle.

A rank that dies takes the group down: the others notice (their parent is gone, or a pipe or a
collective fails) and exit, and a server restarts the whole engine (rollout/server/engine_client.py).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta

import torch
from torch._C._distributed_c10d import AllreduceOptions, ProcessGroupGloo, ReduceOp, TCPStore

from kernels import fused
from rollout.engine.one_shot_all_reduce import OneShotAllReduce

RENDEZVOUS_TIMEOUT_S = 600.0  # a rank's start: importing torch, building and loading its shard
WATCH_S = 0.2  # how often a rank looks whether the others are alive


class RankGroup:
    """The collectives of one engine's ranks: on the device (NCCL on CUDA, gloo on the CPU), and
    a gloo group on the host for the ranks' agreements (weights all swapped or none). On CUDA the
    small all-reduces and gathers go over symmetric memory (rollout/engine/one_shot_all_reduce.py)
    unless `custom_all_reduce` is off.

    `ordered` (a batch-invariant engine's: deterministic inference): over more than 2 ranks every sum is
    the ranks' parts added in rank order in float32 and rounded once, so a row comes out the same
    bits whatever else its step holds. Otherwise the kernel depends on the step's size (gloo's
    ring and NCCL sum a row in an order set by where it falls; torch's one-shot kernel and the
    fused norm kernel round differently), and 3 or more addends differ with the order. Two ranks
    need nothing: a + b is one rounding in any kernel (measured bitwise on 2 GPUs)."""

    def __init__(self, rank: int, size: int, device: torch.device, store, custom_all_reduce: bool = True,
                 ordered: bool = False):
        self.rank, self.size, self.device = rank, size, device
        self.ordered = ordered and size > 2
        self.one_shot, self.closed = None, False
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.host = ProcessGroupGloo(store, rank, size, opts)
        if device.type == "cuda":
            from torch._C._distributed_c10d import PrefixStore, ProcessGroupNCCL  # only in CUDA builds

            self.dev = ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, ProcessGroupNCCL.Options())
            self.all_reduce(torch.zeros(1, device=device))  # the communicator is built now, not in a graph capture
            torch.cuda.synchronize(device)
            if custom_all_reduce and self.agree(OneShotAllReduce.reachable(device)):
                self.one_shot = OneShotAllReduce(self.dev, store, rank, size, device)
        else:
            self.dev = self.host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.ordered:
            return self.ordered_sum(x)
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.all_reduce(x)
        self.dev.allreduce([x]).wait()
        return x

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None = None, round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x summed over the ranks + residual, rounded to `out_dtype`), that sum): one kernel
        where the one-shot path takes it (its sum is `ordered_sum`'s), else the all-reduce then
        `fused.rms_norm`; either rounds the norm as `fused.rms_norm` does."""
        if self.one_shot is not None and self.one_shot.fits_norm(x, residual):
            return self.one_shot.all_reduce_norm(x, residual, weight, eps, out_dtype, round_once)
        return fused.rms_norm(self.all_reduce(x), weight, eps, residual, out_dtype, round_once)

    def ordered_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` gathered, added in rank order in float32 from zero, rounded once (what
        kernels/all_reduce_norm.py computes): the same bits on every rank, for any number of rows."""
        parts = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.dev._allgather_base(parts, x.contiguous()).wait()
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for part in parts.view(self.size, *x.shape):
            total += part
        return total.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[L, V] on each rank -> [L, size * V], rank order along the last dimension."""
        if self.one_shot is not None and x.dim() == 2 and self.one_shot.fits(x, self.size):
            return self.one_shot.all_gather(x)
        return self.nccl_all_gather(x)

    def nccl_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """`all_gather` by the device group's own collective (NCCL on CUDA, gloo on the CPU)."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.dev._allgather_base(out, x.contiguous()).wait()
        return out.view(self.size, x.shape[0], -1).transpose(0, 1).reshape(x.shape[0], -1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's."""
        self.dev.broadcast([x]).wait()
        return x

    def close(self) -> None:
        """Every rank's last call, once the engine's CUDA graphs are gone: NCCL's communicator is
        finalized on every rank. (Left to its destructor, a process hung at exit on the GPU.)"""
        if self.device.type == "cuda" and not self.closed:
            if self.one_shot is not None:
                self.one_shot.close()
            self.dev.shutdown()
        self.closed = True

    def minimum(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self.host.allreduce([t], opts).wait()
        return int(t.item())

    def agree(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank."""
        return bool(self.minimum(int(ok)))


class Leader:
    """Rank 0: starts the other ranks (`python -m rollout.engine.rank_process`, each with the
    read end of a pipe), and sends them the engine's calls to replay."""

    leads = True
    rank = 0

    def __init__(self, config, device: torch.device, hooks: str | None = None):
        self.size = config.tp_size
        self._store = TCPStore("127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
                               wait_for_workers=False)
        self._pipes, self.procs = [], []
        for rank in range(1, self.size):
            read, write = os.pipe()
            cmd = [sys.executable, "-m", "rollout.engine.rank_process", "--config", json.dumps(asdict(config)),
                   "--rank", str(rank), "--port", str(self._store.port), "--fd", str(read), "--parent-pid", str(os.getpid())]
            self.procs.append(subprocess.Popen(cmd + (["--hooks", hooks] if hooks else []), pass_fds=(read,)))
            os.close(read)
            self._pipes.append(os.fdopen(write, "wb"))
        self._events: list = []
        self.group = RankGroup(0, self.size, device, self._store, not config.disable_custom_all_reduce,
                               ordered=config.batch_invariant)

    def record(self, name: str, *args) -> None:
        """A call for the other ranks to replay (sent with the next `flush`)."""
        self._events.append((name, *args))

    def flush(self) -> None:
        """Send what was recorded: before anything the other ranks must take part in."""
        if self._events:
            data = json.dumps(self._events).encode()
            self._events.clear()
            frame = struct.pack("<Q", len(data)) + data
            for pipe in self._pipes:
                pipe.write(frame)
                pipe.flush()

    def dead_rank(self) -> int | None:
        return next((i + 1 for i, p in enumerate(self.procs) if p.poll() is not None), None)

    def watch(self, on_death: Callable[[int], None]) -> None:
        """Call `on_death(rank)` from a thread as soon as another rank's process ends."""

        def loop() -> None:
            while True:
                rank = self.dead_rank()
                if rank is not None:
                    on_death(rank)
                    return
                time.sleep(WATCH_S)

        threading.Thread(target=loop, name="rollout-tp-watch", daemon=True).start()

    def close(self) -> None:
        """Stop the other ranks (they exit after the calls already sent, closing the group with
        rank 0 unless one is gone)."""
        try:
            self.record("stop")
            self.flush()
        except OSError:  # a rank already gone
            pass
        if self.dead_rank() is None:
            self.group.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pipe in self._pipes:
            try:
                pipe.close()
            except OSError:
                pass


class Follower:
    """Rank r > 0: replays rank 0's calls on its own engine."""

    leads = False

    def __init__(self, rank: int, size: int, port: int, pipe, device: torch.device, custom_all_reduce: bool,
                 ordered: bool):
        self.rank, self.size = rank, size
        self._pipe = pipe
        self._events: deque = deque()
        store = TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        self.group = RankGroup(rank, size, device, store, custom_all_reduce, ordered)
        self._store = store

    def next(self) -> tuple:
        while not self._events:
            head = self._pipe.read(8)
            if len(head) < 8:
                raise EOFError("rank 0 is gone")
            self._events.extend(json.loads(self._pipe.read(struct.unpack("<Q", head)[0])))
        return tuple(self._events.popleft())

    def close(self) -> None:
        self.group.close()

    def expect(self, name: str) -> tuple:
        """The next call, which must be `name` (the engine asks for what rank 0 decided)."""
        event = self.next()
        if event[0] != name:
            raise RuntimeError(f"tensor-parallel rank {self.rank} expected {name!r} from rank 0, got {event[0]!r}")
        return event[1:]


def start_ranks(config, device: torch.device, follower: tuple | None, hooks: str | None):
    """The engine's side of its group: None alone, a Leader for rank 0 (starting the others with
    `hooks`: rollout/engine/rank_process.py), a Follower when `follower` is (rank, port, pipe)."""
    if config.tp_size == 1:
        return None
    if follower is None:
        return Leader(config, device, hooks)
    rank, port, pipe = follower
    return Follower(rank, config.tp_size, port, pipe, device, not config.disable_custom_all_reduce,
                    config.batch_invariant)


def replay(tp: Leader | Follower | None, name: str, *args) -> None:
    """Rank 0: a call the other ranks make too (sent before the next collective); nothing elsewhere."""
    if tp is not None and tp.leads:
        tp.record(name, *args)


def flush(tp: Leader | Follower | None) -> None:
    """Rank 0: send the calls recorded so far."""
    if tp is not None and tp.leads:
        tp.flush()


def rank0_choice(tp: Leader | Follower | None, name: str, decide) -> tuple:
    """`decide()`'s values: choices that weigh this process's measured step times, which differ by
    rank, so under tensor parallelism rank 0's, sent before the step's collectives (a rank that chose
    otherwise would run other collectives, and wait in them alone)."""
    if tp is not None and not tp.leads:
        return tp.expect(name)
    values = decide()
    replay(tp, name, *values)
    return values
