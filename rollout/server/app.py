"""`rollout serve`: the HTTP front end (FastAPI + uvicorn) in this process, the engine in another.

A request's path: a route parses and checks the JSON (rollout.server.guard), tokenizes,
and `Frontend.submit` hands token ids to `Replicas` (rollout.server.replicas), which picks the
engine replica and its `EngineClient` (rollout.server.engine_client) ships them to that engine
process over ZMQ. Results come back as token ids; the route
detokenizes and answers in SGLang's native shape (here) or OpenAI's (rollout.server.openai_routes).

Routes here: /generate, /abort_request, /health, /get_model_info, /get_server_info, /metrics;
the shared core (Frontend) is rollout.server.frontend.
Weight and pause routes are an APIRouter of their own (rollout.server.weight_routes), included in
`create_app` behind `require_admin`, talking to the engine through
`Frontend.engine.control(op, args)`; the engine side is rollout.server.engine_loop.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.config import MAX_TOP_LOGPROBS, EngineConfig, SamplingParams
from rollout.server.engine_client import (
    ControlError,
    EngineClient,
    EngineDead,
    EngineRefused,
    RequestState,
)
from rollout.server.replicas import Replicas
from rollout.server.frontend import (
    DEFAULT_PORT,
    JSON,
    ClientGone,
    Frontend,
    ServerSettings,
    frontend,
    sse_response,
)
from rollout.server.guard import (
    ApiError,
    Keys,
    check_fields,
    check_token_ids,
    error_body,
    get_bool,
    is_int,
    is_unicode,
    parse_sampling_params,
    read_json,
    require_admin,
    require_api_key,
)

log = logging.getLogger("rollout.server")


# ---------------- SGLang's native API ----------------
native = APIRouter()

GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "return_logprob", "stream", "rid",
    "top_logprobs_num", "return_text_in_logprobs", "logprob_start_len",
})  # fmt: skip
# SGLang's /generate fields that shape its logs, metrics or scheduling order and never the tokens: any
# value of the right type passes (sglang-router sends model, log_metrics and no_logs with every request)
PASSIVE_GENERATE = {
    "model": (lambda v: isinstance(v, str), "a string"), "log_metrics": (lambda v: isinstance(v, bool), "true or false"),
    "no_logs": (lambda v: isinstance(v, bool), "true or false"), "conversation_id": (lambda v: isinstance(v, str), "a string"),
    "priority": (is_int, "an integer"), "custom_labels": (lambda v: isinstance(v, dict), "an object"),
    "extra_key": (lambda v: isinstance(v, str), "a string"),
}  # fmt: skip
# SGLang's other /generate fields: what they ask for is not done here, so only their neutral value passes.
NEUTRAL_GENERATE = {
    "image_data": "images", "video_data": "video", "audio_data": "audio", "input_embeds": "input embeddings",
    "lora_path": "LoRA adapters", "lora_id": "LoRA adapters", "custom_logit_processor": "custom logit processors",
    "return_hidden_states": "hidden states", "return_routed_experts": "routed experts", "return_entropy": "entropies",
    "token_ids_logprob": "logprobs of chosen token ids", "session_params": "sessions", "modalities": "modalities",
    "data_parallel_rank": "data-parallel ranks", "bootstrap_host": "disaggregated prefill",
    "bootstrap_port": "disaggregated prefill", "bootstrap_room": "disaggregated prefill",
    "bootstrap_pair_key": "disaggregated prefill", "background": "background requests", "return_bytes": "byte outputs",
}  # fmt: skip


def check_passive(body: dict) -> None:
    for name, (ok, what) in PASSIVE_GENERATE.items():
        if body.get(name) is not None and not ok(body[name]):
            raise ApiError(400, f"{name} must be {what} (got {body[name]!r})", name)


def check_neutral(body: dict, neutral: dict[str, str]) -> None:
    for name, what in neutral.items():
        v = body.get(name)
        if v is not None and v is not False and v != [] and not (name == "data_parallel_rank" and v == 0):
            raise ApiError(400, f"{name} is not supported: this server has no {what}; leave it out or null", name)


async def parse_prompts(body: dict, fe: Frontend) -> tuple[list[list[int]], bool, str]:
    """Token ids per prompt, whether the request was a single prompt, and the field they came from."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "send exactly one of text (string or list of strings) or input_ids (list, or list of lists)", "text")
    if text is not None:
        if isinstance(text, str):
            return [await fe.encode(text, "text")], True, "text"
        if isinstance(text, list) and text:
            return await fe.encode_all(text, "text"), False, "text"
        raise ApiError(400, "text must be a non-empty string or a non-empty list of strings", "text")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return [check_token_ids(x, fe.vocab_size, f"input_ids[{k}]") for k, x in enumerate(ids)], False, "input_ids"
    return [check_token_ids(ids, fe.vocab_size, "input_ids")], True, "input_ids"


def parse_rids(raw: Any, num_prompts: int, single: bool) -> list[str] | None:
    if raw is None:
        return None
    rids = [raw] if single and isinstance(raw, str) else raw
    ok = isinstance(rids, list) and len(rids) == num_prompts
    if not ok or not all(isinstance(r, str) and r and len(r) <= 512 and is_unicode(r) for r in rids):
        want = "a non-empty string" if single else f"a list of {num_prompts} non-empty strings, one per prompt"
        raise ApiError(400, f"rid must be {want} (valid Unicode, at most 512 characters)", "rid")
    if len(set(rids)) != len(rids):
        raise ApiError(400, "rid: request ids in one batch must differ", "rid")
    return rids


def parse_top_logprobs(body: dict) -> int:
    k = body.get("top_logprobs_num")
    if k is None:
        return 0
    if not (is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}] (got {k!r})", "top_logprobs_num")
    return k


def finish_reason(s, max_new_tokens: int) -> dict | None:
    """SGLang's finish_reason object: type, matched (stop) and message; length also says the limit."""
    if s.finish is None:
        return None
    kind = s.finish.type
    if kind == "stop":
        return {"type": "stop", "matched": s.finish.matched, "message": None}
    if kind == "length":
        return {"type": "length", "length": max_new_tokens, "matched": None, "message": None}
    # SGLang's words for a request stopped before it produced anything (AReaL resubmits those)
    message = s.finish.message or ("Abort before prefill" if not s.ids else "aborted")
    return {"type": "abort", "matched": None, "message": message}


def meta_info(state: RequestState, i: int, start: int = 0, token_text=None) -> dict:
    """SGLang's meta_info for sample i; per-token lists from token `start` on. `token_text`: the
    text of a token id, for logprob entries (return_text_in_logprobs)."""
    s = state.samples[i]
    spec = s.spec
    verify = spec.get("verify_steps", 0)
    meta = {
        "id": state.rid,
        "finish_reason": finish_reason(s, state.max_new_tokens),
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": len(s.ids),
        "cached_tokens": s.cached_tokens,
        "weight_version": s.weight_version,
        "output_token_weight_versions": s.versions[start:],
        "spec_verify_ct": verify,
        "spec_accept_token_num": spec.get("accepted_tokens", 0),
        "spec_draft_token_num": spec.get("draft_tokens", 0),
        "spec_accept_length": len(s.ids) / verify if verify else 0.0,
        # by drafter (ngram, coupled, eagle, mtp): {"draft_tokens", "accepted_tokens"}, beyond SGLang's counters
        "spec_by_source": spec.get("by_source", {}),
    }
    if state.return_logprob:
        text = token_text or (lambda t: None)
        meta["output_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(s.logprobs[start:], s.ids[start:])]
        if state.top_logprobs_num:
            meta["output_top_logprobs"] = [[[lp, t, text(t)] for t, lp in zip(ids, lps)] for ids, lps in s.top[start:]]
    return meta


@native.post("/generate", dependencies=[Depends(require_api_key)])
async def generate(request: Request) -> Response:
    fe = frontend(request)
    body = await read_json(request, fe.settings.max_request_bytes)
    check_fields(body, GENERATE_FIELDS | set(NEUTRAL_GENERATE) | set(PASSIVE_GENERATE))
    check_neutral(body, NEUTRAL_GENERATE)
    check_passive(body)
    if body.get("logprob_start_len") not in (None, -1):
        raise ApiError(400, "logprob_start_len: prompt logprobs are not computed here; leave it out or -1", "logprob_start_len")
    sampling = parse_sampling_params(body.get("sampling_params"))
    params = sampling.params
    return_logprob = get_bool(body, "return_logprob")
    stream = get_bool(body, "stream")
    top = parse_top_logprobs(body) if return_logprob else 0
    token_text = fe.token_text if get_bool(body, "return_text_in_logprobs") else None
    prompts, single, prompt_param = await parse_prompts(body, fe)
    rids = parse_rids(body.get("rid"), len(prompts), single)
    states = fe.submit(prompts, params, return_logprob, rids, stream, prompt_param, top_logprobs_num=top)
    if stream:
        return sse_response(fe, states, params, _generate_chunk(fe, states, sampling.stream_interval, token_text))
    await fe.wait(states, request)
    texts = await fe.texts(states, params)
    results = [
        {"text": texts[k][i], "output_ids": st.samples[i].ids, "meta_info": meta_info(st, i, token_text=token_text)}
        for k, st in enumerate(states)
        for i in range(st.n)
    ]
    return JSON(results[0] if single and params.n == 1 else results)


def _generate_chunk(fe: Frontend, states: list[RequestState], interval: int, token_text) -> Callable[[Any], dict | None]:
    """A streamed /generate chunk for an update: at most one per `interval` new tokens of a sample
    (and its last); `index` is the sample's place in the flat (prompt-major) result list."""
    first = {st.rid: k * st.n for k, st in enumerate(states)}
    text = {(st.rid, i): "" for st in states for i in range(st.n)}
    sent = dict.fromkeys(text, 0)  # tokens covered by the chunks sent so far

    def chunk_of(u) -> dict | None:
        st, i = u.state, u.i
        key, s = (st.rid, i), st.samples[i]
        text[key] += u.text
        if not u.finished and len(s.ids) - sent[key] < interval:
            return None
        start, sent[key] = sent[key], len(s.ids)
        if fe.settings.incremental_streaming_output:
            chunk = {"text": text[key], "output_ids": s.ids[start:], "meta_info": meta_info(st, i, start, token_text)}
            text[key] = ""
        else:
            chunk = {"text": text[key], "output_ids": s.ids, "meta_info": meta_info(st, i, token_text=token_text)}
        return {**chunk, "index": first[st.rid] + i}

    return chunk_of


@native.post("/abort_request", dependencies=[Depends(require_admin)])
async def abort_request(request: Request) -> Response:
    fe = frontend(request)
    body = await read_json(request, fe.settings.max_request_bytes)
    check_fields(body, {"rid", "abort_all"})
    abort_all = get_bool(body, "abort_all")
    rid = body.get("rid")
    if not abort_all and not (isinstance(rid, str) and rid):
        raise ApiError(400, "rid must be a non-empty string (or send abort_all: true)", "rid")
    result = await fe.engine.control("abort_request", {"rid": rid, "abort_all": abort_all})
    return JSON(result)


@native.get("/health")
async def health(request: Request) -> Response:
    """200 while an engine process is up, has been heard from lately (it beats from a thread of
    its own, during steps too) and is not stuck: no step or message has held its loop for longer
    than --health-timeout. 503 when no replica is so. Answered by the front end alone, so it is
    quick whatever the load."""
    fe = frontend(request)
    clients = fe.engine.clients
    why = [unhealthy(c, "the engine process" if len(clients) == 1 else f"engine process {c.dp_rank}",
                     fe.settings.health_timeout) for c in clients]
    if all(why):
        message = "; ".join(why) if len(why) > 1 else why[0]
        if fe.healthy:  # (the log says when it turns, not at every probe)
            log.warning("/health answers 503: %s", message)
        fe.healthy = False
        return JSON(error_body(503, message), status_code=503)
    if not fe.healthy:
        log.warning("/health answers 200 again")
    fe.healthy = True
    return JSON({"status": "ok", "weight_version": fe.engine.weight_version})


def unhealthy(eng: EngineClient, name: str, limit: float) -> str | None:
    """Why one engine process does not serve now (None: it does)."""
    if not eng.alive:
        return eng.dead or f"{name} is not running"
    if eng.silent_for() > limit:
        return f"{name} has not answered for {eng.silent_for():.0f} s (--health-timeout)"
    if eng.stuck_for() > limit:
        return f"{name}'s loop has been busy with one step for {eng.stuck_for():.0f} s (--health-timeout)"
    return None


@native.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation went through the engine (SGLang's deeper probe)."""
    fe = frontend(request)
    probe = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        states = fe.submit([[0]], probe, False)
        await asyncio.wait_for(fe.wait(states, request), fe.settings.health_timeout)
    except (EngineDead, EngineRefused, asyncio.TimeoutError) as e:
        return JSON(error_body(503, f"a one-token generation failed: {e or 'timed out'}"), status_code=503)
    return JSON({"status": "ok", "weight_version": fe.engine.weight_version})


def engine_loads(fe: Frontend) -> list[dict]:
    """Each replica's load in SGLang's /v1/loads shape: its numbers as of its latest beat (every
    protocol.HEARTBEAT_S), the requests in flight as the front end counts them. Answered by the
    front end alone, so a router's or trainer's poll never waits on a step."""
    out = []
    for eng in fe.engine.clients:
        load = eng.load
        total = len(eng.requests)
        running = min(total, load.num_running_reqs)
        out.append({
            "dp_rank": eng.dp_rank, "num_running_reqs": running, "num_waiting_reqs": total - running,
            "num_total_reqs": total, "num_used_tokens": load.num_used_tokens,
            "num_waiting_tokens": load.num_waiting_tokens,
            "max_total_num_tokens": eng.info.get("kv_cache_tokens", 0), "token_usage": load.token_usage,
            "gen_throughput": load.gen_throughput,
        })  # fmt: skip
    return out


@native.get("/v1/loads", dependencies=[Depends(require_api_key)])
async def loads(request: Request) -> Response:
    """SGLang's load report, one entry per replica (slime polls it until no request is left)."""
    each = engine_loads(frontend(request))
    return JSON({"timestamp": time.time(), "dp_rank_count": len(each), "loads": each})


@native.get("/get_load", dependencies=[Depends(require_api_key)])
async def get_load(request: Request) -> Response:
    """SGLang's load, which sglang-router's power_of_two policy compares: tokens held in the KV caches
    or waiting to be prefilled."""
    return JSON({"load": sum(x["num_used_tokens"] + x["num_waiting_tokens"] for x in engine_loads(frontend(request)))})


@native.get("/get_model_info", dependencies=[Depends(require_api_key)])
@native.get("/model_info", dependencies=[Depends(require_api_key)])  # (SGLang's newer name; sglang-router asks it)
async def get_model_info(request: Request) -> Response:
    fe = frontend(request)
    return JSON(
        {
            "model_path": fe.model_path,
            "tokenizer_path": fe.model_path,
            "served_model_name": fe.settings.served_model_name,
            "is_generation": True,
            "max_model_len": fe.max_model_len,
            "vocab_size": fe.vocab_size,
        }
    )


@native.get("/get_server_info", dependencies=[Depends(require_api_key)])
@native.get("/server_info", dependencies=[Depends(require_api_key)])  # (SGLang's newer name; sglang-router asks it)
async def get_server_info(request: Request) -> Response:
    fe = frontend(request)
    return JSON({**fe.settings.public(), **fe.engine.server_info(), "frontend": fe.engine.counters()})


@native.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(request: Request) -> Response:
    fe = frontend(request)
    stats = fe.engine.stats()
    return PlainTextResponse(render_metrics(stats, fe.engine), media_type="text/plain; version=0.0.4; charset=utf-8")


def render_metrics(stats: list[dict | None], engine: Replicas) -> str:
    """Prometheus text: engine stats as gauges (`rollout/x` -> `rollout_x`, `rollout/x/ngram` ->
    `rollout_x_by_source{source="ngram"}`), then the front end's counters; each with the label
    `dp_rank` when there are several replicas."""
    several = len(engine.clients) > 1
    samples: dict[str, list[tuple[str, float]]] = {}
    for dp_rank, replica_stats in enumerate(stats):
        dp = [f'dp_rank="{dp_rank}"'] if several else []
        for key, value in (replica_stats or {}).items():
            if not isinstance(value, (int, float)):
                continue
            parts = key.split("/")
            source = [f'source="{parts[2]}"'] if len(parts) == 3 else []
            name = re.sub(r"[^a-zA-Z0-9_:]", "_", "_".join(parts[:2])) + ("_by_source" if source else "")
            samples.setdefault(name, []).append((_labels(source + dp), value))
    lines = []
    for name in sorted(samples):
        lines.append(f"# TYPE {name} gauge")
        lines += [f"{name}{labels} {float(v)!r}" for labels, v in samples[name]]
    counters = [
        ("rollout_requests_total", "requests (prompts) received", "requests_total"),
        ("rollout_prompt_tokens_total", "prompt tokens received", "prompt_tokens_total"),
        ("rollout_generation_tokens_total", "tokens generated", "generation_tokens_total"),
        ("rollout_samples_finished_total", "samples finished, by reason", "samples_finished_total"),
        ("rollout_engine_restarts_total", "engine processes started again after one died", "engine_restarts_total"),
    ]
    per_replica = [(c.counters(), [f'dp_rank="{c.dp_rank}"'] if several else []) for c in engine.clients]
    for name, help_, key in counters:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
        for c, dp in per_replica:
            if key == "samples_finished_total":
                for reason, v in sorted(c[key].items()):
                    by_reason = f'finish_reason="{reason}"'
                    lines.append(f"{name}{_labels([by_reason] + dp)} {v}")
            else:
                lines.append(f"{name}{_labels(dp)} {c[key]}")
    gauges = [
        ("rollout_requests_in_flight", "requests submitted and not finished", len(engine.requests)),
        ("rollout_queue_depth", "sequences waiting for prefill in the engines",
         sum((r or {}).get("rollout/num_waiting", 0) for r in stats)),
        ("rollout_engine_up", "engine processes alive", sum(c.alive for c in engine.clients)),
    ]
    for name, help_, v in gauges:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {v}"]
    return "\n".join(lines) + "\n"


def _labels(labels: list[str]) -> str:
    return "{" + ",".join(labels) + "}" if labels else ""


# ---------------- the app ----------------
def create_app(engine: Replicas, settings: ServerSettings, tokenizer) -> FastAPI:
    """The ASGI app; its lifespan waits for the engine processes (spawning them if needed) and stops them."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        info = await engine.start()
        log.info("engine ready (pid %d): %s, context %d", info["engine_pid"], info["model_path"], info["max_model_len"])
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="rollout", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = Frontend(engine, tokenizer, settings, engine.config.model)
    app.state.keys = Keys(settings.api_key, settings.admin_key)
    _add_error_handlers(app)

    from rollout.server.openai_routes import openai_router
    from rollout.server.weight_routes import router as weight_router

    app.include_router(native)
    app.include_router(openai_router)
    app.include_router(weight_router, dependencies=[Depends(require_admin)])  # weight updates and pauses
    return app


def _add_error_handlers(app: FastAPI) -> None:
    def handler(status: int | None, log_it: bool = False):
        async def handle(request: Request, exc: Exception) -> Response:
            code = status or getattr(exc, "status", 500)
            if log_it:
                log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            return JSON(error_body(code, message, getattr(exc, "param", None)), status_code=code)

        return handle

    app.add_exception_handler(ApiError, handler(None))
    app.add_exception_handler(EngineRefused, handler(None))
    app.add_exception_handler(EngineDead, handler(503))
    app.add_exception_handler(ControlError, handler(None))
    app.add_exception_handler(asyncio.TimeoutError, handler(504))
    app.add_exception_handler(ClientGone, handler(499))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return JSON(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, handler(500, log_it=True))


# ---------------- the command ----------------
def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the SGLang-native and OpenAI HTTP APIs")
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    h.add_argument("--port", type=int, default=DEFAULT_PORT)
    h.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"),
                   help="key for generation routes (default: $ROLLOUT_API_KEY; none = open)")
    h.add_argument("--admin-key", default=os.environ.get("ROLLOUT_ADMIN_KEY"),
                   help="key for weight and control routes (default: $ROLLOUT_ADMIN_KEY; none = loopback clients "
                        "only, and then --host must be a loopback address)")
    h.add_argument("--served-model-name", default=None, help="the model name /v1/models reports")
    h.add_argument("--max-request-bytes", type=int, default=ServerSettings.max_request_bytes)
    h.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate stream chunks carry only what is new (default: everything so far, as SGLang)")
    h.add_argument("--health-timeout", type=float, default=ServerSettings.health_timeout,
                   help="seconds /health waits for the engine to answer before reporting 503")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    h.add_argument("--access-log", action="store_true", help="log every HTTP request")
    EngineConfig.add_args(p)
    p.set_defaults(func=cmd_serve)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> None:
    from rollout.models.default_model import resolve_model_path

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [server] %(levelname)s %(message)s")
    config = EngineConfig.from_args(args)
    model_path = resolve_model_path(config.model)  # the default model is fetched and converted once, here
    config.model = str(model_path)
    name = args.served_model_name or (
        "SmolLM2-135M-Instruct" if args.model == "default" else Path(args.model.rstrip("/")).name
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        served_model_name=name,
        default_model=args.model == "default",
        max_request_bytes=args.max_request_bytes,
        incremental_streaming_output=args.incremental_streaming_output,
        health_timeout=args.health_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    if not _is_loopback_host(args.host):
        if settings.admin_key is None:  # a weight push rewrites the model: never open to the network
            sys.exit(f"rollout serve: --host {args.host} is reachable from the network, so the weight and control "
                     "routes need --admin-key (or $ROLLOUT_ADMIN_KEY); or serve on 127.0.0.1")
        if settings.api_key is None:
            log.warning("serving on %s without --api-key: anyone who reaches this port can generate", args.host)
    log.info("starting %s for %s", "the engine process" if config.dp_size == 1 else f"{config.dp_size} engine processes",
             model_path)
    engine = Replicas(config, settings.log_level)
    engine.spawn()  # loads the model while this process loads the tokenizer
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        app = create_app(engine, settings, tokenizer)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=5,
            proxy_headers=False,  # the client's address is the TCP peer's, never a header's (guard.require_admin)
        )
        _StoppingServer(config, engine).run()
    finally:
        engine.kill_now()


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C first fails the requests in flight with a JSON 503
    ("the server is shutting down"), so that no client waits out the graceful period for a 500."""

    def __init__(self, config: uvicorn.Config, engine: Replicas):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.shutting_down()
        super().handle_exit(sig, frame)


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
