"""Messages between the HTTP front end and the engine process: msgpack maps, never pickle.

Two ZMQ PUSH/PULL pipes over ipc:// sockets in a private (0700) directory; the front end
binds both, the engine process connects. Every message is a map with a "type".

front end -> engine
    batch     {"type": "batch", "add": [Add, ...], "abort": [rid, ...]}
              everything the front end queued in one event-loop tick; adds before aborts
    ctl       {"type": "ctl", "cid": int, "op": str, "args": {...}}
              a control call; the engine answers with one ctl_reply carrying the same cid
    shutdown  {"type": "shutdown"}

    Add     = {"rid": str, "input_ids": [int], "params": {SamplingParams fields},
               "return_logprob": bool, "top_logprobs_num": int, "stream": bool}

engine -> front end
    ready      {"type": "ready", "info": ServerInfo}     once, after the model has loaded
    out        {"type": "out", "weight_version": str, "reqs": [ReqOut, ...]}
               at most one per engine step, for every request that has something to say;
               weight_version: the engine's current version as reported (a string, as SGLang)
    ctl_reply  {"type": "ctl_reply", "cid": int, "ok": bool, "result": any,
                "error": str | None, "status": int, "weight_version": str, "version": int}
               status: the HTTP status that fits; weight_version: the engine's as the reply leaves
               (a weight update's reply follows its swap: the front end knows the new version
               before its client does)
    info       {"type": "info", "info": ServerInfo}
               the engine's part of /get_server_info and /metrics, which the front end answers
               from the latest one without asking the engine (a step may take seconds): sent
               before every control reply, before the outputs that leave the engine idle, and
               at most every INFO_EVERY_S as the loop goes round
    fatal      {"type": "fatal", "error": str}           the engine loop died; the process exits
    beat       {"type": "beat", "weight_version": str, "version": int, "busy_s": float, "load": Load}
               every HEARTBEAT_S from a thread of its own, during steps too: the front end's
               /health reads how long ago it heard and how long the loop has been busy with
               one step or message (busy_s, 0 while it waits for work); /v1/loads and /get_load
               answer from the latest load, without asking the engine. version: the engine's
               integer weight version, so that a beat sent before a swap and read after the
               swap's reply never takes the front end's version back.

    Load    = {"num_running_reqs", "num_running_seqs", "num_waiting_seqs", "num_waiting_tokens",
               "num_used_tokens", "token_usage", "gen_throughput"}

    ServerInfo = {"engine_config", "model_path", "max_model_len", "vocab_size", "kv_cache_tokens", "device",
                  "dtype", "weight_version", "max_running_seqs", "tp_size", "engine_pid",
                  "weight_sync": {"paused", "held_requests", "updates_in_flight", "last_update", "last_error"},
                  "stats": {the engine's and the weight receiver's rollout/... numbers}}

    ReqOut  = {"rid": str, "error": str, "status": int}  the engine refused (400) or failed (500) the request
            | {"rid": str, "seqs": [SeqOut, ...]}
    SeqOut  = {"i": sample index,
               "ids": [int], "lp": [float] | None, "wv": [str],   new since the last SeqOut
                                                 (wv: each token's weight version, as reported)
               "top": [[[int], [float]], ...] | None              per new token: the most likely
                                                 tokens and their logprobs (top_logprobs_num > 0)
               "finish": None | {"type": "stop" | "length" | "abort", "matched": int | str | None,
                                 "message": str | None},  (message: why the engine aborted it)
               "cached": int,                    prompt tokens taken from the request's prefill
               "spec": {SpecCounters.as_dict()}}        totals so far

Streaming requests get a SeqOut after every step that produced tokens; the others get a
single SeqOut per sample, when the whole request has finished.
"""

from __future__ import annotations

from typing import Any

import msgpack

# message types
BATCH, CTL, SHUTDOWN = "batch", "ctl", "shutdown"
READY, OUT, CTL_REPLY, FATAL, BEAT, INFO = "ready", "out", "ctl_reply", "fatal", "beat", "info"
HEARTBEAT_S = 0.5
INFO_EVERY_S = 0.05  # how stale /get_server_info may be while the engine steps (~0.2 ms to build and send)


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # (logit_bias maps token ids)


def batch(add: list[dict], abort: list[str]) -> dict:
    return {"type": BATCH, "add": add, "abort": abort}


def add_request(rid: str, input_ids: list[int], params: dict, return_logprob: bool, top_logprobs_num: int,
                stream: bool) -> dict:
    return {"rid": rid, "input_ids": input_ids, "params": params, "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num, "stream": stream}


def control(cid: int, op: str, args: dict | None = None) -> dict:
    return {"type": CTL, "cid": cid, "op": op, "args": args or {}}


def control_reply(cid: int, weight_version: str, version: int, result: Any = None, error: str | None = None,
                  status: int = 200) -> dict:
    return {"type": CTL_REPLY, "cid": cid, "ok": error is None, "result": result, "error": error, "status": status,
            "weight_version": weight_version, "version": version}


def ready(info: dict) -> dict:
    return {"type": READY, "info": info}


def output(weight_version: str, reqs: list[dict]) -> dict:
    return {"type": OUT, "weight_version": weight_version, "reqs": reqs}


def info(server_info: dict) -> dict:
    return {"type": INFO, "info": server_info}


def fatal(error: str) -> dict:
    return {"type": FATAL, "error": error}


def beat(weight_version: str, version: int, busy_s: float, load: dict) -> dict:
    return {"type": BEAT, "weight_version": weight_version, "version": version, "busy_s": busy_s, "load": load}


def refused(rid: str, error: str, status: int = 400) -> dict:
    return {"rid": rid, "error": error, "status": status}
