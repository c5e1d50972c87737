"""A process group of our own between a trainer (rank 0) and its engines, outside torch's default group.

Built directly from a TCPStore (the trainer hosts it) and a backend object: gloo on CPU,
NCCL on GPU. Nothing here calls `init_process_group`, so the trainer's own default group
(FSDP, DDP, ...) and any group the engine uses internally are left alone, and a group can
be dropped and rebuilt as often as needed.

Every wait has a deadline and a cancel check: a trainer that dies or hangs mid-broadcast
costs at most the timeout, never a stuck engine. A trainer that gives up on a push (another
engine refused it) says so in the store before it aborts, and an engine that cannot reach the
store any more takes the trainer for gone: either way the engines stop waiting within
`ABORT_POLL_S`, since a closed gloo pair does not always fail the receive on the other side. The store
is asked from a thread of its own (`_TrainerWatch`): a trainer that froze (a stopped process, a hung
host) cannot answer, and a store's question has no timeout short of the store's own (minutes), while
the transfer's deadline must hold. NCCL notes: two ranks cannot share one GPU
(NCCL refuses duplicate devices; a colocated trainer pushes by IPC instead). The watchdog's
default reaction to a failed collective is to kill the process, so our groups are built with
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the process), their
watchdog timeout is set past our own deadline, and we abort the communicator ourselves
when our deadline passes.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    TCPStore,
)

from weight_sync.errors import WeightSyncError

log = logging.getLogger("rollout.weight_sync")

HANDSHAKE = (0x77_73_79_6E_63, 1)  # "wsync", protocol version
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_ENV_LOCK = threading.Lock()
GLOO_OP_TIMEOUT_S = 60.0
ABORT_POLL_S = 0.1  # how often a receiving engine asks the store whether the trainer gave up
_LIVE: "weakref.WeakSet[WeightGroup]" = weakref.WeakSet()


def resolve_backend(backend: str | None, device: torch.device) -> str:
    backend = (backend or "auto").lower()
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"backend {backend!r}: choose gloo, nccl or auto")
    if backend == "nccl" and device.type != "cuda":
        raise WeightSyncError("backend nccl needs a CUDA device on this side; use gloo on CPU")
    return backend


class WeightGroup:
    def __init__(self, name: str, backend: str, pg, store, prefixed, rank: int, world_size: int, device: torch.device):
        self.name = name
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        # Where broadcast buffers live: gloo moves host memory, NCCL device memory.
        self.device = device if backend == "nccl" else torch.device("cpu")
        self._pg = pg
        self._store = store  # the trainer's side hosts the store; it must outlive the group
        self._prefixed = prefixed  # this group's keys in it (`aborted`: the trainer gave up a transfer)
        self._watch = _TrainerWatch(prefixed, name) if rank != 0 else None
        self._opts = BroadcastOptions()
        self._opts.rootRank = 0
        self._opts.rootTensor = 0
        _LIVE.add(self)

    @classmethod
    def connect(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        device: torch.device,
        timeout_s: float,
        cancelled: Callable[[], bool] | None = None,
    ) -> "WeightGroup":
        """Rendezvous and shake hands; blocks until every rank has joined (or raises after `timeout_s`).

        Rank 0 hosts the store and waits, cancellably, until every other rank has announced
        itself in it before building the group: a peer that never comes (an HTTP call that was
        refused) costs a cancel, not a thread stuck in the backend's constructor."""
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"rank {rank} is outside the group's world_size {world_size}")
        backend = resolve_backend(backend, device)
        deadline = time.monotonic() + timeout_s
        timeout = timedelta(seconds=timeout_s)
        try:
            store = TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout, wait_for_workers=False)
            prefixed = PrefixStore(f"weight_sync/{group_name}/", store)
            if rank == 0:
                _wait_for_peers(prefixed, world_size, deadline, cancelled, group_name)
            else:
                prefixed.set(f"joined/{rank}", "1")
            if backend == "gloo":
                opts = ProcessGroupGloo._Options()
                # Per operation; also bounds how long closing a group with a transfer stuck in it can take.
                opts._timeout = timedelta(seconds=min(timeout_s, GLOO_OP_TIMEOUT_S))
                host = "127.0.0.1" if master_address in _LOOPBACK else ""
                opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
                pg = ProcessGroupGloo(prefixed, rank, world_size, opts)
            else:
                pg = _nccl_group(prefixed, rank, world_size, timedelta(seconds=timeout_s + 60))
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - torch raises bare RuntimeErrors with the useful text
            raise WeightSyncError(
                f"could not join weight-update group {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size} ({backend}): {e}",
                status=504 if "timeout" in str(e).lower() or "timed out" in str(e).lower() else 500,
            ) from e
        group = cls(group_name, backend, pg, store, prefixed, rank, world_size, device)
        try:
            hello = torch.tensor(HANDSHAKE if rank == 0 else (0, 0), dtype=torch.int64, device=group.device)
            group.broadcast(hello, deadline)
            if tuple(hello.tolist()) != HANDSHAKE:
                raise WeightSyncError(f"the peer of group {group_name!r} does not speak this weight-sync protocol (got {hello.tolist()})")
        except BaseException:
            group.close()
            raise
        return group

    def broadcast(self, tensor: torch.Tensor, deadline: float, cancelled: Callable[[], bool] | None = None) -> None:
        """Rank 0 sends `tensor`, the others receive into it; blocks until done, the deadline, or cancel."""
        self.wait(self.start_broadcast(tensor), deadline, cancelled)

    def start_broadcast(self, tensor: torch.Tensor):
        """Start a broadcast and return its work handle for `wait` (the tensor must stay untouched until then)."""
        if self._pg is None:
            raise WeightSyncError(f"weight-update group {self.name!r} is closed", status=500)
        try:
            return self._pg.broadcast([tensor], self._opts)
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"broadcast on group {self.name!r} failed: {e}", status=500) from e

    def wait(self, work, deadline: float, cancelled: Callable[[], bool] | None = None) -> None:
        while True:
            if cancelled is not None and cancelled():
                raise WeightSyncError(f"weight-update group {self.name!r} was closed during a transfer", status=500)
            if self._watch is not None:
                self._watch.check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WeightSyncError(f"timed out waiting for the trainer on group {self.name!r}", status=504)
            try:
                if self.backend == "gloo":
                    # At least 1 ms: gloo reads a shorter wait as 0, "no timeout given", and blocks for the op timeout.
                    work.wait(timedelta(seconds=min(max(remaining, 0.001), 0.1)))
                    return
                if work.is_completed():
                    work.wait()  # raises if the collective failed; orders the current stream after it
                    return
                time.sleep(0.0005)
            except Exception as e:  # noqa: BLE001
                if "timed out" in str(e).lower():
                    continue  # our slice ended, not the peer: check the deadline and cancel flag again
                raise WeightSyncError(f"broadcast on group {self.name!r} failed (did the trainer stop?): {e}", status=500) from e

    def close(self) -> None:
        """Abort the group; pending transfers fail on both sides (the engines' within ABORT_POLL_S).
        With gloo this waits for a transfer still in flight to fail or time out (at most
        min(timeout_s, 60 s); at once when the peer is gone)."""
        pg, self._pg = self._pg, None
        if pg is not None and self.rank == 0:
            try:
                self._prefixed.set("aborted", "1")
            except Exception as e:  # noqa: BLE001
                log.debug("marking group %s aborted: %s", self.name, e)
        if self._watch is not None:
            self._watch.stop()
        if pg is not None:
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001
                log.debug("aborting group %s: %s", self.name, e)
        self._store = self._prefixed = None

    @property
    def closed(self) -> bool:
        return self._pg is None


class _TrainerWatch:
    """An engine's view of whether its trainer gave up or is gone, kept by a daemon thread that asks the
    trainer's store every ABORT_POLL_S while transfers wait (`check`), so that a store that cannot answer
    holds up that thread, never a transfer's deadline; a daemon, so that it holds up no exit either."""

    def __init__(self, store, group_name: str):
        self._store, self._name = store, group_name
        self._verdict: str | None = None
        self._asked = 0.0  # when a wait last called `check`
        self._stopped = False
        self._wake = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"weight-sync-watch-{group_name}").start()

    def check(self) -> None:
        """Raise if the trainer abandoned the transfer or its store is gone (as last seen)."""
        self._asked = time.monotonic()
        self._wake.set()
        if self._verdict is not None:
            raise WeightSyncError(self._verdict, status=500)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if time.monotonic() - self._asked > 1.0:  # no transfer waiting: sleep until one asks
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                if self._store.check(["aborted"]):
                    self._verdict = f"the trainer abandoned the transfer on group {self._name!r}"
            except Exception as e:  # noqa: BLE001 - the store went with the trainer
                self._verdict = f"the trainer of group {self._name!r} is gone ({e})"
            if self._verdict is not None:
                return
            time.sleep(ABORT_POLL_S)


@atexit.register
def _close_live_groups() -> None:
    """A backend still open when the interpreter tears down can abort the process ("terminate called")."""
    for group in list(_LIVE):
        group.close()


def _wait_for_peers(store, world_size: int, deadline: float, cancelled, group_name: str) -> None:
    keys = [f"joined/{r}" for r in range(1, world_size)]
    while not store.check(keys):
        if cancelled is not None and cancelled():
            raise WeightSyncError(f"rendezvous of group {group_name!r} cancelled", status=500)
        if time.monotonic() > deadline:
            raise WeightSyncError(f"timed out waiting for the engines to join group {group_name!r}", status=504)
        time.sleep(0.002)


def _nccl_group(store, rank: int, world_size: int, watchdog_timeout: timedelta):
    from torch._C._distributed_c10d import ProcessGroupNCCL  # only in CUDA builds

    opts = ProcessGroupNCCL.Options()
    opts._timeout = watchdog_timeout
    # Read once, in the constructor: set it for this group only.
    with _ENV_LOCK:
        old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            return ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if old is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old
