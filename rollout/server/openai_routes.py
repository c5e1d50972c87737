"""OpenAI's API on the same engine: /v1/completions, /v1/chat/completions, /v1/models.

Requests map onto SamplingParams (`max_tokens` -> `max_new_tokens`, `min_tokens` ->
`min_new_tokens`; the SGLang/vLLM extensions `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `spaces_between_special_tokens`,
`no_stop_trim` are accepted too). OpenAI fields the engine cannot honour are accepted only at
their neutral values (e.g. `echo: false`), so nothing is silently ignored. Logprobs are those
of the distribution each token was drawn from, and so are the `top_logprobs` alternatives
(`logprobs: k` on /v1/completions).

Choices are prompt-major: choice `k * n + i` is sample i of prompt k.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from rollout.config import MAX_TOP_LOGPROBS, SamplingParams
from rollout.server.engine_client import RequestState
from rollout.server.frontend import JSON, Frontend, frontend, sse_response
from rollout.server.guard import (
    ApiError,
    check_fields,
    check_token_ids,
    get_bool,
    is_int,
    parse_sampling_params,
    read_json,
    require_api_key,
)

openai_router = APIRouter(dependencies=[Depends(require_api_key)])

# SamplingParams' fields as OpenAI's routes take them (max_new_tokens is max_tokens, min_new_tokens min_tokens)
SAMPLING = {f.name for f in fields(SamplingParams)} - {"max_new_tokens", "min_new_tokens"} | {"min_tokens"}
COMMON = SAMPLING | {"model", "max_tokens", "stream", "stream_options", "user", "return_hidden_states"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
# SGLang's chat extensions that sglang-router adds to every request: with no reasoning parser here,
# separate_reasoning and stream_reasoning change nothing (as in SGLang without --reasoning-parser)
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls", "continue_final_message", "separate_reasoning",
                        "stream_reasoning"}  # fmt: skip
# accepted only at these values: anything else would change the output in a way the engine does not do
NEUTRAL = {
    "echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},), "return_hidden_states": (False,), "continue_final_message": (False,),
}  # fmt: skip
FLAGS = ("separate_reasoning", "stream_reasoning")
ROLES = {"system", "developer", "user", "assistant", "tool"}


def _check_common(fe: Frontend, body: dict, known: set[str]) -> None:
    check_fields(body, known)
    for name, allowed in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise ApiError(400, f"{name} is not supported by this server (got {body[name]!r}); leave it out", name)
    for name in FLAGS:
        get_bool(body, name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if model is not None and model not in fe.model_names:  # as OpenAI and vLLM answer a model they do not serve
        raise ApiError(404, f"the model {model!r} does not exist here: this server serves {fe.settings.served_model_name!r}",
                       "model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string", "user")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}):
        raise ApiError(400, "stream_options must be an object with at most include_usage", "stream_options")


def _params(body: dict, max_tokens: int) -> SamplingParams:
    raw = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    raw["max_new_tokens"] = max_tokens
    if "min_tokens" in raw:
        raw["min_new_tokens"] = raw.pop("min_tokens")
    rename = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
    return parse_sampling_params(raw, where="", rename=rename).params


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        v = body.get(name)
        if v is not None:
            if not is_int(v) or v < 1:
                raise ApiError(400, f"{name} must be an integer >= 1 (got {v!r})", name)
            return v
    return default


def _room(fe: Frontend, prompts: list[list[int]]) -> int:
    """The most new tokens a sample of every prompt can take, within the context and the KV pool
    (a group's samples need not fit the pool together: rollout.config.request_limit)."""
    kv = fe.engine.info["kv_cache_tokens"]
    return max(1, min(min(fe.max_model_len, kv) - len(p) for p in prompts))


def _finish(state: RequestState, i: int) -> str | None:
    f = state.samples[i].finish
    return None if f is None else f.type


def _usage(states: list[RequestState]) -> dict:
    prompt = sum(st.prompt_tokens for st in states)
    completion = sum(len(s.ids) for st in states for s in st.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_strings(fe: Frontend, ids: list[int]) -> list[str]:
    return fe.tokenizer.batch_decode([[t] for t in ids])


def _completion_logprobs(fe: Frontend, state: RequestState, i: int, start: int, offset: int) -> dict:
    s = state.samples[i]
    tokens = _token_strings(fe, s.ids[start:])
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if state.top_logprobs_num:
        top = [dict(zip(_token_strings(fe, ids), lps)) for ids, lps in s.top[start:]]
    return {"tokens": tokens, "token_logprobs": s.logprobs[start:], "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(fe: Frontend, state: RequestState, i: int, start: int) -> dict:
    s = state.samples[i]
    tokens = _token_strings(fe, s.ids[start:])
    tops = s.top[start:] if state.top_logprobs_num else [([], [])] * len(tokens)

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in zip(_token_strings(fe, ids), lps)]}
            for t, lp, (ids, lps) in zip(tokens, s.logprobs[start:], tops)
        ]
    }


# ---------------- /v1/completions ----------------
async def _completion_prompts(fe: Frontend, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await fe.encode(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return await fe.encode_all(prompt, "prompt")
        if all(isinstance(p, list) for p in prompt):
            return [check_token_ids(p, fe.vocab_size, f"prompt[{k}]") for k, p in enumerate(prompt)]
        return [check_token_ids(prompt, fe.vocab_size, "prompt")]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of such lists", "prompt")


@openai_router.post("/v1/completions")
async def completions(request: Request) -> Response:
    fe = frontend(request)
    body = await read_json(request, fe.settings.max_request_bytes)
    _check_common(fe, body, COMPLETION_FIELDS)
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of")
    logprobs = body.get("logprobs")
    if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", "prompt")
    prompts = await _completion_prompts(fe, body["prompt"])
    params = _params(body, _max_tokens(body, ("max_tokens",), 16))
    stream = get_bool(body, "stream")
    rid = f"cmpl-{uuid.uuid4().hex}"
    states = fe.submit(prompts, params, logprobs is not None, [f"{rid}-{k}" for k in range(len(prompts))], stream,
                       "prompt", "max_tokens", top_logprobs_num=logprobs or 0, n_param="n")
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": fe.settings.served_model_name}
    if stream:
        return _streamed(fe, states, params, head, body, _completion_chunk(fe, states))
    await fe.wait(states, request)
    texts = await fe.texts(states, params)
    choices = [
        {
            "index": k * params.n + i,
            "text": texts[k][i],
            "logprobs": _completion_logprobs(fe, st, i, 0, 0) if logprobs is not None else None,
            "finish_reason": _finish(st, i),
        }
        for k, st in enumerate(states)
        for i in range(st.n)
    ]
    return JSON({**head, "choices": choices, "usage": _usage(states)})


def _completion_chunk(fe, states) -> Callable[[Any], dict]:
    """A streamed completion's choice for one update; logprob text offsets run on per sample."""
    first = {st.rid: k * st.n for k, st in enumerate(states)}
    offset = {(st.rid, i): 0 for st in states for i in range(st.n)}

    def choice(u) -> dict:
        st, i = u.state, u.i
        lp = _completion_logprobs(fe, st, i, u.start, offset[st.rid, i]) if st.return_logprob else None
        offset[st.rid, i] += len(u.text)
        return {"index": first[st.rid] + i, "text": u.text, "logprobs": lp, "finish_reason": _finish(st, i)}

    return choice


def _streamed(fe, states, params, head: dict, body: dict, choice_of: Callable[[Any], dict],
              opening: list[dict] | tuple = ()) -> StreamingResponse:
    """OpenAI's chunks: the `opening` choices, one per update, the usage if `stream_options.include_usage`."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    usage = lambda: [{**head, "choices": [], "usage": _usage(states)}] if include_usage else []  # noqa: E731
    return sse_response(fe, states, params, lambda u: {**head, "choices": [choice_of(u)]},
                        [{**head, "choices": [choice]} for choice in opening], usage)


# ---------------- /v1/chat/completions ----------------
def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for k, m in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", where)
        check_fields(m, {"role", "content", "name"}, where)
        if m.get("role") not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"{where}.content parts must be text parts ({{type: text, text: ...}})", f"{where}.content")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where}.content is not valid Unicode", f"{where}.content") from None
        out.append({"role": m["role"], "content": content})
    return out


@openai_router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    fe = frontend(request)
    body = await read_json(request, fe.settings.max_request_bytes)
    _check_common(fe, body, CHAT_FIELDS)
    logprobs = get_bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if "messages" not in body:
        raise ApiError(400, "messages is required", "messages")
    messages = _messages(body["messages"])
    if not getattr(fe.tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions or /generate", "messages")
    try:
        text = fe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (e.g. roles must alternate)
        raise ApiError(400, f"messages: the chat template refused them: {e}", "messages") from None
    prompt = await fe.encode(text, "messages", add_special_tokens=False)
    params = _params(body, _max_tokens(body, ("max_completion_tokens", "max_tokens"), _room(fe, [prompt])))
    stream = get_bool(body, "stream")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    states = fe.submit([prompt], params, logprobs, [rid], stream, "messages", "max_tokens", top_logprobs_num=top or 0,
                       n_param="n")
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": fe.settings.served_model_name}
    if stream:
        st = states[0]

        def chat_choice(u) -> dict:
            lp = _chat_logprobs(fe, st, u.i, u.start) if st.return_logprob else None
            delta = {"content": u.text} if u.text else {}
            return {"index": u.i, "delta": delta, "logprobs": lp, "finish_reason": _finish(st, u.i)}

        roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(st.n)]
        return _streamed(fe, states, params, {**head, "object": "chat.completion.chunk"}, body, chat_choice, roles)
    await fe.wait(states, request)
    texts = await fe.texts(states, params)
    st = states[0]
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[0][i]},
            "logprobs": _chat_logprobs(fe, st, i, 0) if logprobs else None,
            "finish_reason": _finish(st, i),
        }
        for i in range(st.n)
    ]
    return JSON({**head, "choices": choices, "usage": _usage(states)})


@openai_router.get("/v1/models")
async def models(request: Request) -> Response:
    fe = frontend(request)
    card = {"id": fe.settings.served_model_name, "object": "model", "created": 0, "owned_by": "rollout",
            "root": fe.model_path, "max_model_len": fe.max_model_len}  # fmt: skip
    return JSON({"object": "list", "data": [card]})
