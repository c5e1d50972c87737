"""The front end's shared core: tokenize, submit to the engine, wait or stream, detokenize.

Both APIs (SGLang's native in rollout.server.app, OpenAI's in rollout.server.openai_routes) sit on
`Frontend`: `submit` checks lengths and hands token ids to the engine replicas; `wait`
returns when every request is done (aborting them if the HTTP client hangs up);
`updates` yields a streaming request's progress with text deltas; `texts` decodes
finished outputs in one batch.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.config import SamplingParams, request_limit
from rollout.engine.detokenizer import StreamDetokenizer, trim_at_stop
from rollout.server.engine_client import (
    EngineDead,
    EngineRefused,
    RequestState,
)
from rollout.server.guard import ApiError, check_text, error_body
from rollout.server.replicas import Replicas

DEFAULT_PORT = 30000
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    admin_key: str | None = None
    served_model_name: str = "default"
    default_model: bool = False  # it serves `--model default`
    max_request_bytes: int = 64 << 20
    incremental_streaming_output: bool = False  # SGLang's default: stream chunks carry everything so far
    health_timeout: float = 20.0  # /health fails when the engine loop has not answered for this long
    log_level: str = "info"
    access_log: bool = False

    def public(self) -> dict:
        """For /get_server_info: never the keys themselves."""
        d = asdict(self)
        d["api_key"] = self.api_key is not None
        d["admin_key"] = self.admin_key is not None
        return d


class JSON(JSONResponse):
    """JSON that survives a -inf logprob (as -Infinity, which Python and JS parsers read)."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=True, separators=(",", ":"))
        return text.encode("utf-8", errors="replace")  # (an error message may quote a client's lone surrogate)


class ClientGone(Exception):
    """The HTTP client disconnected before its result was ready; its requests were aborted."""


@dataclass
class Update:
    """New output of one sample: tokens `state.samples[i].ids[start:]`, their text, and whether it finished."""

    state: RequestState
    i: int
    start: int
    text: str
    finished: bool


class Frontend:
    """What the routes share: the engine client, the tokenizer, the settings.

    Tokenizing and detokenizing whole prompts and outputs runs in one worker thread (one, as a
    tokenizer is not safe to share between threads): the event loop stays free to answer
    `/health` and to stream while a large request is being tokenized."""

    def __init__(self, engine: Replicas, tokenizer, settings: ServerSettings, model_path: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.model_path = model_path
        self.healthy = True  # what /health answered last (the server's log says when that changes)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))

    @property
    def model_names(self) -> set[str]:
        """What a request's `model` may say: the served name (/v1/models), the model's path, or
        `default` on the default model."""
        names = {self.settings.served_model_name, self.model_path}
        return names | ({"default"} if self.settings.default_model else set())

    @property
    def max_model_len(self) -> int:
        return self.engine.info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self.engine.info["vocab_size"]

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_all([text], param, add_special_tokens, single=True))[0]

    async def encode_all(self, texts: list, param: str, add_special_tokens: bool = True,
                         single: bool = False) -> list[list[int]]:
        """Token ids of each text (`param[k]` in messages, or `param` alone when `single`)."""
        names = [param] if single else [f"{param}[{k}]" for k in range(len(texts))]
        for t, name in zip(texts, names):
            check_text(t, name)
        encoded = await self._in_thread(self.tokenizer, texts, add_special_tokens=add_special_tokens)
        ids = encoded["input_ids"]
        for i, name in zip(ids, names):
            if not i:
                raise ApiError(400, f"{name}: the prompt is empty after tokenization", name)
        return ids

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        return_logprob: bool,
        rids: list[str] | None = None,
        stream: bool = False,
        prompt_param: str = "input_ids",
        tokens_param: str = "sampling_params.max_new_tokens",
        top_logprobs_num: int = 0,
        n_param: str = "sampling_params.n",
    ) -> list[RequestState]:
        """Check what the engine can never run, then queue one engine request per prompt (n samples each)."""
        kv_tokens = self.engine.info["kv_cache_tokens"]
        max_seqs = self.engine.info["max_running_seqs"]
        for k, ids in enumerate(prompts):
            broken = request_limit(len(ids), params, self.max_model_len, max_seqs, kv_tokens)
            if broken is not None:
                which, why = broken
                param = {"n": n_param, "max_new_tokens": tokens_param}.get(which) or (
                    prompt_param if len(prompts) == 1 else f"{prompt_param}[{k}]")
                raise ApiError(400, f"{param}: {why}", param)
        queue = asyncio.Queue() if stream else None
        states: list[RequestState] = []
        try:
            for k, ids in enumerate(prompts):
                rid = rids[k] if rids else uuid.uuid4().hex
                states.append(self.engine.submit(rid, ids, params, return_logprob, queue, top_logprobs_num))
        except ValueError as e:  # a rid already in flight
            self.abort(states)
            raise ApiError(400, str(e), "rid") from None
        return states

    def abort(self, states: list[RequestState]) -> None:
        for s in states:
            if not s.finished:
                self.engine.abort(s.rid)

    async def wait(self, states: list[RequestState], request: Request) -> None:
        """Until every state is done; aborts them all if the client leaves or one fails."""
        all_done = _all_done([s.done for s in states])
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({all_done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not all_done.done():
            self.abort(states)
            raise ClientGone()
        if all_done.exception() is not None:
            self.abort(states)
            raise all_done.exception()

    async def updates(self, states: list[RequestState], params: SamplingParams) -> AsyncIterator[Update]:
        """A streaming request's progress, one `Update` per sample per engine step.

        Raises what failed the request (EngineDead, EngineRefused). Closing the iterator
        early (the client left) aborts whatever is unfinished, freeing the engine's KV.
        """
        queue = states[0].stream
        detok = {(st.rid, i): StreamDetokenizer(self.tokenizer, params) for st in states for i in range(st.n)}
        sent = dict.fromkeys(detok, 0)  # tokens already reported per sample; -1 once its finish is reported
        left = len(detok)
        try:
            while left:
                st, i = await queue.get()
                if i is None:
                    raise st.done.exception()
                key, s = (st.rid, i), st.samples[i]
                start = sent[key]
                if start < 0 or (start == len(s.ids) and s.finish is None):
                    continue
                finished = s.finish is not None
                sent[key] = -1 if finished else len(s.ids)
                left -= finished
                yield Update(st, i, start, detok[key].update(s.ids, s.finish), finished)
        finally:
            self.abort(states)

    async def texts(self, states: list[RequestState], params: SamplingParams) -> list[list[str]]:
        """Final texts, [request][sample], decoded in one batch."""
        flat = [s for st in states for s in st.samples]
        decoded = await self._in_thread(
            self.tokenizer.batch_decode, [s.ids for s in flat], skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        out, k = [], 0
        for st in states:
            out.append([trim_at_stop(decoded[k + i], flat[k + i].finish.matched, params)
                        for i in range(st.n)])
            k += st.n
        return out


def _all_done(futures: list[asyncio.Future]) -> asyncio.Future:
    """One future for many: result None when all succeed, the first exception otherwise."""
    out = asyncio.get_running_loop().create_future()
    left = [len(futures)]

    def on_done(f: asyncio.Future) -> None:
        if out.done():
            return
        if not f.cancelled() and f.exception() is not None:
            out.set_exception(f.exception())
            return
        left[0] -= 1
        if left[0] == 0:
            out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(on_done)
    return out


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(fe: Frontend, states: list[RequestState], params: SamplingParams, chunk_of: Callable[[Any], Any],
                 opening: Iterable[Any] = (), closing: Callable[[], Iterable[Any]] = tuple) -> StreamingResponse:
    """A streamed answer: the `opening` chunks, `chunk_of(update)` for each of the requests' updates
    (None: nothing for that one), then the `closing()` chunks and [DONE]; an engine that dies or
    refuses ends the stream with an error chunk, then [DONE] (OpenAI clients read until it)."""

    async def events() -> AsyncIterator[str]:
        for chunk in opening:
            yield sse_event(chunk)
        try:
            async with aclosing(fe.updates(states, params)) as updates:
                async for u in updates:
                    chunk = chunk_of(u)
                    if chunk is not None:
                        yield sse_event(chunk)
        except (EngineDead, EngineRefused) as e:
            yield sse_event(error_body(getattr(e, "status", 503), str(e)))
        else:
            for chunk in closing():
                yield sse_event(chunk)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
