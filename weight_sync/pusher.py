"""Trainer side of weight sync: push `named_parameters()` to rollout engines after a step.

    from weight_sync import WeightPusher
    pusher = WeightPusher("http://127.0.0.1:30000", method="distributed", dtype=torch.bfloat16)
    for step in range(steps):
        ...optimizer.step()...
        pusher.push(model.named_parameters(), version=step)

Methods:
- `distributed`: metadata by HTTP (`/update_weights_from_distributed`), bytes by broadcast
  from rank 0 over a group of our own (gloo on CPU, NCCL on GPU; see `group.py`). The
  group is made on the first push (`/init_weights_update_group`, the HTTP call and the
  rendezvous running side by side) and remade after any failure. Each push's HTTP call
  runs in a thread while this thread broadcasts the buckets; buckets are packed while the
  earlier ones are on the wire. Several engine URLs share one group (ranks 1..n).
- `disk`: safetensors into a directory the engines can read (`disk_dir`; default /dev/shm
  when it has room, else the temp directory), then
  `/update_weights_from_disk` to each; the files are removed once the engines answer.
- `ipc`: CUDA IPC handles of packed GPU buffers to engines on the same GPU
  (`/update_weights_from_tensor`); the buffers stay alive until the engines have copied them.

A URL may be an SGLang router's (`sglang-router`): its workers (GET /workers) take the push.
  Costs one extra copy of the pushed weights in GPU memory for the push's duration
  (`bucket_bytes=0` shares each tensor as is, when already contiguous in the sent dtype).

Every push is all or nothing on each engine: it raises `WeightSyncError` with the engine's
message when an engine rejects or loses the update, and that engine keeps its old weights; the
error's `failed` lists the URLs that did (a disk or IPC push still reaches the others; a broadcast
is one collective, so it reaches none). `WeightPusher(err.failed, ...)` retries those alone, with
the same version. A server with several ranks (`--dp-size`) joins the group with all of them
(its /server_info says how many), so one broadcast reaches every replica.
Parameters that are DTensors (FSDP2) must be gathered first (e.g.
`torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`)
and pushed from one rank.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    TensorSpec,
    dtype_name,
    header,
    pack,
    parse_dtype,
    plan_buckets,
)
from weight_sync.errors import WeightSyncError
from weight_sync.group import WeightGroup, resolve_backend
from weight_sync.ipc import share_cuda_tensor

log = logging.getLogger("rollout.weight_sync")

METHODS = ("distributed", "disk", "ipc")
SENDS_AHEAD = 4  # broadcasts in flight, each from its own bucket buffer (as the engines post RECEIVES_AHEAD receives)
_WRAPPERS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def strip_wrapper_prefixes(name: str) -> str:
    """`module._orig_mod.model.layers.0...` (DDP, torch.compile, FSDP1 wrappers) -> `model.layers.0...`."""
    if not name.startswith("module") and "_orig_mod" not in name and "_wrapped_module" not in name:
        return name  # (most names: a push of a mixture of experts renames 18,867)
    parts = [p for p in name.split(".") if p not in _WRAPPERS]
    while parts and parts[0] == "module":  # DDP / DataParallel
        parts = parts[1:]
    return ".".join(parts)


class HttpTransport:
    """POST JSON to one engine, with the admin key; errors become WeightSyncError with the server's message."""

    def __init__(self, url: str, admin_key: str | None = None):
        import requests

        self.url = url.rstrip("/")
        self._session = requests.Session()
        if admin_key:
            self._session.headers["Authorization"] = f"Bearer {admin_key}"

    def post(self, route: str, payload: dict, timeout: float) -> dict:
        import requests

        try:
            r = self._session.post(self.url + route, json=payload, timeout=timeout)
        except requests.RequestException as e:
            raise WeightSyncError(f"{route} on {self.url} failed: {e}", status=503) from e
        try:
            body = r.json()
        except ValueError:
            body = {"error": r.text[:500]}
        if r.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
            message = body.get("error") or body.get("message") if isinstance(body, dict) else None
            if isinstance(message, dict):  # rollout's (and OpenAI's) {"error": {"message": ...}}
                message = message.get("message")
            raise WeightSyncError(f"{route} on {self.url}: {message or r.reason} (HTTP {r.status_code})", status=r.status_code)
        return body

    def ranks(self) -> int:
        """The ranks this server puts in a trainer's group: one per GPU of each replica (SGLang's
        /server_info `dp_size` x `tp_size`; 1 for a server that does not say)."""
        import requests

        try:
            info = self._session.get(self.url + "/server_info", timeout=30).json()
            return int(info.get("dp_size") or 1) * int(info.get("tp_size") or 1)
        except (requests.RequestException, ValueError, TypeError, AttributeError):
            return 1

    def __repr__(self) -> str:
        return self.url


class WeightPusher:
    def __init__(
        self,
        url: str | list[str] | None = None,
        method: str = "distributed",
        *,
        admin_key: str | None = None,
        dtype: torch.dtype | str | None = None,
        bucket_bytes: int | None = None,
        backend: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "weight_sync",
        disk_dir: str | os.PathLike | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float = 300.0,
        rename: Callable[[str], str] | None = strip_wrapper_prefixes,
        transports: list | None = None,
    ):
        """`url`: one engine, a list, or a router (its workers). `dtype`: cast floating tensors before sending
        (e.g. torch.bfloat16 for an engine serving bf16 from fp32 master weights; None keeps them).
        `bucket_bytes`: tensors packed per broadcast / IPC handle; 0 sends each tensor as is.
        Default: 128 MiB for NCCL (few large collectives), 0 for gloo (packing would be one more
        copy of the model on the host) and IPC (each tensor shared in place, no extra GPU memory).
        `master_address`: this machine's address as the engines can reach it (distributed).
        `timeout_s`: how long one push may take; engines abandon a distributed update after it too.
        `transports`: objects with `post(route, payload, timeout) -> dict`, replacing HTTP (tests)."""
        if method not in METHODS:
            raise ValueError(f"method {method!r}: choose {', '.join(METHODS)}")
        if transports is None:
            urls = [url] if isinstance(url, str) else list(url or [])
            if not urls:
                raise ValueError("give the engine URL(s), e.g. WeightPusher('http://127.0.0.1:30000')")
            transports = [HttpTransport(u, admin_key) for u in router_workers(urls, admin_key)]
        self.transports = transports
        self.method = method
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.flush_cache = flush_cache
        self.abort_all_requests = abort_all_requests
        self.timeout_s = timeout_s
        self.rename = rename
        self._group: WeightGroup | None = None
        self._pool = ThreadPoolExecutor(max(2, len(transports)), thread_name_prefix="weight-push-http")
        self._pushes = 0

    # ---------------- the one call a training loop makes ----------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str | None = None) -> dict:
        """Send all tensors as one update; returns {"weight_version", "seconds", "bytes", "bucket_bytes", "responses"}.

        Python's cyclic garbage collector is paused meanwhile: a push makes a few objects a tensor, and
        the 30B-A3B shape's 18,867 tensors set off full collections of the trainer's heap (describing
        them took 220 ms instead of 50 when one ran, on the CI machine, in a process of 400,000 objects)."""
        t0 = time.perf_counter()
        collecting = gc.isenabled()
        gc.disable()
        try:
            tensors, specs, common = self.describe(named_tensors)
            common.update({
                "weight_version": None if version is None else str(version),
                "flush_cache": self.flush_cache,
                "abort_all_requests": self.abort_all_requests,
            })
            self._last_bucket_bytes = 0
            if self.method == "distributed":
                responses = self._push_distributed(specs, tensors, common)
            elif self.method == "disk":
                responses = self._push_disk(specs, tensors, common)
            else:
                responses = self._push_ipc(specs, tensors, common)
        finally:
            if collecting:
                gc.enable()
        self._pushes += 1
        seconds = time.perf_counter() - t0
        nbytes = sum(s.nbytes for s in specs)
        log.info("pushed %d tensors (%.1f MB) by %s in %.3f s", len(specs), nbytes / 1e6, self.method, seconds)
        return {"weight_version": responses[0].get("weight_version"), "seconds": seconds, "bytes": nbytes,
                "bucket_bytes": self._last_bucket_bytes, "responses": responses}

    def close(self) -> None:
        """Tear down the group on both sides (best effort)."""
        if self._group is not None:
            for tr in self.transports:
                try:
                    tr.post("/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30)
                except WeightSyncError as e:
                    log.debug("destroy group on %s: %s", tr, e)
            group, self._group = self._group, None
            group.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "WeightPusher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------- preparing tensors ----------------
    def describe(self, named_tensors) -> tuple[list[torch.Tensor], list[TensorSpec], dict]:
        """The tensors (detached, not yet cast: each is cast as its bucket is packed, no second copy of
        the model), their specs on the wire, and the metadata every method sends (names, dtypes, shapes).
        One pass: a mixture of experts' push describes 18,867 tensors."""
        names, tensors, specs, dtypes, shapes = [], [], [], [], []
        rename, cast = self.rename, self.dtype
        for name, t in named_tensors:
            if type(t).__name__ == "DTensor":
                raise WeightSyncError(f"{name} is a DTensor: gather a full state dict first and push from one rank")
            name = rename(name) if rename else name
            shape = tuple(t.shape)
            dtype = cast if cast is not None and t.is_floating_point() else t.dtype
            names.append(name)
            tensors.append(t.detach())
            specs.append(TensorSpec(name, shape, dtype))
            dtypes.append(dtype_name(dtype))
            shapes.append(list(shape))
        if not names:
            raise WeightSyncError("nothing to push: the iterable of (name, tensor) was empty")
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:3]
            raise WeightSyncError(f"tensor names repeat after renaming, e.g. {dup}")
        return tensors, specs, {"names": names, "dtypes": dtypes, "shapes": shapes}

    # ---------------- distributed ----------------
    def _push_distributed(self, specs, tensors, common: dict) -> list[dict]:
        self._ensure_group(tensors[0].device)
        group = self._group
        bucket_bytes = self.bucket_bytes if self.bucket_bytes is not None else (DEFAULT_BUCKET_BYTES if group.backend == "nccl" else 0)
        self._last_bucket_bytes = bucket_bytes
        payload = {**common, "group_name": self.group_name, "bucket_bytes": bucket_bytes, "timeout_s": self.timeout_s}
        futs = [self._pool.submit(tr.post, "/update_weights_from_distributed", payload, self.timeout_s + 60) for tr in self.transports]
        sent_error = None
        try:
            layout = plan_buckets(specs, bucket_bytes)  # (while the engines check the metadata)
            self._broadcast(group, specs, tensors, layout, bucket_bytes, futs)
        except WeightSyncError as e:
            sent_error = e
            self._drop_group()  # now, not after the answers: the engines still receiving see the trainer leave
        responses, server_error = self._gather(futs)
        if server_error is not None or sent_error is not None:
            self._drop_group()  # the next push makes a fresh one
            raise server_error or sent_error
        return responses

    def _broadcast(self, group: WeightGroup, specs, tensors, layout, bucket_bytes: int, futs: list[Future]) -> None:
        deadline = time.monotonic() + self.timeout_s
        failed = lambda: any(f.done() and f.exception() is not None for f in futs)  # noqa: E731
        dev = group.device
        if not layout[0].typed:
            group.broadcast(torch.tensor(header(specs, layout), dtype=torch.int64, device=dev), deadline, failed)
        on_dev = torch.empty(0, dtype=torch.uint8, device=dev)  # where per-tensor sends go
        # SENDS_AHEAD broadcasts in flight, each from its own buffer: with two, the host had to see bucket i end
        # (polled every 0.5 ms) and pack bucket i+2 within bucket i+1's transfer (0.36 ms for 128 MB over NVLink),
        # and a 30B-A3B push ran at the host's pace (the engines received at 213 GB/s).
        bufs: list[torch.Tensor | None] = [None] * SENDS_AHEAD
        in_flight: deque = deque()
        for i, bucket in enumerate(layout):
            if len(in_flight) == SENDS_AHEAD:
                group.wait(in_flight.popleft(), deadline, failed)  # frees bucket i - SENDS_AHEAD's buffer
            if bucket.typed:
                out = on_dev
            else:
                turn = i % SENDS_AHEAD
                if bufs[turn] is None or bufs[turn].numel() < bucket.nbytes:
                    bufs[turn] = torch.empty(max(bucket.nbytes, bucket_bytes), dtype=torch.uint8, device=dev)
                out = bufs[turn]
            in_flight.append(group.start_broadcast(pack(bucket, tensors, specs, out=out)))
        while in_flight:
            group.wait(in_flight.popleft(), deadline, failed)

    def _ensure_group(self, tensor_device: torch.device) -> None:
        if self._group is not None and not self._group.closed:
            return
        device = tensor_device if tensor_device.type == "cuda" else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backend = resolve_backend(self.backend, device)
        port = self.master_port or _free_port(self.master_address)
        ranks = [tr.ranks() if hasattr(tr, "ranks") else 1 for tr in self.transports]
        world = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]  # a server of k ranks takes offset .. offset + k - 1
        futs = [
            self._pool.submit(
                tr.post,
                "/init_weights_update_group",
                {"master_address": self.master_address, "master_port": port, "rank_offset": offset, "world_size": world,
                 "group_name": self.group_name, "backend": backend},
                self.timeout_s + 60,
            )
            for tr, offset in zip(self.transports, offsets)
        ]
        failed = lambda: any(f.done() and f.exception() is not None for f in futs)  # noqa: E731
        try:
            group = WeightGroup.connect(self.master_address, port, 0, world, self.group_name, backend, device, self.timeout_s, failed)
        except WeightSyncError as e:
            _, err = self._gather(futs)
            raise err or e
        _, err = self._gather(futs)
        if err is not None:
            group.close()
            raise err
        self._group = group

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()

    # ---------------- disk ----------------
    def _push_disk(self, specs, tensors, common: dict) -> list[dict]:
        from safetensors.torch import save_file

        root = self.disk_dir or _scratch_dir(sum(s.nbytes for s in specs))
        root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"weight_push_{os.getpid()}_{self._pushes}_", dir=root))
        try:
            seen, out = set(), {}
            for spec, t in zip(specs, tensors):
                t = t.to(device="cpu", dtype=spec.dtype).contiguous()
                ptr = t.untyped_storage().data_ptr()
                out[spec.name] = t.clone() if ptr in seen else t  # safetensors refuses tensors that share memory
                seen.add(ptr)
            tmp = path / "model.safetensors.tmp"
            save_file(out, str(tmp))
            os.replace(tmp, path / "model.safetensors")
            payload = {"model_path": str(path), "weight_version": common["weight_version"],
                       "flush_cache": common["flush_cache"], "abort_all_requests": common["abort_all_requests"]}
            return self._post_all("/update_weights_from_disk", payload)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # ---------------- ipc ----------------
    def _push_ipc(self, specs, tensors, common: dict) -> list[dict]:
        if any(t.device.type != "cuda" for t in tensors):
            raise WeightSyncError("method='ipc' needs the tensors on the GPU the engine uses")
        bucket_bytes = self._last_bucket_bytes = self.bucket_bytes or 0
        layout = plan_buckets(specs, bucket_bytes)
        bufs = [pack(b, tensors, specs) for b in layout]  # alive until the engine answers
        torch.cuda.current_stream().synchronize()
        payload = {**common, "bucket_bytes": bucket_bytes, "handles": [share_cuda_tensor(b) for b in bufs]}
        try:
            return self._post_all("/update_weights_from_tensor", payload)
        finally:
            del bufs

    # ---------------- helpers ----------------
    def _post_all(self, route: str, payload: dict) -> list[dict]:
        """One update to every engine at once; the first failure (naming its engine's URL) is raised
        once all have answered (each engine takes an update whole or keeps its weights)."""
        futs = [self._pool.submit(tr.post, route, payload, self.timeout_s + 60) for tr in self.transports]
        responses, error = self._gather(futs)
        if error is not None:
            raise error
        return responses

    def _gather(self, futs: list[Future]) -> tuple[list[dict], WeightSyncError | None]:
        """The engines' answers (`futs` in the order of `self.transports`) and, if any failed, one
        error: a refusal's message before any timeout's (which a refusal causes in a broadcast), the
        URLs of all that failed in `failed`."""
        responses, errors = [], []
        for tr, f in zip(self.transports, futs):
            try:
                responses.append(f.result())
            except WeightSyncError as e:
                errors.append((str(tr), e))
            except Exception as e:  # noqa: BLE001
                errors.append((str(tr), WeightSyncError(f"{type(e).__name__}: {e}", 500)))
        if not errors:
            return responses, None
        first = min((e for _, e in errors), key=lambda e: e.status >= 500)  # a refusal before the timeouts it caused
        failed = [url for url, _ in errors]
        message = str(first) if len(errors) == 1 else f"{first} (failed on {len(errors)} of {len(futs)}: {', '.join(failed)})"
        return responses, WeightSyncError(message, first.status, failed)


def router_workers(urls: list[str], admin_key: str | None = None) -> list[str]:
    """The engine URLs behind `urls`: an SGLang router's (`sglang-router`, which answers GET /workers
    with its workers) in its place, any other URL as it is."""
    import requests

    out = []
    for url in urls:
        try:
            r = requests.get(url.rstrip("/") + "/workers", timeout=10,
                             headers={"Authorization": f"Bearer {admin_key}"} if admin_key else None)
            workers = r.json().get("workers") if r.status_code == 200 else None
        except (requests.RequestException, ValueError, AttributeError):
            workers = None
        if isinstance(workers, list) and workers and all(isinstance(w, dict) and "url" in w for w in workers):
            found = [w["url"] for w in workers]
            log.info("router %s: pushing to its %d workers %s", url, len(found), found)
            out += found
        else:
            out.append(url)
    return out


def _scratch_dir(nbytes: int) -> Path:
    """/dev/shm when it has room (no disk I/O), else the temp directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > nbytes * 1.2 + (64 << 20):
        return shm
    return Path(tempfile.gettempdir())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
