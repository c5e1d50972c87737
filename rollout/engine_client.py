"""The front end's handle on the engine process: start it, feed it, hear back, notice its death.

`EngineClient` owns the subprocess (`python -m rollout.engine_loop`) and the two ZMQ pipes
(rollout.protocol). Requests are queued with `submit()` and go out together at the end of
the event-loop tick; one receive task turns `out` messages into `RequestState` updates and
`ctl_reply` messages into the results of `control()` calls. When the process exits, every
waiting request and control call fails at once with `EngineDead`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from rollout import protocol
from rollout.config import EngineConfig

log = logging.getLogger("rollout.server")


class EngineDead(RuntimeError):
    """The engine process is gone; nothing in flight will finish."""


class EngineRefused(ValueError):
    """The engine rejected a request (e.g. it needs more KV than the pool holds)."""


class ControlError(RuntimeError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class SampleState:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    versions: list[str] = field(default_factory=list)  # per token, as reported (weight_version labels)
    finish: dict | None = None  # {"type": stop|length|abort, "matched": ...} once finished
    spec: dict = field(default_factory=dict)
    weight_version: str = "0"  # the engine's version (as reported) at this sample's latest update


@dataclass(eq=False)
class RequestState:
    """One engine request (one prompt, `n` samples) as the front end sees it."""

    rid: str
    n: int
    prompt_tokens: int
    max_new_tokens: int
    return_logprob: bool
    stream: asyncio.Queue | None  # streaming: gets (state, sample index) after each update, (state, None) on error
    done: asyncio.Future
    samples: list[SampleState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.done.done()


class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self.config = config
        self.log_level = log_level
        self.info: dict = {}
        self.weight_version = "0"  # the engine's, as of its latest message
        self.requests: dict[str, RequestState] = {}
        self.dead: str | None = None  # why, once the engine is gone
        self.proc: subprocess.Popen | None = None
        self._controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._outbox: list[dict] = []  # messages waiting for the end of this tick
        self._flush_scheduled = False
        self._tasks: list[asyncio.Task] = []
        self._num_requests = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = {"stop": 0, "length": 0, "abort": 0}
        self._dir = tempfile.mkdtemp(prefix="rollout-zmq-")  # 0700: only this user can reach the sockets
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a slow engine
        self._send.setsockopt(zmq.LINGER, 0)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._to_engine = f"ipc://{self._dir}/to_engine"
        self._from_engine = f"ipc://{self._dir}/from_engine"
        self._send.bind(self._to_engine)
        self._recv.bind(self._from_engine)

    # ---------------- life cycle ----------------
    def spawn(self) -> None:
        """Start the engine process (it loads the model meanwhile; `start()` waits for it)."""
        if self.proc is not None:
            return
        cmd = [
            sys.executable, "-m", "rollout.engine_loop",
            "--config", json.dumps(asdict(self.config)),
            "--recv", self._to_engine, "--send", self._from_engine,
            "--parent-pid", str(os.getpid()), "--log-level", self.log_level,
        ]  # fmt: skip
        # Its own session: a terminal's Ctrl-C reaches only the front end, which then stops it in order.
        self.proc = subprocess.Popen(cmd, start_new_session=True)

    async def start(self, timeout: float = 1800.0) -> dict:
        """Spawn the engine process if needed and wait until its model is loaded; returns its info."""
        self.spawn()
        ready = asyncio.ensure_future(self._recv.recv())
        exited = asyncio.ensure_future(asyncio.to_thread(self.proc.wait))
        done, _ = await asyncio.wait({ready, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            await self.stop()
            why = f"exited with code {self.proc.returncode}" if exited in done else f"did not load in {timeout:.0f} s"
            raise RuntimeError(f"the engine process {why}; its log above says why")
        msg = protocol.unpack(ready.result())
        if msg["type"] != protocol.READY:
            await self.stop()
            raise RuntimeError(f"the engine process failed to start: {msg.get('error')}")
        self.info = msg["info"]
        self.weight_version = str(self.info["weight_version"])
        self._tasks = [asyncio.ensure_future(self._receive_loop()), asyncio.ensure_future(self._watch(exited))]
        return self.info

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, then terminate it; fails whatever is still in flight."""
        self._mark_dead("the server is shutting down")
        if self.proc is not None and self.proc.poll() is None:
            self._outbox.append({"type": protocol.SHUTDOWN})
            self._flush()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
            except asyncio.TimeoutError:
                log.warning("the engine process did not exit in %.0f s; killing it", timeout)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        for task in self._tasks:
            task.cancel()
        self._send.close()
        self._recv.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill_now(self) -> None:
        """Last resort at interpreter exit, when the event loop is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def counters(self) -> dict:
        return {
            "requests_total": self._num_requests,
            "prompt_tokens_total": self._prompt_tokens,
            "generation_tokens_total": self._generation_tokens,
            "samples_finished_total": dict(self._finished),
            "requests_in_flight": len(self.requests),
        }

    @property
    def alive(self) -> bool:
        return self.dead is None and self.proc is not None and self.proc.poll() is None

    async def _watch(self, exited: asyncio.Future) -> None:
        code = await exited
        self._mark_dead(self.dead or f"the engine process exited with code {code}")

    def _mark_dead(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            if "shutting down" not in why:
                log.error("%s; in-flight requests fail and /health answers 503", why)
        err = EngineDead(self.dead)
        for state in self.requests.values():
            _fail(state, err)
        self.requests.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(err)
        self._controls.clear()

    # ---------------- requests ----------------
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: dict,
        return_logprob: bool,
        stream: asyncio.Queue | None = None,
    ) -> RequestState:
        """Queue a request for the engine (sent at the end of this tick)."""
        if not self.alive:
            raise EngineDead(self.dead or "the engine is not running")
        if rid in self.requests:
            raise ValueError(f"rid: request id {rid!r} is already in flight")
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)
        n = params.get("n", 1)
        state = RequestState(
            rid, n, len(input_ids), params.get("max_new_tokens", 0), return_logprob, stream, done,
            [SampleState(logprobs=[] if return_logprob else None, weight_version=self.weight_version) for _ in range(n)],
        )  # fmt: skip
        self.requests[rid] = state
        self._num_requests += 1
        self._prompt_tokens += len(input_ids)
        self._queue_batch(add=protocol.add_request(rid, input_ids, params, return_logprob, stream is not None))
        return state

    def abort(self, rid: str) -> None:
        """Ask the engine to stop a request; its partial output still arrives, finished with abort."""
        if rid in self.requests and self.alive:
            self._queue_batch(abort=rid)

    async def control(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """One control call (see EngineLoop.handlers); raises ControlError with an HTTP status."""
        if not self.alive:
            raise EngineDead(self.dead or "the engine is not running")
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        self._outbox.append(protocol.control(cid, op, args))
        self._schedule_flush()
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)
        if not reply["ok"]:
            raise ControlError(reply["error"], reply["status"])
        return reply["result"]

    def _queue_batch(self, add: dict | None = None, abort: str | None = None) -> None:
        last = self._outbox[-1] if self._outbox else None
        if last is None or last["type"] != protocol.BATCH or (add is not None and last["abort"]):
            last = protocol.batch([], [])  # keep order: an add never overtakes an earlier abort
            self._outbox.append(last)
        if add is not None:
            last["add"].append(add)
        if abort is not None:
            last["abort"].append(abort)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, []
        for msg in outbox:
            try:
                self._send.send(protocol.pack(msg), flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # no engine on the other end
                self._mark_dead(f"cannot reach the engine process ({e})")
                return

    # ---------------- results ----------------
    async def _receive_loop(self) -> None:
        while True:
            data = await self._recv.recv()
            try:
                self._on_message(protocol.unpack(data))
            except Exception:  # a bug here must not leave every later request hanging
                log.exception("failed to handle a message from the engine")

    def _on_message(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == protocol.OUT:
            self.weight_version = msg["weight_version"]
            for out in msg["reqs"]:
                self._on_output(out, msg["weight_version"])
        elif kind == protocol.CTL_REPLY:
            fut = self._controls.get(msg["cid"])
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif kind == protocol.FATAL:
            self._mark_dead(f"the engine process crashed: {msg['error']}")
        else:
            log.error("dropping a message of unknown type %r from the engine", kind)

    def _on_output(self, out: dict, weight_version: str) -> None:
        state = self.requests.get(out["rid"])
        if state is None:
            return
        if "error" in out:
            del self.requests[state.rid]
            _fail(state, EngineRefused(out["error"]))
            return
        for seq in out["seqs"]:
            s = state.samples[seq["i"]]
            if s.ids:
                s.ids.extend(seq["ids"])
                s.versions.extend(seq["wv"])
                if seq["lp"] is not None:
                    s.logprobs.extend(seq["lp"])
            else:
                s.ids, s.versions = seq["ids"], seq["wv"]
                if seq["lp"] is not None:
                    s.logprobs = seq["lp"]
            s.spec = seq["spec"]
            s.weight_version = weight_version
            if seq["finish"] is not None:
                s.finish = seq["finish"]
                self._finished[s.finish["type"]] = self._finished.get(s.finish["type"], 0) + 1
                self._generation_tokens += len(s.ids)
            if state.stream is not None:
                state.stream.put_nowait((state, seq["i"]))
        if all(s.finish is not None for s in state.samples):
            del self.requests[state.rid]
            state.done.set_result(state)


def _fail(state: RequestState, err: Exception) -> None:
    if not state.done.done():
        state.done.set_exception(err)
        if state.stream is not None:
            state.stream.put_nowait((state, None))


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a failure as seen: a request whose client left may fail with nobody awaiting it."""
    if not fut.cancelled():
        fut.exception()
