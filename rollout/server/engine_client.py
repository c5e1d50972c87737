"""The front end's handle on the engine process: start it, feed it, hear back, restart it.

`EngineClient` owns the subprocess (`python -m rollout.server.engine_loop`) and the two ZMQ pipes
(rollout.server.protocol). Requests are queued with `submit()` and go out together at the end of
the event-loop tick; one receive task turns `Outputs` messages into `RequestState` updates and
`ControlReply` messages into the results of `control()` calls, and notes when it last heard
from the engine (it beats while idle), which is what `/health` reads.

When the process exits, every waiting request and control call fails at once with
`EngineDead`, and a new engine process starts (after a back-off if the last one died
young). It loads the weights most recently loaded from disk (`/update_weights_from_disk`)
under their version, or the model's own: weights pushed over the network or by IPC died
with the old process, and the version it reports says which weights it serves.
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
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from rollout.config import EngineConfig, SamplingParams
from rollout.server import protocol

log = logging.getLogger("rollout.server")


class EngineDead(RuntimeError):
    """The engine process is gone; nothing in flight will finish."""


class EngineRefused(ValueError):
    """The engine rejected a request (status 400, e.g. it needs more KV than the pool holds) or
    failed while running it (status 500; the engine went on with the others)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ControlError(RuntimeError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class SampleState:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    versions: list[str] = field(default_factory=list)  # per token, as reported (weight_version labels)
    top: list | None = None  # per token: ([ids], [logprobs]) of the most likely tokens (top_logprobs_num > 0)
    finish: protocol.Finish | None = None  # once finished
    spec: dict = field(default_factory=dict)
    cached_tokens: int = 0
    weight_version: str = "0"  # the engine's version (as reported) at this sample's latest update


@dataclass(eq=False)
class RequestState:
    """One engine request (one prompt, `n` samples) as the front end sees it."""

    rid: str
    n: int
    prompt_tokens: int
    max_new_tokens: int
    return_logprob: bool
    top_logprobs_num: int
    stream: asyncio.Queue | None  # streaming: gets (state, sample index) after each update, (state, None) on error
    done: asyncio.Future
    samples: list[SampleState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.done.done()


RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # delay before the k-th restart in a row
STABLE_S = 60.0  # an engine that lived this long resets the back-off
EXIT_POLL_S = 0.05  # how often the supervisor looks whether the engine process has exited


class EngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "info", restart: bool = True, dp_rank: int = 0):
        self.config = config
        self.dp_rank = dp_rank  # (of the server's replicas: rollout.server.replicas)
        self.log_level = log_level
        self.restart = restart
        self.info: dict = {}  # the engine's at start: its config, pool, process (rollout.server.protocol ServerInfo)
        self.server_info: dict = {}  # the engine's latest ServerInfo (its numbers as of its latest info message)
        self.weight_version = "0"  # the engine's, as of its latest message (the label of `_version`)
        self._version = -1  # the engine's integer weight version behind `weight_version`
        self.busy_s = 0.0  # how long the engine loop had been busy with its current work, at its latest beat
        self._beat_at = 0.0  # time.monotonic() of that beat
        self.load = protocol.Load()  # the engine's load at its latest beat
        self.requests: dict[str, RequestState] = {}
        self.dead: str | None = None  # why, while no engine answers
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.last_heard = 0.0  # time.monotonic() of the engine's latest message
        self._restore: dict | None = None  # the weights a restarted engine loads: {"model_path", "weight_version"}
        self._in_memory = False  # its latest weights were pushed in memory: a restart cannot load them
        # restarted with older weights than its latest push: replicas route around it until the next push
        self.stale = False
        self._stopping = False
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop it serves, once started
        self._controls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._outbox: list = []  # messages waiting for the end of this tick
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
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [
            sys.executable, "-m", "rollout.server.engine_loop",
            "--config", json.dumps(asdict(self.config)),
            "--recv", self._to_engine, "--send", self._from_engine,
            "--parent-pid", str(os.getpid()), "--log-level", self.log_level,
        ]  # fmt: skip
        if self._restore is not None:
            cmd += ["--restore", json.dumps(self._restore)]
        # Its own session: a terminal's Ctrl-C reaches only the front end, which then stops it in order.
        self.proc = subprocess.Popen(cmd, start_new_session=True)

    async def start(self, timeout: float = 1800.0) -> dict:
        """Spawn the engine process if needed and wait until its model is loaded; returns its info.
        From then on a dead engine process is replaced by a new one."""
        self._loop = asyncio.get_running_loop()
        if not self._tasks:
            self._tasks.append(asyncio.ensure_future(self._receive_loop()))
        self.spawn()
        try:
            await self._wait_ready(timeout)
        except RuntimeError:
            await self.stop()
            raise
        self._tasks.append(asyncio.ensure_future(self._supervise()))
        return self.info

    async def _wait_ready(self, timeout: float) -> None:
        """Until the engine process says it is ready (RuntimeError if it exits or takes too long)."""
        self._ready = asyncio.get_running_loop().create_future()
        exited = asyncio.ensure_future(self._exited())
        try:
            done, _ = await asyncio.wait({self._ready, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if self._ready not in done:
            why = f"exited with code {self.proc.returncode}" if exited in done else f"did not load in {timeout:.0f} s"
            raise RuntimeError(f"the engine process {why}; its log above says why")
        self._ready.result()  # raises if it reported a failure

    async def _supervise(self) -> None:
        """Watch the engine process; when it dies, fail what was in flight and start a new one."""
        in_a_row = 0
        while True:
            started = time.monotonic()
            code = await self._exited()
            if self._stopping:
                return
            self._mark_dead(self.dead or f"the engine process exited with code {code}")
            if not self.restart:
                return
            in_a_row = 0 if time.monotonic() - started > STABLE_S else in_a_row + 1
            delay = RESTART_BACKOFF_S[min(in_a_row, len(RESTART_BACKOFF_S) - 1)]
            while not self._stopping:
                self.restarts += 1
                log.warning("restarting engine process %d in %.0f s (restart %d)%s", self.dp_rank, delay, self.restarts,
                            f", with weights {self._restore['weight_version']} from {self._restore['model_path']}"
                            if self._restore else "")
                await asyncio.sleep(delay)
                if self._stopping:
                    return
                self.spawn()
                try:
                    await self._wait_ready(timeout=1800.0)
                except RuntimeError as e:
                    log.error("restarted engine process %d failed: %s", self.dp_rank, e)
                    delay = RESTART_BACKOFF_S[-1]
                    continue
                self.stale = self._in_memory
                log.info("engine process %d is back (pid %d), weight version %s%s", self.dp_rank, self.info["engine_pid"],
                         self.weight_version, ": older than its latest push, so stale until the next" if self.stale else "")
                break

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit, then terminate it; fails whatever is still in flight."""
        self._stopping = True
        self._mark_dead("the server is shutting down")
        if self.proc is not None and self.proc.poll() is None:
            self._outbox.append(protocol.Shutdown())
            self._flush()
            try:
                await asyncio.wait_for(self._exited(), timeout)
            except asyncio.TimeoutError:
                log.warning("the engine process did not exit in %.0f s; killing it", timeout)
                self.proc.kill()
                await self._exited()
        for task in self._tasks:
            task.cancel()
        self._send.close()
        self._recv.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def shutting_down(self) -> None:
        """The server was told to stop (SIGTERM, Ctrl-C): fail what is in flight now, with a 503 that
        says so, rather than when the HTTP server gives up waiting for it. Safe from a signal handler."""
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._mark_dead, "the server is shutting down")

    def kill_now(self) -> None:
        """Last resort at interpreter exit, when the event loop is gone."""
        self._stopping = True
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
            "engine_restarts_total": self.restarts,
        }

    @property
    def alive(self) -> bool:
        """Whether the engine process serves: what /health, /generate and every other route read."""
        return self.dead is None and self.proc is not None and self.proc.poll() is None

    async def _exited(self) -> int:
        """The engine process's exit code, once it has exited. Polled, not waited for in a thread: a
        thread blocked in Popen.wait holds the lock Popen.poll needs, and poll (so `alive`) would say
        a dead process runs until that thread woke."""
        proc = self.proc
        while (code := proc.poll()) is None:
            await asyncio.sleep(EXIT_POLL_S)
        return code

    def silent_for(self) -> float:
        """Seconds since the engine last said anything (it beats every protocol.HEARTBEAT_S, steps or not)."""
        return time.monotonic() - self.last_heard

    def stuck_for(self) -> float:
        """How long the engine loop has been busy with one step or message, as of now."""
        return self.busy_s + time.monotonic() - self._beat_at if self.busy_s else 0.0

    def _note_version(self, label: str, version: int) -> None:
        """The engine's weight version as a message reports it; never back to an older one (a beat
        sent before a swap may arrive after the swap's reply)."""
        if version >= self._version:
            self._version, self.weight_version = version, label

    def _mark_dead(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            if "shutting down" not in why:
                log.error("engine process %d: %s; its in-flight requests fail", self.dp_rank, why)
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
        params: SamplingParams,
        return_logprob: bool,
        stream: asyncio.Queue | None = None,
        top_logprobs_num: int = 0,
    ) -> RequestState:
        """Queue a request for the engine (sent at the end of this tick)."""
        if not self.alive:
            raise EngineDead(self.dead or "the engine is not running")
        if rid in self.requests:
            raise ValueError(f"rid: request id {rid!r} is already in flight")
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)
        state = RequestState(
            rid, params.n, len(input_ids), params.max_new_tokens, return_logprob, top_logprobs_num, stream, done,
            [SampleState(logprobs=[] if return_logprob else None, top=[] if top_logprobs_num else None,
                         weight_version=self.weight_version) for _ in range(params.n)],
        )  # fmt: skip
        add = protocol.AddRequest(rid, input_ids, params, return_logprob, top_logprobs_num, stream is not None)
        try:
            protocol.pack(add)  # what cannot cross the pipe is refused here, not lost on the way
        except (TypeError, ValueError, OverflowError) as e:
            raise EngineRefused(f"the request cannot be sent to the engine: {e}") from None
        self.requests[rid] = state
        self._num_requests += 1
        self._prompt_tokens += len(input_ids)
        self._queue_batch(add=add)
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
        msg = protocol.Control(cid, op, args or {})
        try:
            protocol.pack(msg)
        except (TypeError, ValueError, OverflowError) as e:
            raise ControlError(f"{op}: the request cannot be sent to the engine: {e}", 400) from None
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        self._outbox.append(msg)
        self._schedule_flush()
        try:
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._controls.pop(cid, None)
        if not reply.ok:
            raise ControlError(reply.error, reply.status)
        self._note_weights(op, args or {}, reply.result)
        return reply.result

    def _note_weights(self, op: str, args: dict, result: Any) -> None:
        """Remember what a restarted engine should load (see the module docstring), and whether it could."""
        if not op.startswith("update_weights_from_"):
            return
        self.stale = False
        self._in_memory = op != "update_weights_from_disk"
        if not self._in_memory:
            self._restore = {"model_path": args["model_path"], "weight_version": result["weight_version"]}

    def _queue_batch(self, add: protocol.AddRequest | None = None, abort: str | None = None) -> None:
        last = self._outbox[-1] if self._outbox else None
        if not isinstance(last, protocol.RequestBatch) or (add is not None and last.abort):
            last = protocol.RequestBatch()  # keep order: an add never overtakes an earlier abort
            self._outbox.append(last)
        if add is not None:
            last.add.append(add)
        if abort is not None:
            last.abort.append(abort)
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
            except zmq.ZMQError as e:  # no engine on the other end (it died, or is restarting)
                self._mark_dead(self.dead or f"cannot reach the engine process ({e})")
                return

    # ---------------- results ----------------
    async def _receive_loop(self) -> None:
        while True:
            data = await self._recv.recv()
            self.last_heard = time.monotonic()
            try:
                self._on_message(protocol.unpack(data))
            except Exception:  # a bug here must not leave every later request hanging
                log.exception("failed to handle a message from the engine")

    def _on_message(self, msg) -> None:
        if isinstance(msg, protocol.Beat):
            self._note_version(msg.weight_version, msg.version)
            self.busy_s, self.load, self._beat_at = msg.busy_s, msg.load, self.last_heard
        elif isinstance(msg, protocol.Info):
            self.server_info = msg.info
        elif isinstance(msg, protocol.Ready):
            self.info = self.server_info = msg.info
            self._version, self.weight_version = -1, str(self.info["weight_version"])  # (a new process counts anew)
            self.busy_s, self.load = 0.0, protocol.Load()
            self.dead = None
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(msg, protocol.Outputs):
            for out in msg.requests:
                self._on_output(out, msg.weight_version)
        elif isinstance(msg, protocol.ControlReply):
            self._note_version(msg.weight_version, msg.version)
            fut = self._controls.get(msg.cid)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, protocol.Fatal):
            self._mark_dead(f"the engine process crashed: {msg.error}")
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(f"the engine process failed to start: {msg.error}"))
        else:
            log.error("dropping a message of unexpected type %s from the engine", type(msg).__name__)

    def _on_output(self, out: protocol.RequestOut, weight_version: str) -> None:
        state = self.requests.get(out.rid)
        if state is None:
            return
        if out.error is not None:
            del self.requests[state.rid]
            _fail(state, EngineRefused(out.error, out.status))
            return
        for new in out.samples:
            s = state.samples[new.index]
            s.ids.extend(new.token_ids)
            s.versions.extend(new.weight_versions)
            if new.logprobs is not None:
                s.logprobs.extend(new.logprobs)
            if new.top_logprobs is not None:
                s.top.extend(new.top_logprobs)
            s.spec = new.spec
            s.cached_tokens = new.cached_tokens
            s.weight_version = weight_version
            if new.finish is not None:
                s.finish = new.finish
                self._finished[s.finish.type] = self._finished.get(s.finish.type, 0) + 1
                self._generation_tokens += len(s.ids)
            if state.stream is not None:
                state.stream.put_nowait((state, new.index))
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
