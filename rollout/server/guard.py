"""What stands between untrusted HTTP and the engine: keys, size limits, JSON, field checks.

Every refusal is an `ApiError`, answered as `{"error": {"message", "type", "param", "code"}}`
(OpenAI's shape, so the `openai` client shows the message) with a 4xx status; the message
names the offending field. Nothing here evaluates or unpickles client data: bodies are
parsed with `json` only.

Keys (`Authorization: Bearer <key>`, compared in constant time):
  `require_api_key`  generation and read-only routes; accepts the API key or the admin key.
  `require_admin`    control and weight routes. With `--admin-key` they need that key; without
                     it they answer only clients on the loopback interface that came through
                     no proxy (a weight push rewrites the model: never open to the network).
                     "Local" is the TCP peer's address (uvicorn runs without proxy-header
                     trust) and a request carrying any header a proxy adds (`is_proxy_header`:
                     Forwarded, Via, X-Forwarded-*, X-Real-IP, True-Client-IP, ...) is never local. A
                     proxy that adds no header (ssh -L, socat, a port-forward) cannot be told
                     from a local client: serve behind one only with --admin-key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any

from fastapi import Request

from rollout.config import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
            413: "request_too_large", 503: "service_unavailable", 504: "timeout_error"}.get(status)  # fmt: skip
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---------------- keys ----------------
@dataclass(frozen=True)
class Keys:
    api_key: str | None = None
    admin_key: str | None = None


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, key: str | None) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


# Header names proxies add to say whom they forward for, or that they did (lower case, `_` read as `-`).
_PROXY_HEADER = re.compile(r"forwarded|client-?ip|connecting-ip|real-ip|remote-(ip|addr)|originating-ip|^via$|^x-proxy")


def is_proxy_header(name: str) -> bool:
    return _PROXY_HEADER.search(name.lower().replace("_", "-")) is not None


def _is_loopback(request: Request) -> bool:
    if any(is_proxy_header(h) for h in request.headers.keys()):  # it came through a proxy: from anywhere
        return False
    if request.client is None:  # a Unix socket: local by construction
        return True
    host = request.client.host.removeprefix("::ffff:")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def require_api_key(request: Request) -> None:
    keys: Keys = request.app.state.keys
    if keys.api_key is None:
        return
    token = _bearer(request)
    if not (_matches(token, keys.api_key) or _matches(token, keys.admin_key)):
        raise ApiError(401, "this route needs the server's API key: send 'Authorization: Bearer <api key>'")


async def require_admin(request: Request) -> None:
    keys: Keys = request.app.state.keys
    if keys.admin_key is None:
        if _is_loopback(request):
            return
        raise ApiError(403, "control routes answer only local clients that came through no proxy, unless the server "
                            "runs with --admin-key")
    if not _matches(_bearer(request), keys.admin_key):
        raise ApiError(401, "this control route needs the server's admin key: send 'Authorization: Bearer <admin key>'")


# ---------------- bodies ----------------
async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, or an ApiError (413 when larger than `max_bytes`)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body ({declared} bytes) exceeds the limit of {max_bytes} bytes (--max-request-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body exceeds the limit of {max_bytes} bytes (--max-request-bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def check_fields(body: dict, known: set[str] | frozenset[str], where: str = "") -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ApiError(
            400, f"unknown field(s) {', '.join(prefix + u for u in unknown)}; known: {', '.join(sorted(known))}", prefix + unknown[0]
        )


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false (got {_show(v)})", name)
    return v


def is_int64(v: Any) -> bool:
    return is_int(v) and -(2**63) <= v < 2**63


def is_unicode(v: Any) -> bool:
    """A string that can be encoded (JSON can carry lone surrogate escapes, which cannot)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(text: Any, param: str) -> str:
    if not isinstance(text, str):
        raise ApiError(400, f"{param} must be a string (got {_show(text)})", param)
    if not text:
        raise ApiError(400, f"{param}: the prompt is empty", param)
    if not is_unicode(text):
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone surrogate escape)", param)
    return text


def check_token_ids(ids: Any, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ApiError(400, f"{param} must be a non-empty list of token ids", param)
    if not all(type(t) is int for t in ids):
        raise ApiError(400, f"{param} must hold integers only", param)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise ApiError(400, f"{param}: token ids must be in [0, {vocab_size}) (got {lo if lo < 0 else hi})", param)
    return ids


def _strings(v: Any) -> bool:
    return v is None or (isinstance(v, str) and is_unicode(v)) or (
        isinstance(v, list) and all(isinstance(s, str) and is_unicode(s) for s in v))


def _logit_bias(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(
        isinstance(k, str) and k.strip().isdigit() and is_number(b) for k, b in v.items()))


_int64 = (is_int64, "a 64-bit integer")
_number = (is_number, "a number")
_flag = (lambda v: isinstance(v, bool), "true or false")

# each JSON kind of a SamplingParams field (rollout.config.param): (check, what it must be)
_JSON_KINDS = {
    "int": _int64, "number": _number, "flag": _flag, "strings": (_strings, "a string or a list of strings"),
    "ids": (lambda v: isinstance(v, list) and all(is_int64(t) for t in v), "a list of integers"),
    "bias": (_logit_bias, "an object mapping token ids to numbers"),
}  # fmt: skip
# SGLang's sampling_params: name -> (check, what it must be). null means the default for every one.
_SAMPLING_TYPES = {
    **{f.name: _JSON_KINDS[f.metadata["json"]] for f in fields(SamplingParams)},
    "sampling_seed": _int64,  # (SGLang's name for the seed)
    "stream_interval": (lambda v: is_int(v) and 1 <= v <= 2**31, "an integer >= 1"),
    "custom_params": (lambda v: isinstance(v, dict), "an object"),  # input to a custom logit processor: none here
}  # fmt: skip
# Fields asking for what this engine does not do: accepted only as null, so nothing is silently ignored.
_UNSUPPORTED_SAMPLING = {
    "regex": "constrained decoding", "json_schema": "constrained decoding", "ebnf": "constrained decoding",
    "structural_tag": "constrained decoding", "stop_regex": "stop regexes",
}  # fmt: skip
_FRONT_END_ONLY = {"stream_interval", "custom_params"}  # shape the response (or nothing), never the tokens


@dataclass
class SamplingRequest:
    """Checked sampling fields: the engine's params, and what only the front end uses."""

    params: SamplingParams
    stream_interval: int = 1


def parse_sampling_params(raw: Any, where: str = "sampling_params", rename: dict[str, str] | None = None) -> SamplingRequest:
    """Checked sampling fields from client JSON; ApiError naming the field otherwise.

    `where` prefixes field names in messages ("" for top-level fields); `rename` maps a
    SamplingParams field to the name the client used (e.g. max_new_tokens -> max_tokens).
    """
    rename = rename or {}
    prefix = f"{where}." if where else ""
    show = lambda name: prefix + rename.get(name, name)  # noqa: E731
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be a JSON object (got {_show(raw)})", where)
    for name, what in _UNSUPPORTED_SAMPLING.items():
        if raw.get(name) is not None:
            raise ApiError(400, f"{show(name)} is not supported: this server does no {what}", show(name))
    raw = {k: v for k, v in raw.items() if v is not None and k not in _UNSUPPORTED_SAMPLING}
    known = set(_SAMPLING_TYPES) | set(_UNSUPPORTED_SAMPLING)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(show, unknown))}; known: {', '.join(sorted(known))}", show(unknown[0]))
    for name, value in raw.items():
        check, what = _SAMPLING_TYPES[name]
        if not check(value):
            raise ApiError(400, f"{show(name)} must be {what} (got {_show(value)})", show(name))
    if "sampling_seed" in raw:  # SGLang's name for the seed
        seed = raw.pop("sampling_seed")
        if raw.get("seed", seed) != seed:
            raise ApiError(400, f"{show('sampling_seed')} and {show('seed')} differ; send one", show("sampling_seed"))
        raw["seed"] = seed
    extra = {k: raw.pop(k) for k in _FRONT_END_ONLY if k in raw}
    try:
        params = SamplingParams.from_dict(raw)
    except ValueError as e:  # "sampling_params.<name> <why> (got ...)"
        message = str(e)
        m = re.match(r"sampling_params\.(\w+) ", message)
        if m is None:
            raise ApiError(400, message, where or None) from None
        raise ApiError(400, show(m.group(1)) + message[m.end(1):], show(m.group(1))) from None
    return SamplingRequest(params, extra.get("stream_interval", 1))


def _show(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool, type(None))) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
