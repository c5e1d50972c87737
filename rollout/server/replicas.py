"""The engine replicas behind one front end (`--dp-size M`), with a prompt kept on one replica.

`Replicas` is what the routes talk to: `submit`, `abort`, `control` and the state `/health` and
`/v1/loads` read, over M `EngineClient`s, each the handle on one engine process with its own
device (replica i's rank r on `cuda:(base_gpu_id + i * tp_size + r)`). With M = 1 it is one engine and nothing else.

Routing keeps a prompt where its KV prefix, its siblings' n-gram index and its earlier rollouts
are: all `n` samples of a request are one engine request, and a prompt's later requests go to
the replica that served it last. A new prompt goes to the one with the fewest samples in flight
(a hash of its token ids picks among equals), so a batch of new prompts splits evenly. Only a
replica that is down, or holds many more samples than the least loaded one (`OVERLOAD_SLACK` of a
replica's rows past twice its load), sends a prompt elsewhere, and the prompt then stays there.

Control calls go to every replica at once: weight updates arrive at all of them (replica i
joins a trainer's group at `rank_offset + i * tp_size`, its tensor-parallel ranks after it, so
one broadcast reaches all), and a call that fails on a replica fails with its dp rank named,
as soon as that replica answers. A replica that dies fails its own requests and is restarted by
its client; the others keep serving. A restarted replica loads the latest weights pushed from
disk, or the initial ones; if a later push came in memory (a broadcast, CUDA IPC), it is stale:
prompts go to the others until the trainer's next push reaches it (`/server_info` says so).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter, OrderedDict
from typing import Any

from rollout.config import EngineConfig, SamplingParams
from rollout.server.engine_client import ControlError, EngineClient, EngineDead, RequestState

OVERLOAD_SLACK = 0.5  # of a replica's max_running_seqs: how far past twice the least load a prompt's home may be
HOMES_KEPT = 1 << 16  # prompts whose replica is remembered (least recently used dropped first)
PER_RANK = {"init_weights_update_group"}  # ops whose arguments differ by replica


class Replicas:
    def __init__(self, config: EngineConfig, log_level: str = "info", restart: bool = True):
        self.config = config
        self.clients = [EngineClient(config.replica(i), log_level, restart, dp_rank=i) for i in range(config.dp_size)]
        self._owner: dict[str, EngineClient] = {}  # rid in flight -> its replica
        self._samples = [0] * config.dp_size  # samples in flight per replica (routing reads it per request)
        self._homes: OrderedDict[bytes, int] = OrderedDict()  # prompt digest -> the replica that served it last

    # ---------------- life cycle ----------------
    def spawn(self) -> None:
        for c in self.clients:
            c.spawn()

    async def start(self) -> dict:
        """Wait until every replica has loaded; returns replica 0's info."""
        try:
            await asyncio.gather(*(c.start() for c in self.clients))
        except BaseException:
            await self.stop()
            raise
        return self.info

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.clients), return_exceptions=True)

    def shutting_down(self) -> None:
        for c in self.clients:
            c.shutting_down()

    def kill_now(self) -> None:
        for c in self.clients:
            c.kill_now()

    # ---------------- state ----------------
    @property
    def info(self) -> dict:
        return self.clients[0].info  # (the replicas serve one model with one configuration)

    @property
    def alive(self) -> bool:
        return any(c.alive for c in self.clients)

    @property
    def dead(self) -> str | None:
        """Why no replica serves (None while one does)."""
        return None if self.alive else self.clients[0].dead

    @property
    def weight_version(self) -> str:
        live = [c for c in self.clients if c.alive]
        return next((c.weight_version for c in live if not c.stale), live[0].weight_version if live else self.clients[0].weight_version)

    @property
    def requests(self) -> dict[str, RequestState]:
        return {rid: c.requests[rid] for rid, c in self._owner.items() if rid in c.requests}

    def counters(self) -> dict:
        each = [c.counters() for c in self.clients]
        out = {k: sum(e[k] for e in each) for k in each[0] if k != "samples_finished_total"}
        out["samples_finished_total"] = dict(sum((Counter(e["samples_finished_total"]) for e in each), Counter()))
        return out

    def describe(self) -> list[dict]:
        """Each replica as /server_info lists it."""
        return [{"dp_rank": c.dp_rank, "alive": c.alive, "device": c.info.get("device"), "engine_pid": c.info.get("engine_pid"),
                 "weight_version": c.weight_version, "stale": c.stale, "restarts": c.restarts,
                 "error": None if c.alive else c.dead}
                for c in self.clients]

    # ---------------- requests ----------------
    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, return_logprob: bool,
               stream: asyncio.Queue | None = None, top_logprobs_num: int = 0) -> RequestState:
        if rid in self._owner:
            raise ValueError(f"rid: request id {rid!r} is already in flight")
        i = self.route(input_ids)
        state = self.clients[i].submit(rid, input_ids, params, return_logprob, stream, top_logprobs_num)
        self._owner[rid] = self.clients[i]
        self._samples[i] += state.n

        def finished(_) -> None:
            self._owner.pop(rid, None)
            self._samples[i] -= state.n

        state.done.add_done_callback(finished)
        return state

    def abort(self, rid: str) -> None:
        client = self._owner.get(rid)
        if client is not None:
            client.abort(rid)

    def route(self, input_ids: list[int]) -> int:
        """The replica for a prompt: where it went last, unless that one is down or overloaded."""
        if len(self.clients) == 1:
            return 0
        alive = [i for i, c in enumerate(self.clients) if c.alive]
        if not alive:
            raise EngineDead(self.dead or "no engine replica is running")
        alive = [i for i in alive if not self.clients[i].stale] or alive  # (all stale: serve as they are)
        key = hashlib.blake2b(repr(input_ids).encode(), digest_size=16).digest()
        samples = self._samples
        least = min(alive, key=lambda i: samples[i])
        home = self._homes.get(key)
        if home is None:  # a new prompt: the least loaded replica (a hash picks among equals)
            equals = [i for i in alive if samples[i] == samples[least]]
            home = equals[int.from_bytes(key[:8], "little") % len(equals)]
        slack = OVERLOAD_SLACK * self.info.get("max_running_seqs", self.config.max_running_seqs)
        if home not in alive or samples[home] > 2 * samples[least] + slack:
            home = least
        self._homes[key] = home
        self._homes.move_to_end(key)
        if len(self._homes) > HOMES_KEPT:
            self._homes.popitem(last=False)
        return home

    # ---------------- control ----------------
    async def control(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """One control call on every replica at once (abort of one request: on its own replica).
        Raises the first failure, its dp rank named once there are several, without waiting for
        the others: a replica that refused a broadcast must not keep the trainer waiting on it."""
        args = args or {}
        if len(self.clients) == 1:
            return await self.clients[0].control(op, args, timeout)
        if op == "abort_request" and not args.get("abort_all"):
            client = self._owner.get(args.get("rid"))
            return await client.control(op, args, timeout) if client else {"aborted": []}
        if op == "get_weight_version":
            return await next((c for c in self.clients if c.alive), self.clients[0]).control(op, args, timeout)
        calls = {asyncio.ensure_future(c.control(op, self._args_for(op, args, i), timeout)): i
                 for i, c in enumerate(self.clients)}
        results: dict[int, Any] = {}
        pending = set(calls)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for fut in done:
                    err = fut.exception()
                    if err is not None:
                        raise _on_rank(err, calls[fut])
                    results[calls[fut]] = fut.result()
        finally:
            for fut in pending:
                fut.cancel()
        return _merge(op, [results[i] for i in range(len(self.clients))])

    def _args_for(self, op: str, args: dict, dp_rank: int) -> dict:
        if op in PER_RANK:  # replica i's tensor-parallel ranks follow replica i - 1's
            return {**args, "rank_offset": args["rank_offset"] + dp_rank * self.config.tp_size}
        return args

    def server_info(self) -> dict:
        """The engines' info as of their latest info messages (rollout.server.protocol ServerInfo), the
        replicas' stats summed: answered by the front end alone, so it is quick whatever the load."""
        alive = [c for c in self.clients if c.alive]
        if not alive:
            raise EngineDead(self.dead or "no engine replica is running")
        if len(self.clients) == 1:
            return alive[0].server_info
        infos = [c.server_info for c in alive]
        return {**infos[0], "stats": summed_stats([i["stats"] for i in infos]), "dp_size": len(self.clients),
                "replicas": self.describe()}

    def stats(self) -> list[dict | None]:
        """Each replica's engine stats as of its latest info message (None for one that is down)."""
        return [c.server_info.get("stats") if c.alive else None for c in self.clients]


def _on_rank(err: BaseException, dp_rank: int) -> BaseException:
    message = f"dp rank {dp_rank}: {err}"
    if isinstance(err, ControlError):
        return ControlError(message, err.status)
    if isinstance(err, EngineDead):
        return EngineDead(message)
    return err


def summed_stats(stats: list[dict]) -> dict:
    """One server's stats from its replicas': counts (integers) summed; rates and other measures
    (floats) the first replica's that has them (each replica's are in /metrics, labelled by dp_rank)."""
    out: dict = {}
    for replica in stats:
        for key, value in replica.items():
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            else:
                out.setdefault(key, value)
    return out


def _merge(op: str, results: list[Any]) -> Any:
    """One answer for the replicas' answers: the aborted rids together, replica 0's otherwise (they
    did the same thing)."""
    if op == "abort_request":
        return {"aborted": [rid for r in results for rid in r.get("aborted", [])]}
    return results[0]
