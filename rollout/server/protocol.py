"""Messages between the HTTP front end and the engine process: one dataclass each, sent as msgpack
(never pickle).

Two ZMQ PUSH/PULL pipes over ipc:// sockets in a private (0700) directory; the front end binds
both, the engine process connects. `pack` writes a message as its tag and its fields in order
(nested messages likewise); `unpack` builds the dataclass back from the fields' types. Nothing is
checked twice on the way: a `SamplingParams` the front end validated arrives as that object.

front end -> engine
    RequestBatch  what the front end queued in one event-loop tick: adds, then aborts
    Control       a control call (an op of EngineLoop.handlers); answered by one ControlReply, same cid
    Shutdown

engine -> front end
    Ready         once, after the model has loaded: the engine's server info
    Outputs       at most one per engine step, for every request that has something to say
    ControlReply  the answer to a Control, sent after the call's effect (a weight update's reply
                  follows its swap: the front end knows the new version before its client does)
    Info          the engine's part of /get_server_info and /metrics, which the front end answers
                  from the latest one without asking the engine (a step may take seconds): sent before
                  every control reply, before the outputs that leave the engine idle, and at most every
                  INFO_EVERY_S as the loop goes round
    Beat          every HEARTBEAT_S from a thread of its own, during steps too: /health reads how long
                  ago the front end heard and how long the loop has been busy with one step or message;
                  /v1/loads and /get_load answer from its Load
    Fatal         the engine loop died; the process exits

Streaming requests get a SampleOut after every step that produced tokens; the others get one per
sample, when the whole request has finished.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any

import msgpack

from rollout.config import SamplingParams

HEARTBEAT_S = 0.5
INFO_EVERY_S = 0.05  # how stale /get_server_info may be while the engine steps (~0.2 ms to build and send)


# ---------------- front end -> engine ----------------
@dataclass
class AddRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    top_logprobs_num: int  # the most likely tokens reported with each output token (return_logprob)
    stream: bool


@dataclass
class RequestBatch:
    add: list[AddRequest] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)


@dataclass
class Control:
    cid: int
    op: str
    args: dict


@dataclass
class Shutdown:
    pass


# ---------------- engine -> front end ----------------
@dataclass
class Ready:
    info: dict  # the engine's ServerInfo: engine_config, model_path, max_model_len, vocab_size, kv_cache_tokens,
    # device, dtype, weight_version, max_running_seqs, tp_size, engine_pid, weight_sync, stats


@dataclass
class Finish:
    type: str  # stop | length | abort
    matched: int | str | None = None  # the stop token or string that ended it
    message: str | None = None  # why the engine aborted it (a forward that overflowed)


@dataclass
class SampleOut:
    """New output of one sample since the last SampleOut; `spec`: its speculation totals so far."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # (return_logprob)
    weight_versions: list[str]  # each token's weight version, as reported
    top_logprobs: list | None  # per token: ([ids], [logprobs]) of the most likely tokens (top_logprobs_num > 0)
    finish: Finish | None
    cached_tokens: int  # prompt tokens taken from the request's prefill
    spec: dict  # SpecCounters.as_dict()


@dataclass
class RequestOut:
    """A request's new samples' output, or why the engine refused it (400) or failed it (500)."""

    rid: str
    samples: list[SampleOut] = field(default_factory=list)
    error: str | None = None
    status: int = 200


@dataclass
class Outputs:
    weight_version: str  # the engine's current version, as reported (a string, as SGLang)
    requests: list[RequestOut]


@dataclass
class ControlReply:
    cid: int
    result: Any = None
    error: str | None = None
    status: int = 200  # the HTTP status that fits
    weight_version: str = "0"  # the engine's as the reply leaves
    version: int = 0  # the integer behind it

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Info:
    info: dict  # as Ready's


@dataclass
class Load:
    num_running_reqs: int = 0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_waiting_tokens: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0


@dataclass
class Beat:
    weight_version: str
    version: int  # the integer weight version: a beat sent before a swap, read after its reply, never takes the version back
    busy_s: float  # how long the loop has been busy with its current step or message (0 while it waits)
    load: Load


@dataclass
class Fatal:
    error: str


MESSAGES = (AddRequest, RequestBatch, Control, Shutdown, Ready, Outputs, ControlReply, Info, Beat, Fatal)
_TAGS = {cls: tag for tag, cls in enumerate(MESSAGES)}


def pack(msg) -> bytes:
    """A message as msgpack: [its tag, its fields in order]. TypeError or ValueError for what cannot
    cross (a value msgpack cannot write)."""
    return msgpack.packb([_TAGS[type(msg)], _fields_of(msg)], use_bin_type=True)


def unpack(data: bytes):
    tag, body = msgpack.unpackb(data, raw=False, strict_map_key=False)  # (logit_bias maps token ids)
    return _build(MESSAGES[tag], body)


def _fields_of(obj) -> list:
    return [_encode(getattr(obj, f.name)) for f in fields(obj)]


def _encode(v):
    if is_dataclass(v):
        return _fields_of(v)
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    return v


@cache
def _hints(cls) -> list[tuple[str, Any]]:
    types = typing.get_type_hints(cls)
    return [(f.name, types[f.name]) for f in fields(cls)]


def _build(cls, values: list):
    """`cls` from its fields' values, without __init__ or __post_init__ (each was checked where it was made)."""
    obj = object.__new__(cls)
    for (name, hint), v in zip(_hints(cls), values):
        object.__setattr__(obj, name, _decode(hint, v))
    return obj


def _decode(hint, v):
    if v is None:
        return None
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":  # X | None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if isinstance(hint, type) and is_dataclass(hint):
        return _build(hint, v)
    if typing.get_origin(hint) is list and args and isinstance(args[0], type) and is_dataclass(args[0]):
        return [_build(args[0], x) for x in v]
    return v
