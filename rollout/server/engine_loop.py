"""The engine process: an `Engine` driven by messages from the HTTP front end.

    python -m rollout.server.engine_loop --config '<EngineConfig as JSON>' --recv ipc://... --send ipc://...

The loop: take every message waiting on the socket (blocking only while there is nothing
to step), run one `engine.step()`, send what it produced in one `Outputs` message (see
rollout.server.protocol).

Control calls (abort, pause, and the weight-update ops of
rollout.server.weight_routes) all go through one dispatch: `EngineLoop.handlers` maps an op
name to `handler(args: dict) -> result`. A handler raises to fail the call:
`ValueError`/`TypeError`/`KeyError` answer 400, an exception with a `status` attribute
(e.g. weight_sync.errors.WeightSyncError) answers that status, anything else 500. A
handler that finishes later returns a `concurrent.futures.Future`; the loop replies when it
resolves (checking every `BUSY_POLL_MS` while any is pending) and goes on stepping meanwhile.

Weight updates are received in the background by a weight_sync.WeightReceiver and swapped
in between two steps; while generation is paused (rollout.server.pause) new requests are
held, not refused, and admitted in arrival order on `/continue_generation`. Outputs report
weight versions as the trainer named them (`version_label`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

import zmq

from rollout.config import EngineConfig
from rollout.engine.engine import Engine, freeze_heap
from rollout.engine.sequence import Request, Sequence, Status
from rollout.server import protocol
from rollout.server.protocol import (
    AddRequest,
    Beat,
    Control,
    ControlReply,
    Fatal,
    Finish,
    Info,
    Load,
    Outputs,
    Ready,
    RequestBatch,
    RequestOut,
    SampleOut,
    Shutdown,
)
from rollout.server.pause import PauseGate
from weight_sync.errors import WeightSyncError
from weight_sync.receiver import WeightReceiver

log = logging.getLogger("rollout.server.engine_loop")

IDLE_POLL_MS = int(protocol.HEARTBEAT_S * 1000)  # an idle engine wakes this often: heartbeat, parent alive
BUSY_POLL_MS = 5  # how often a paused or idle loop checks its pending control calls


class EngineLoop:
    def __init__(self, engine: Engine, recv: zmq.Socket, send: zmq.Socket, parent_pid: int | None = None):
        self.engine = engine
        self.recv = recv
        self.send = send
        self.parent_pid = parent_pid
        self.running = True
        self.orphaned = False  # the front end died without stopping us
        self.receiver = WeightReceiver(engine)
        self.gate = PauseGate(engine)
        self.version_label: Callable[[int], str] = self.receiver.version_label
        self.pending_calls: list[tuple[int, str, Future]] = []  # (cid, op, future) of handlers that answer later
        self.streams: dict[str, list[int]] = {}  # rid -> tokens already sent, per sample (streaming requests)
        self.handlers: dict[str, Callable[[dict], Any]] = {
            "ping": self.op_ping,
            "abort_request": self.op_abort_request,
            "release_memory_occupation": lambda a: self.engine.release_memory(a.get("tags")),
            "resume_memory_occupation": lambda a: self.engine.resume_memory(a.get("tags")),
            "pause_generation": lambda a: self.gate.pause(**a),
            "continue_generation": self.op_continue_generation,
            "flush_cache": self.op_flush_cache,
            "get_weight_version": lambda a: self.receiver.get_weight_version(),
            **{op: (lambda a, op=op: receive_weights(self.engine, self.receiver, op, a)) for op in RECEIVER_OPS},
        }
        self.step_failures = 0
        self.busy_since: float | None = None  # time.monotonic() when the loop took up its current work
        self._static_info = engine_info(engine)  # (what never changes: the config, the pool, the process)
        self._info_at = 0.0  # time.monotonic() of the latest info message

    # ---------------- the loop ----------------
    def run(self) -> None:
        while self.running:
            self.busy_since = None
            self._drain(block=not self._should_step())
            self.busy_since = time.monotonic()
            if not self.may_step() or self.engine.released:  # nothing runs; aborted requests still report
                self._publish(self.engine.drain())
            self.receiver.at_step_boundary()  # swap in weights that have arrived
            self.gate.tick()
            if self.pending_calls:
                self._reply_finished_calls()
            if self._should_step():
                self._step()
            self.send_info()

    def _step(self) -> None:
        """One engine step. A step that raises fails the requests in flight (500) and the engine
        starts over with an empty KV pool; the process and the others' later requests go on."""
        try:
            updated = self.engine.step()
        except Exception as e:  # a bug, or a request that got past every check: not a reason to die
            if self.engine.tp is not None:  # (unless the ranks may have failed apart: the group restarts)
                raise
            self.step_failures += 1
            log.exception("an engine step failed; failing the %d request(s) in flight", len(self.engine.requests))
            why = f"the engine failed while running this request ({type(e).__name__}: {e}); the server goes on"
            dropped = self.engine.recover()
            self.streams.clear()
            label = self.version_label(self.engine.weight_version)
            self._emit(Outputs(label, [RequestOut(r.rid, error=why, status=500) for r in dropped]))
            return
        self._publish(updated)

    def beat(self) -> Beat:
        """A Beat: read from the heartbeat thread while the loop runs, so it only reads (numbers, and a
        copy of the running list, each taken under the GIL)."""
        eng = self.engine
        running, waiting = list(eng.scheduler.running), list(eng.scheduler.waiting)
        used = eng.pool.used_slots
        load = Load(
            num_running_reqs=len({id(seq.request) for seq in running}), num_running_seqs=len(running),
            num_waiting_seqs=len(waiting), num_waiting_tokens=sum(len(seq.tokens) - seq.num_cached for seq in waiting),
            num_used_tokens=used, token_usage=used / (eng.pool.num_slots - 1), gen_throughput=eng.tokens_per_s,
        )
        busy = self.busy_since
        version = eng.weight_version
        return Beat(self.version_label(version), version, 0.0 if busy is None else time.monotonic() - busy, load)

    def close(self) -> None:
        """Tear down the weight-update groups and fail updates still in flight."""
        self.receiver.close()

    def may_step(self) -> bool:
        """False while a `keep` pause holds generation in place; aborted requests still report."""
        return self.gate.may_step or not self.engine.scheduler.has_work

    def admit(self, add: AddRequest) -> RequestOut | None:
        """Queue one request, or hold it while paused; returns its refusal if the engine refuses it."""
        if self.gate.paused:
            self.gate.hold(add)
            return None
        rid = add.rid
        try:
            req = self.engine.add_request(add.input_ids, add.params, rid=rid, return_logprob=add.return_logprob,
                                          top_logprobs_num=add.top_logprobs_num)
        except (ValueError, TypeError) as e:
            return RequestOut(rid, error=str(e), status=400)
        except Exception as e:  # a check that should have caught it did not: refuse, never die
            log.exception("admitting request %s failed", rid)
            return RequestOut(rid, error=f"the engine could not take this request ({type(e).__name__}: {e})", status=500)
        if add.stream:
            self.streams[rid] = [0] * len(req.sequences)
        return None

    def abort(self, rid: str) -> bool:
        """Stop one request (held or running); it reports on the next step, finished by abort. False if unknown."""
        return self.gate.cancel(rid) or self.engine.abort(rid)

    def take_batch(self, adds: list[AddRequest], aborts: list[str]) -> None:
        """Admit new requests (answering refusals at once), then abort others: one batch message."""
        refused = [r for r in map(self.admit, adds) if r is not None]
        for rid in aborts:
            self.abort(rid)
        if refused:
            self._emit(Outputs(self.version_label(self.engine.weight_version), refused))

    def _should_step(self) -> bool:
        return self.engine.has_work and self.may_step() and not self.engine.released

    def _drain(self, block: bool) -> None:
        timeout = (BUSY_POLL_MS if self.pending_calls else IDLE_POLL_MS) if block else 0
        while self.running and self.recv.poll(timeout):
            self._handle(protocol.unpack(self.recv.recv()))
            timeout = 0
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.error("the front end (pid %d) is gone; stopping", self.parent_pid)
            self.running = False
            self.orphaned = True

    def _handle(self, msg) -> None:
        if isinstance(msg, RequestBatch):
            self.take_batch(msg.add, msg.abort)
        elif isinstance(msg, Control):
            self._control(msg)
        elif isinstance(msg, Shutdown):
            self.running = False
        else:
            log.error("dropping a message of unexpected type %s", type(msg).__name__)

    def _publish(self, updated: list[Request]) -> None:
        reqs = []
        for req in updated:
            sent = self.streams.get(req.rid)
            if sent is None:  # not streaming: everything at once, when the whole request is done
                if req.finished:
                    reqs.append(RequestOut(req.rid, [sample_out(seq, 0, self.version_label) for seq in req.detach()]))
                continue
            seqs = []
            for seq in req.sequences:
                start = sent[seq.sample_index]
                if start >= 0 and (seq.finished or seq.num_output > start):
                    seqs.append(sample_out(seq, start, self.version_label))
                    sent[seq.sample_index] = -1 if seq.finished else seq.num_output  # -1: finish sent
            if req.finished:
                del self.streams[req.rid]
                req.detach()
            if seqs:
                reqs.append(RequestOut(req.rid, seqs))
        if reqs:
            if not self.engine.has_work:  # a client told its last request is done reads numbers that count it
                self.send_info(force=True)
            self._emit(Outputs(self.version_label(self.engine.weight_version), reqs))

    def send_info(self, force: bool = False) -> None:
        """The server info the front end answers /get_server_info and /metrics from (rollout.server.protocol)."""
        now = time.monotonic()
        if force or now - self._info_at >= protocol.INFO_EVERY_S:
            self._info_at = now
            self._emit(Info(self.server_info()))

    def _emit(self, msg) -> None:
        self.send.send(protocol.pack(msg))

    # ---------------- control ----------------
    def _control(self, msg: Control) -> None:
        cid, op = msg.cid, msg.op
        handler = self.handlers.get(op)
        if handler is None:
            self.reply(cid, error=f"unknown control op {op!r}; known: {', '.join(sorted(self.handlers))}", status=404)
            return
        try:
            result = handler(msg.args or {})
        except Exception as e:  # a failed call must not kill the loop
            self._reply_error(cid, op, e)
            return
        if isinstance(result, Future):
            self.pending_calls.append((cid, op, result))
        else:
            self.reply(cid, result)

    def _reply_finished_calls(self) -> None:
        still = []
        for cid, op, fut in self.pending_calls:
            if not fut.done():
                still.append((cid, op, fut))
            elif fut.exception() is not None:
                self._reply_error(cid, op, fut.exception())
            else:
                self.reply(cid, fut.result())
        self.pending_calls = still

    def _reply_error(self, cid: int, op: str, e: BaseException) -> None:
        status = getattr(e, "status", None) or (400 if isinstance(e, (ValueError, TypeError, KeyError)) else 500)
        if status >= 500:
            log.error("control op %s failed", op, exc_info=e)
        self.reply(cid, error=f"{op}: {e}", status=status)

    def reply(self, cid: int, result: Any = None, error: str | None = None, status: int = 200) -> None:
        self.send_info(force=True)  # (what the call changed is in the info its caller reads next)
        version = self.engine.weight_version
        self._emit(ControlReply(cid, result, error, status, self.version_label(version), version))

    def op_ping(self, args: dict) -> dict:
        return {"weight_version": self.version_label(self.engine.weight_version)}

    def op_abort_request(self, args: dict) -> dict:
        """{"rid": str} or {"abort_all": true}; answers the rids that were in flight."""
        if args.get("abort_all"):
            rids = list(self.engine.requests)
        else:
            rid = args.get("rid")
            if not isinstance(rid, str):
                raise ValueError("rid must be a string (or pass abort_all: true)")
            rids = [rid]
        aborted = [rid for rid in rids if self.abort(rid)]
        if args.get("abort_all"):
            aborted += self.gate.cancel_all()
        return {"aborted": aborted}

    def op_continue_generation(self, args: dict) -> dict:
        adds, cancelled = self.gate.resume()
        self.take_batch(adds, cancelled)  # not paused any more: admitted as if they arrived now
        return {"success": True, "message": f"generation resumed; {len(adds)} held request(s) admitted"}

    def op_flush_cache(self, args: dict) -> Future:
        if self.gate.num_held:
            raise WeightSyncError(f"cache not flushed: {self.gate.num_held} request(s) held; flush_cache runs only "
                                  "when the server is idle (continue or abort them first)", 400)
        return self.receiver.flush_cache()

    def stats(self) -> dict:
        stats = {**self.engine.stats(), **self.receiver.stats()}
        reqs = self.engine.requests.values()
        stats["rollout/num_requests"] = len(reqs)
        stats["rollout/num_running_requests"] = sum(any(s.status is Status.RUNNING for s in r.sequences) for r in reqs)
        stats["rollout/step_failures"] = self.step_failures
        stats["rollout/paused"] = int(self.gate.paused)
        stats["rollout/num_held"] = self.gate.num_held
        return stats

    def server_info(self) -> dict:
        info = dict(self._static_info)
        info["weight_version"] = self.version_label(self.engine.weight_version)
        info["weight_sync"] = {
            "paused": self.gate.mode,
            "held_requests": self.gate.num_held,
            "updates_in_flight": self.receiver.progress(),
            "last_update": self.receiver.last_update,
            "last_error": self.receiver.last_error,
        }
        info["stats"] = self.stats()
        return info


class Heartbeat(threading.Thread):
    """Beats for the front end every HEARTBEAT_S, from a thread and a socket of its own: a step may
    take seconds (a prefill chunk on a CPU), and /health must still hear that the process is alive
    and how long its current step has run."""

    def __init__(self, loop: EngineLoop, ctx: zmq.Context, address: str):
        super().__init__(name="heartbeat", daemon=True)
        self.loop, self.ctx, self.address = loop, ctx, address
        self.stopped = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)  # (a front end that stopped reading gets no backlog of stale beats)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self.stopped.wait(protocol.HEARTBEAT_S):
                try:
                    sock.send(protocol.pack(self.loop.beat()), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                except Exception:  # a beat that failed to read must not end the beats
                    log.exception("a heartbeat failed")
        finally:
            sock.close()


def sample_out(seq: Sequence, start: int, label: Callable[[int], str]) -> SampleOut:
    """A sample's output from token `start` on; weight versions as `label` reports them."""
    finish = Finish(seq.finish_reason or "abort", seq.matched_stop, seq.finish_message) if seq.finished else None
    return SampleOut(
        index=seq.sample_index,
        token_ids=seq.output_ids[start:],
        logprobs=seq.logprobs[start:] if seq.request.return_logprob else None,
        weight_versions=[label(v) for v in seq.weight_versions[start:]],
        top_logprobs=seq.top_logprobs[start:] if seq.request.top_logprobs_num else None,
        finish=finish,
        cached_tokens=seq.cached_tokens,
        spec=seq.spec.as_dict(),
    )


def engine_info(engine: Engine) -> dict:
    return {
        "engine_config": asdict(engine.config),
        "model_path": str(engine.model_path),
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "kv_cache_tokens": engine.pool.num_slots - 1,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weight_version": engine.weight_version,
        "max_running_seqs": engine.config.max_running_seqs,
        "tp_size": engine.config.tp_size,
        "engine_pid": os.getpid(),
    }


# the receiver's calls by control op; under tensor parallelism every rank's receiver takes them
RECEIVER_OPS = {
    "init_weights_update_group": "init_group", "destroy_weights_update_group": "destroy_group",
    "update_weights_from_distributed": "update_from_distributed", "update_weights_from_disk": "update_from_disk",
    "update_weights_from_tensor": "update_from_tensor",
}


def receive_weights(engine: Engine, rx: WeightReceiver, op: str, args: dict) -> Future:
    """A weight op on rank 0's receiver and, once it took it, on every other tensor-parallel rank's
    (`follower_handlers`): each joins the trainer's group at its own rank, receives or reads its
    own copy, and swaps it in when rank 0 does (Engine.update_weights_staged)."""
    mine = args
    if engine.tp is not None and op == "update_weights_from_tensor" and _per_rank(args.get("handles"), engine.tp.size):
        mine = {**args, "handles": args["handles"][0]}  # SGLang's list: one payload per rank
    pending = len(rx.progress())
    fut = getattr(rx, RECEIVER_OPS[op])(**mine)
    if engine.tp is not None and not (fut.done() and fut.exception() is not None):
        if op.startswith("update_weights") and len(rx.progress()) > pending:
            args = {**args, "weight_version": rx.newest_version(), "abort_all_requests": False}  # (rank 0 aborts)
        engine.tp.record("receiver", op, args)
        engine.tp.flush()
    return fut


def follower_handlers(engine: Engine) -> dict:
    """A tensor-parallel rank > 0 of a server (Engine's `tp_hooks`): its own weight receiver."""
    rx = WeightReceiver(engine)
    engine.weights.staged = rx.take_staged

    def receive(op: str, args: dict) -> None:
        rank = engine.tp.rank
        if op == "init_weights_update_group":
            args = {**args, "rank_offset": args["rank_offset"] + rank}
        if op == "update_weights_from_tensor" and _per_rank(args.get("handles"), engine.tp.size):
            args = {**args, "handles": args["handles"][rank]}
        fut = getattr(rx, RECEIVER_OPS[op])(**args)
        fut.add_done_callback(lambda f: f.exception() and log.error("rank %d: %s failed: %s", rank, op, f.exception()))

    return {"receiver": receive}


def _per_rank(handles, ranks: int) -> bool:
    return isinstance(handles, list) and len(handles) == ranks and all(isinstance(h, list) for h in handles)


def restore_weights(engine: Engine, rx: WeightReceiver, restore: dict) -> None:
    """A restarted engine takes the last weights its front end saw loaded from disk (pushed ones died
    with the old process); if they are gone, it serves the model's own, and says so."""
    fut = receive_weights(engine, rx, "update_weights_from_disk",
                          {"model_path": restore["model_path"], "weight_version": restore["weight_version"]})
    while not fut.done():
        rx.at_step_boundary()
        time.sleep(0.01)
    if fut.exception() is not None:
        log.error("could not restore weights %s from %s (%s); serving the model's own weights",
                  restore["weight_version"], restore["model_path"], fut.exception())
    else:
        log.info("restored weights %s from %s", restore["weight_version"], restore["model_path"])


def _rank_died(rank: int) -> None:
    log.error("tensor-parallel rank %d died; the engine exits so that its server restarts the whole group", rank)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rollout.server.engine_loop", description="the engine process of `rollout serve`")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--recv", required=True, help="ZMQ address to pull requests from")
    p.add_argument("--send", required=True, help="ZMQ address to push outputs to")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="info")
    p.add_argument("--restore", default=None,
                   help='weights to load before serving, as JSON {"model_path", "weight_version"} (a restart)')
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [engine] %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(args.recv)
    send = ctx.socket(zmq.PUSH)
    send.setsockopt(zmq.SNDHWM, 0)
    send.setsockopt(zmq.SNDTIMEO, 10_000)  # a send only blocks when the front end is gone: then give up
    send.connect(args.send)
    code = 0
    try:
        engine = Engine(config=EngineConfig.from_dict(json.loads(args.config)),
                        tp_hooks="rollout.server.engine_loop:follower_handlers")
        if engine.tp is not None:  # a rank that dies takes the group down: the front end restarts it whole
            engine.tp.watch(_rank_died)
        freeze_heap()  # this process lives and dies with its engine
        loop = EngineLoop(engine, recv, send, args.parent_pid)
        try:
            if args.restore:
                restore_weights(engine, loop.receiver, json.loads(args.restore))
            info = loop.server_info()
            send.send(protocol.pack(Ready(info)))
            log.info("engine ready: %s on %s, weight version %s", engine.model_path, engine.device, info["weight_version"])
            heartbeat = Heartbeat(loop, ctx, args.send)
            heartbeat.start()
            try:
                loop.run()
            finally:
                heartbeat.stopped.set()
                heartbeat.join(timeout=5)
        finally:
            loop.close()
            engine.close()
        if loop.orphaned and args.recv.startswith("ipc://"):  # nobody else will remove the socket directory
            shutil.rmtree(os.path.dirname(args.recv.removeprefix("ipc://")), ignore_errors=True)
    except (KeyboardInterrupt, SystemExit):
        pass
    except BaseException as e:  # tell the front end why, then die: it fails requests and /health
        log.exception("the engine process failed")
        try:
            send.send(protocol.pack(Fatal(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")))
        except zmq.ZMQError:
            pass
        code = 1
    finally:
        recv.close(linger=0)
        send.close(linger=2000)
        ctx.term()
    sys.exit(code)


if __name__ == "__main__":
    main()
