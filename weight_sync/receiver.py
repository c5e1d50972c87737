"""Engine side of weight sync: receive in the background, swap in at a step boundary.

The receiver lives in the engine process next to the Engine and is driven by the engine
loop (rollout.server.engine_loop), the only thread that touches the engine. Every operation
returns a `concurrent.futures.Future` at once; the loop replies when it is done (result: a
dict; failure: `WeightSyncError`, whose `.status` is the HTTP status to answer) and calls
`at_step_boundary()` between steps, where finished receives are swapped in through
`Engine.update_weights_staged`.

What blocks where:
- The loop thread validates each update whole (names, shapes, dtypes against the model;
  version monotone) before anything is received, and later applies staged tensors with
  `engine.update_weights_staged` between two steps. Only the apply pauses generation: a memcpy of
  the model (device to device, or host to device with host staging).
- One worker thread per group rendezvouses and receives broadcasts into staging buffers;
  a single I/O thread reads safetensors and opens IPC handles. They never touch the engine,
  so generation goes on while a push is in flight.
- A failed, timed-out or cancelled receive fails its future, frees its staging and closes
  the group (the peer's state is unknown; a fresh `init_group` works, with the same name or
  another). Validation failures on a distributed update close the group too: the trainer is
  already broadcasting, and a closed connection is what stops it cleanly.

Versions: the engine counts weight versions as ints (every output token records one); HTTP
speaks strings, as SGLang. An integer-like `weight_version` ("12") is that int and must be
above the current (and any pending) version; any other string is a label for the next int
(current + 1); none means current + 1. `version_label(v)` gives back the string for outputs.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from rollout.models.weights import WeightError, checkpoint_specs, iter_checkpoint
from weight_sync.buckets import (
    Bucket,
    TensorSpec,
    align,
    bucket_buffer,
    header,
    parse_specs,
    plan_buckets,
    unpack,
)
from weight_sync.errors import WeightSyncError
from weight_sync.group import WeightGroup, resolve_backend
from weight_sync.ipc import decode_fields, open_cuda_tensor

log = logging.getLogger("rollout.weight_sync")

DEFAULT_TIMEOUT_S = 300.0
RECEIVES_AHEAD = 4  # a group's broadcasts posted before the first of them is waited for
_INT_VERSION = re.compile(r"\s*\d{1,18}\s*")


class _GroupWorker:
    """One daemon thread running a group's calls in order (rendezvous, receives, closing). A daemon:
    gloo's abort waits for receives still posted to time out (up to a minute), and a
    ThreadPoolExecutor's thread blocked there held the engine process's exit until its server
    killed it (10 s, every stop after an abandoned push)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._open = True
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def submit(self, fn, *args) -> Future:
        if not self._open:
            raise RuntimeError("the group's worker has shut down")
        fut: Future = Future()
        self._calls.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """No more calls; those queued still run."""
        if self._open:
            self._open = False
            self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fut, fn, args = call
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                    fut.set_exception(e)


@dataclass(eq=False)
class _GroupSlot:
    name: str
    worker: _GroupWorker
    group: WeightGroup | None = None
    closed: bool = False


@dataclass(eq=False)
class _Update:
    method: str
    version: int
    label: str
    flush_cache: bool
    specs: list[TensorSpec]
    future: Future = field(default_factory=Future)
    state: str = "receiving"  # receiving | ready | failed
    tensors: list[tuple[str, torch.Tensor]] | None = None
    buckets_done: int = 0
    started: float = field(default_factory=time.perf_counter)
    received_s: float = 0.0

    @property
    def num_tensors(self) -> int:
        return len(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


class WeightReceiver:
    def __init__(
        self,
        engine,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        staging: str = "auto",
    ):
        """`timeout_s`: how long one update (or a rendezvous) may take before it is abandoned.
        `staging` (GPU engines; NCCL and disk updates): `device` stages the received tensors on
        the GPU (fast swap, a second copy of the pushed weights in GPU memory), `cpu` in pinned
        host memory (the swap is a host-to-device copy), `auto` picks device when free memory allows."""
        if staging not in ("auto", "device", "cpu"):
            raise ValueError(f"staging {staging!r}: choose auto, device or cpu")
        self.engine = engine
        self.timeout_s = timeout_s
        self.staging = staging
        self._groups: dict[str, _GroupSlot] = {}
        self._groups_lock = threading.Lock()
        self._pending: deque[_Update] = deque()
        self._labels: dict[int, str] = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="weight-sync-io")
        self._stream = None
        self._metadata = _LastMetadata()
        self.last_update: dict = {}
        self.last_error = ""

    # ---------------- groups ----------------
    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_sync",
        backend: str = "auto",
    ) -> Future:
        """Join the trainer's group as rank `rank_offset`; the rendezvous runs in the group's worker thread."""
        try:
            _check(isinstance(master_address, str) and master_address, "master_address must be a host name or address")
            _check(_is_int(master_port) and 0 < master_port < 65536, "master_port must be an integer in 1..65535")
            _check(_is_int(world_size) and world_size >= 2, "world_size must be an integer >= 2 (the trainer plus engines)")
            _check(_is_int(rank_offset) and 1 <= rank_offset < world_size, "rank_offset must be in 1..world_size-1 (rank 0 is the trainer)")
            _check(isinstance(group_name, str) and group_name, "group_name must be a non-empty string")
            _check(isinstance(backend, str), "backend must be gloo, nccl or auto")
            resolve_backend(backend, self.engine.device)
        except WeightSyncError as e:
            return _failed(e)
        old = self._take_group(group_name)
        if old is not None:
            log.warning("weight-update group %r is being replaced by a new one", group_name)
            self._close_slot(old)
        slot = _GroupSlot(group_name, _GroupWorker(f"weight-sync-{group_name}"))
        with self._groups_lock:
            self._groups[group_name] = slot
        fut: Future = Future()

        def connect() -> None:
            try:
                group = WeightGroup.connect(
                    master_address, master_port, rank_offset, world_size, group_name, backend, self.engine.device, self.timeout_s
                )
            except BaseException as e:  # noqa: BLE001
                self._drop_group(slot)
                fut.set_exception(_as_sync_error(e))
            else:
                if slot.closed:  # destroyed while we were connecting
                    group.close()
                    fut.set_exception(WeightSyncError(f"weight-update group {group_name!r} was destroyed while connecting", 409))
                else:
                    slot.group = group
                    fut.set_result({"success": True, "message": f"joined group {group_name!r} as rank {rank_offset} ({group.backend})"})

        slot.worker.submit(connect)
        return fut

    def destroy_group(self, group_name: str = "weight_sync") -> Future:
        if not (isinstance(group_name, str) and group_name):
            return _failed(WeightSyncError(f"group_name must be a non-empty string (got {group_name!r})"))
        slot = self._take_group(group_name)
        if slot is None:
            return _failed(WeightSyncError(f"no weight-update group named {group_name!r}", 404))
        self._close_slot(slot)
        return _done({"success": True, "message": f"group {group_name!r} destroyed"})

    # ---------------- updates ----------------
    def update_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_sync",
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        bucket_bytes: int = 0,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> Future:
        """Tensors by broadcast from rank 0: one per name (`bucket_bytes` 0, SGLang's way) or packed in buckets."""
        malformed = None  # a body of the wrong form is a 400 naming the field, group or not
        try:
            _check(isinstance(group_name, str) and group_name, f"group_name must be a non-empty string (got {group_name!r})")
            _check(_is_int(bucket_bytes) and bucket_bytes >= 0, "bucket_bytes must be an integer >= 0")
            checked = self._metadata.specs_if_same(names, dtypes, shapes)
            specs = checked or parse_specs(names, dtypes, shapes)
        except WeightSyncError as e:
            malformed = e
        with self._groups_lock:
            slot = self._groups.get(group_name) if isinstance(group_name, str) else None
        if slot is None:
            return _failed(malformed or WeightSyncError(
                f"no weight-update group named {group_name!r}: call /init_weights_update_group first", 404))
        try:
            if malformed is not None:
                raise malformed
            if checked is None:
                self._validate(specs)
                self._metadata.remember(names, dtypes, shapes, specs)
            _check_flags(flush_cache, abort_all_requests)
            version, label = self._next_version(weight_version)
        except WeightSyncError as e:
            # The trainer is broadcasting already: closing the group is what stops it.
            self._close_slot(self._take_group(group_name) or slot)
            e.args = (f"{e.args[0]}; group {group_name!r} was closed, init it again to push (WeightPusher does)",)
            return _failed(e)
        layout = self._metadata.layout(specs, bucket_bytes)
        upd = self._submit("distributed", specs, version, label, flush_cache, abort_all_requests)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        slot.worker.submit(self._receive_broadcast, slot, upd, specs, layout, timeout)
        return upd.future

    def update_from_disk(
        self,
        model_path: str,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> Future:
        """A directory of safetensors files (config.json optional), validated from the headers first."""
        try:
            _check(isinstance(model_path, str) and model_path, "model_path must be a directory path")
            specs = _checkpoint_specs(Path(model_path).expanduser())
            self._validate(specs)
            _check_flags(flush_cache, abort_all_requests)
            version, label = self._next_version(weight_version)
        except WeightSyncError as e:
            return _failed(e)
        upd = self._submit("disk", specs, version, label, flush_cache, abort_all_requests)

        def load() -> None:
            # safetensors maps the files lazily: read them here, not in the swap on the loop thread.
            try:
                stage_dev = self._staging_device(self.engine.device, upd.nbytes)
                with self._recv_stream(stage_dev):
                    parts = self.engine.weights.targets()  # (a tensor-parallel rank reads its own)
                    upd.tensors = [(n, t.to(stage_dev, copy=True)) for n, t in iter_checkpoint(Path(model_path).expanduser(), parts)]
                    if self._stream is not None and stage_dev.type == "cuda":
                        self._stream.synchronize()
                self._ready(upd)
            except BaseException as e:  # noqa: BLE001
                self._fail(upd, e)

        self._io.submit(load)
        return upd.future

    def update_from_tensor(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        handles: list[dict],
        bucket_bytes: int = 0,
        weight_version: str | int | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> Future:
        """CUDA IPC handles from a trainer on the same GPU: one per bucket of the layout (see `buckets`).

        The trainer's buffers are the staging: nothing is copied until the swap, so the
        trainer must keep them alive until this future resolves (WeightPusher does)."""
        try:
            if self.engine.device.type != "cuda":
                raise WeightSyncError("update_weights_from_tensor needs a CUDA engine on the trainer's GPU; this engine runs on CPU")
            _check(_is_int(bucket_bytes) and bucket_bytes >= 0, "bucket_bytes must be an integer >= 0")
            specs = self._metadata.specs_if_same(names, dtypes, shapes)
            if specs is None:
                specs = parse_specs(names, dtypes, shapes)
                self._validate(specs)
                self._metadata.remember(names, dtypes, shapes, specs)
            layout = self._metadata.layout(specs, bucket_bytes)
            _check(isinstance(handles, list) and len(handles) == len(layout),
                   f"expected {len(layout)} IPC handle(s) for this layout, got {len(handles) if isinstance(handles, list) else handles!r}")
            for bucket, h in zip(layout, handles):
                f = decode_fields(h)
                if bucket.typed:
                    spec = specs[bucket.slots[0].index]
                    _check(f["size"] == spec.shape and f["dtype"] == spec.dtype,
                           f"{spec.name}: IPC handle holds {f['dtype']} {list(f['size'])}, metadata says {spec.dtype} {list(spec.shape)}")
                else:
                    _check(f["dtype"] == torch.uint8 and f["size"] == (bucket.nbytes,),
                           f"an IPC bucket handle must hold uint8 [{bucket.nbytes}] (got {f['dtype']} {list(f['size'])})")
            _check_flags(flush_cache, abort_all_requests)
            version, label = self._next_version(weight_version)
        except WeightSyncError as e:
            return _failed(e)
        upd = self._submit("tensor", specs, version, label, flush_cache, abort_all_requests)

        def open_handles() -> None:
            try:
                tensors = []
                for bucket, h in zip(layout, handles):
                    tensors.extend(unpack(bucket, open_cuda_tensor(h, self.engine.device), specs))
                upd.tensors = tensors
                self._ready(upd)
            except BaseException as e:  # noqa: BLE001
                self._fail(upd, e)

        self._io.submit(open_handles)
        return upd.future

    def flush_cache(self) -> Future:
        """SGLang's flush: only when no request is in flight (a trainer's check that the server is idle);
        the cached KV is dropped. The n-gram index is untouched."""
        busy = len(self.engine.requests)
        if busy:
            return _failed(WeightSyncError(f"cache not flushed: {busy} request(s) in flight; flush_cache runs only "
                                           "when the server is idle (abort or wait for them first)", 400))
        self.engine.invalidate_kv()
        return _done({"success": True, "message": "KV cache flushed"})

    # ---------------- the step boundary ----------------
    def at_step_boundary(self) -> None:
        """Call from the engine loop between steps: swaps in every update whose tensors have all arrived, in order."""
        while self._pending and self._pending[0].state != "receiving":
            upd = self._pending.popleft()
            if upd.state == "ready":
                self._apply(upd)

    def newest_version(self) -> int:
        """The version of the update submitted last (a tensor-parallel server's other ranks take the same)."""
        return self._pending[-1].version

    def take_staged(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """A tensor-parallel rank's side of rank 0's swap of `version`: the tensors of its own copy,
        once received (this receiver's updates are swapped by rank 0's call, never at a step
        boundary of its own). Older updates, which rank 0 did not swap, are dropped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for old in [u for u in self._pending if u.version < version]:
                self._pending.remove(old)
                self._fail(old, WeightSyncError(f"rank 0 went on to version {version}", 409))
            upd = next((u for u in self._pending if u.version == version), None)
            if upd is None:
                raise WeightSyncError(f"this rank holds no update to version {version}")
            if upd.state != "receiving":
                break
            if time.monotonic() > deadline:
                raise WeightSyncError(f"update to version {version} did not arrive within {self.timeout_s:.0f} s", 504)
            time.sleep(0.001)
        self._pending.remove(upd)
        if upd.state != "ready":
            raise WeightSyncError(f"update to version {version} failed on this rank: {self.last_error}")
        tensors, upd.tensors = upd.tensors, None
        upd.future.set_result({"success": True, "weight_version": upd.label})
        return tensors

    def progress(self) -> list[dict]:
        """Updates in flight, oldest first (for /get_server_info and tests)."""
        return [{"method": u.method, "weight_version": u.label, "state": u.state, "buckets_done": u.buckets_done} for u in self._pending]

    # ---------------- versions ----------------
    def version_label(self, version: int) -> str:
        return self._labels.get(version, str(version))

    @property
    def weight_version(self) -> str:
        return self.version_label(self.engine.weight_version)

    def get_weight_version(self) -> dict:
        return {"weight_version": self.weight_version}

    def stats(self) -> dict:
        u = self.last_update
        return {
            "rollout/weight_version": self.engine.weight_version,
            "rollout/weight_sync_s": u.get("total_s", 0.0),
            "rollout/weight_sync_apply_s": u.get("apply_s", 0.0),
        }

    def close(self) -> None:
        with self._groups_lock:
            slots, self._groups = list(self._groups.values()), {}
        for slot in slots:
            self._close_slot(slot)
        for upd in self._pending:
            self._fail(upd, WeightSyncError("the receiver was closed", 500))
        self._pending.clear()
        self._io.shutdown(wait=False)

    # ---------------- internals ----------------
    def _validate(self, specs: list[TensorSpec]) -> None:
        try:
            self.engine.weights.check((s.name, s.shape, s.dtype) for s in specs)
        except WeightError as e:
            raise WeightSyncError(str(e), 400) from e

    def _next_version(self, requested: str | int | None) -> tuple[int, str]:
        floor = max([self.engine.weight_version] + [u.version for u in self._pending if u.state != "failed"])
        if requested is None or requested == "":
            return floor + 1, str(floor + 1)
        if isinstance(requested, bool) or not isinstance(requested, (int, str)):
            raise WeightSyncError(f"weight_version must be a string (got {requested!r})")
        if isinstance(requested, int) or _INT_VERSION.fullmatch(requested):
            v = int(requested)
            if v <= floor:
                raise WeightSyncError(f"weight_version {v} is not above the current version {floor}; versions must increase", 409)
            return v, str(requested).strip()
        if len(requested) > 256:
            raise WeightSyncError("weight_version labels are at most 256 characters")
        return floor + 1, requested

    def _submit(self, method: str, specs, version: int, label: str, flush_cache: bool, abort_all: bool) -> _Update:
        """Queue a validated update (flags were checked by `_check_flags`)."""
        if abort_all:
            self.engine.abort_all()
        upd = _Update(method, version, label, bool(flush_cache), list(specs))
        self._pending.append(upd)
        return upd

    def _receive_broadcast(self, slot: _GroupSlot, upd: _Update, specs: list[TensorSpec], layout: list[Bucket], timeout: float) -> None:
        """Group worker thread: all buckets into staging, or fail and close the group."""
        try:
            group = slot.group
            if group is None or slot.closed:
                raise WeightSyncError(f"weight-update group {slot.name!r} is not connected", 404)
            deadline = time.monotonic() + timeout
            cancelled = lambda: slot.closed  # noqa: E731
            parts = self.engine.weights.targets() if self.engine.shard.size > 1 else None
            on_host = self._staging_device(group.device, _kept_bytes(specs, parts)) != group.device
            tensors: list[tuple[str, torch.Tensor]] = []
            with self._recv_stream(group.device):
                if not layout[0].typed:
                    expected = header(specs, layout)
                    got = torch.zeros(len(expected), dtype=torch.int64, device=group.device)
                    group.broadcast(got, deadline, cancelled)
                    if got.tolist() != expected:
                        raise WeightSyncError(f"the trainer's broadcast does not match the update's metadata (header {got.tolist()} != {expected})")
                # RECEIVES_AHEAD broadcasts are posted at a time: posted one by one, each waiting for the host to
                # see the last one end, a 128-MB bucket of the 30B-A3B push took 1.2 ms from another H200 (105 GB/s, where
                # the 8B shape's whole push, two or three tensors a bucket against ~39, ran at 140).
                # Host staging receives into RECEIVES_AHEAD device buffers in turn: a bucket's broadcast is
                # posted after the host copies out of its buffer's last bucket were queued (NCCL's stream waits
                # for the current one).
                scratch: list[torch.Tensor | None] = [None] * RECEIVES_AHEAD
                in_flight: deque = deque()

                def finish() -> None:
                    bucket, buf, work = in_flight.popleft()
                    group.wait(work, deadline, cancelled)
                    received = _parts(unpack(bucket, buf, specs), parts)
                    tensors.extend(_pinned_copies(received) if on_host else _owned(received, parts))
                    upd.buckets_done += 1

                for i, bucket in enumerate(layout):
                    if len(in_flight) == RECEIVES_AHEAD:
                        finish()
                    turn = i % RECEIVES_AHEAD
                    buf = bucket_buffer(bucket, specs, group.device, out=scratch[turn])
                    if on_host and not bucket.typed and (scratch[turn] is None or buf.numel() > scratch[turn].numel()):
                        scratch[turn] = buf
                    in_flight.append((bucket, buf, group.start_broadcast(buf)))
                while in_flight:
                    finish()
                if self._stream is not None:
                    self._stream.synchronize()
            upd.tensors = tensors
            self._ready(upd)
        except BaseException as e:  # noqa: BLE001
            self._fail(upd, e)
            with self._groups_lock:
                if self._groups.get(slot.name) is slot:
                    del self._groups[slot.name]
            slot.closed = True
            if slot.group is not None:
                slot.group.close()
                slot.group = None
            slot.worker.shutdown()

    def _staging_device(self, recv_device: torch.device, nbytes: int) -> torch.device:
        if recv_device.type != "cuda" or self.staging == "device":
            return recv_device
        if self.staging == "cpu":
            return torch.device("cpu")
        free, _ = torch.cuda.mem_get_info(recv_device)
        index = recv_device.index if recv_device.index is not None else torch.cuda.current_device()
        free += releasable_bytes(torch.cuda.memory_snapshot(), index)
        return recv_device if nbytes * 1.05 + (1 << 30) < free else torch.device("cpu")

    def _recv_stream(self, device: torch.device):
        if device.type != "cuda":
            return nullcontext()
        torch.cuda.set_device(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._stream)

    def _apply(self, upd: _Update) -> None:
        t0 = time.perf_counter()
        try:
            if upd.version <= self.engine.weight_version:
                raise WeightSyncError(f"weight_version {upd.version} is no longer above the current {self.engine.weight_version}", 409)
            self.engine.update_weights_staged([(s.name, s.shape, s.dtype) for s in upd.specs], upd.tensors, upd.version,
                                              recompute_kv=upd.flush_cache)
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)  # the trainer may reuse its buffers once we answer
        except BaseException as e:  # noqa: BLE001
            upd.future.set_exception(_as_sync_error(e))
            return
        finally:
            upd.tensors = None
        self._labels[upd.version] = upd.label
        apply_s = time.perf_counter() - t0
        self.last_update = {
            "success": True,
            "message": f"weights updated by {upd.method} to version {upd.label}",
            "weight_version": upd.label,
            "version": upd.version,
            "num_tensors": upd.num_tensors,
            "bytes": upd.nbytes,
            "receive_s": upd.received_s,
            "apply_s": apply_s,
            "total_s": time.perf_counter() - upd.started,
        }
        log.info("%s", self.last_update["message"])
        upd.future.set_result(dict(self.last_update))

    def _ready(self, upd: _Update) -> None:
        upd.received_s = time.perf_counter() - upd.started
        upd.state = "ready"

    def _fail(self, upd: _Update, e: BaseException) -> None:
        upd.tensors = None
        upd.state = "failed"
        err = _as_sync_error(e)
        self.last_error = f"update to version {upd.label} by {upd.method} failed: {err}"
        if not upd.future.done():
            upd.future.set_exception(err)
        log.warning("weight update to version %s failed: %s", upd.label, e)

    def _take_group(self, name: str) -> _GroupSlot | None:
        with self._groups_lock:
            return self._groups.pop(name, None)

    def _drop_group(self, slot: _GroupSlot) -> None:
        with self._groups_lock:
            if self._groups.get(slot.name) is slot:
                del self._groups[slot.name]
        slot.closed = True
        slot.worker.shutdown()

    def _close_slot(self, slot: _GroupSlot) -> None:
        """Cancel what runs on the group (within ~0.1 s) and close it, in its own worker thread."""
        slot.closed = True

        def close() -> None:
            if slot.group is not None:
                slot.group.close()
                slot.group = None

        try:
            slot.worker.submit(close)
        except RuntimeError:  # the worker shut down already: it closed the group itself
            pass
        slot.worker.shutdown()


class _LastMetadata:
    """The last update's metadata (names, dtypes, shapes), parsed and checked against the model, and
    its bucket layouts: a trainer pushes the same metadata every step, and parsing, checking and
    planning the 30B-A3B shape's 18,867 tensors again took the receiver 40 ms (on the CI machine)
    before it could receive the first byte."""

    def __init__(self):
        self._key: tuple | None = None
        self._specs: list[TensorSpec] | None = None
        self._layouts: dict[int, list[Bucket]] = {}

    def specs_if_same(self, names, dtypes, shapes) -> list[TensorSpec] | None:
        return self._specs if self._key is not None and self._key == (names, dtypes, shapes) else None

    def remember(self, names, dtypes, shapes, specs: list[TensorSpec]) -> None:
        self._key, self._specs, self._layouts = (names, dtypes, shapes), specs, {}

    def layout(self, specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
        if specs is not self._specs:
            return plan_buckets(specs, bucket_bytes)
        if bucket_bytes not in self._layouts:
            self._layouts[bucket_bytes] = plan_buckets(specs, bucket_bytes)
        return self._layouts[bucket_bytes]


def releasable_bytes(segments: list[dict], device_index: int) -> int:
    """GPU memory this process's allocator holds but would give back for a new allocation: its default pool's
    segments with nothing in use (`torch.cuda.memory_snapshot()`'s). An earlier push's device staging stays cached
    there after its swap, out of `mem_get_info`'s free memory: without it, once a model over half the free memory
    had been pushed, every later push of it went through pinned host memory at PCIe's speed. CUDA graphs' pools are
    not counted: their free blocks stay the graphs'."""
    return sum(s["total_size"] for s in segments
               if s["device"] == device_index and s["active_size"] == 0 and tuple(s["segment_pool_id"]) == (0, 0))


def _parts(tensors: list[tuple[str, torch.Tensor]], targets: dict | None) -> list[tuple[str, torch.Tensor]]:
    """Under tensor parallelism, views of this rank's part of each received tensor: it stages 1/N
    of the push, not all of it."""
    if targets is None:
        return tensors
    return [(n, targets[n].take(t) if n in targets else t) for n, t in tensors]


def _kept_bytes(specs: list[TensorSpec], targets: dict | None) -> int:
    """The bytes a receive stages: the whole push, or under tensor parallelism this rank's parts."""
    if targets is None:
        return sum(s.nbytes for s in specs)
    return sum(int(s.nbytes * targets[s.name].kept) if s.name in targets else s.nbytes for s in specs)


def _owned(tensors: list[tuple[str, torch.Tensor]], targets: dict | None) -> list[tuple[str, torch.Tensor]]:
    """Device staging: the parts copied out of the bucket's buffer, so that it is freed (whole
    tensors stay views of it)."""
    if targets is None:
        return tensors
    return [(n, t.clone() if n in targets and targets[n].part is not None else t) for n, t in tensors]


def _pinned_copies(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Host staging: copies of `tensors` in one block of pinned memory, queued on the current stream."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    starts = [0, *accumulate(align(n) for n in sizes)]
    block = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=True)
    out = []
    for (name, t), off, n in zip(tensors, starts, sizes):
        dst = block[off : off + n].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=True)
        out.append((name, dst))
    return out


def _checkpoint_specs(path: Path) -> list[TensorSpec]:
    """Names, shapes and dtypes from the safetensors headers (no tensor data read): the engine's reader's."""
    try:
        return [TensorSpec(name, shape, dtype) for name, shape, dtype in checkpoint_specs(path)]
    except (WeightError, FileNotFoundError) as e:  # a missing, truncated or garbled file is the client's to fix
        raise WeightSyncError(f"cannot read checkpoint {str(path)!r}: {e}") from e


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise WeightSyncError(message)


def _check_flags(flush_cache, abort_all_requests) -> None:
    _check(isinstance(flush_cache, bool), f"flush_cache must be true or false (got {flush_cache!r})")
    _check(isinstance(abort_all_requests, bool), f"abort_all_requests must be true or false (got {abort_all_requests!r})")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _failed(e: WeightSyncError) -> Future:
    fut: Future = Future()
    fut.set_exception(e)
    return fut


def _done(result: dict) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut


def _as_sync_error(e: BaseException) -> WeightSyncError:
    if isinstance(e, WeightSyncError):
        return e
    if isinstance(e, WeightError):
        return WeightSyncError(str(e), 400)
    return WeightSyncError(f"{type(e).__name__}: {e}", 500)
