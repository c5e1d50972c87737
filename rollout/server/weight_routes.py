"""The weight-update and pause routes of `rollout serve`, with SGLang's names and fields.

`create_app` includes `router` behind `require_admin` (a weight push rewrites the model).
Each route checks the body's form (a JSON object, no unknown fields, the required ones
present) and forwards it as one control call to the engine process, where
the engine loop hands it to the WeightReceiver as keyword arguments. The receiver checks
the values (types, every name, shape and dtype against the model, version order) before
anything changes; its WeightSyncError comes back with the status that fits (400 bad input,
404 unknown group, 409 stale version, 504 a trainer that stopped sending) and a JSON
`error` that says what is wrong. The engine answers when the update has been swapped in.

There is no timeout on these calls: a push may take minutes, and the receiver bounds it
itself (300 s by default; `timeout_s` per distributed update).

The update routes also take `flush_cache` (default true: recompute
the KV of running requests; false keeps it) and SGLang's `load_format` (null or "auto": the
tensors as they are), and the distributed and tensor routes take `bucket_bytes` (0: one
broadcast or IPC handle per tensor, SGLang's way; otherwise the tensors packed in buckets,
as WeightPusher sends them). `/flush_cache` answers GET too (slime's probe that the server
is idle: 200 only when no request is in flight, as SGLang), and the memory routes hand the
GPU to a colocated trainer and take it back (`tags`: weights, kv_cache, cuda_graph; none
means all).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rollout.config import MEMORY_TAGS
from rollout.server.frontend import JSON, frontend
from rollout.server.guard import ApiError, check_fields, is_number, read_json

router = APIRouter()

UPDATE_FIELDS = {"weight_version", "abort_all_requests", "flush_cache", "load_format"}

# route -> (engine op, required fields, optional fields)
ROUTES: dict[str, tuple[str, set[str], set[str]]] = {
    "/init_weights_update_group": (
        "init_weights_update_group",
        {"master_address", "master_port", "rank_offset", "world_size"},
        {"group_name", "backend"},
    ),
    "/update_weights_from_distributed": (
        "update_weights_from_distributed",
        {"names", "dtypes", "shapes"},
        {"group_name", "bucket_bytes", "timeout_s"} | UPDATE_FIELDS,
    ),
    "/update_weights_from_disk": ("update_weights_from_disk", {"model_path"}, UPDATE_FIELDS),
    "/update_weights_from_tensor": (
        "update_weights_from_tensor",
        {"names", "dtypes", "shapes", "handles"},
        {"bucket_bytes"} | UPDATE_FIELDS,
    ),
    "/destroy_weights_update_group": ("destroy_weights_update_group", set(), {"group_name"}),
    "/pause_generation": ("pause_generation", set(), {"mode"}),
    "/continue_generation": ("continue_generation", set(), set()),
    "/flush_cache": ("flush_cache", set(), set()),
    "/release_memory_occupation": ("release_memory_occupation", set(), {"tags"}),
    "/resume_memory_occupation": ("resume_memory_occupation", set(), {"tags"}),
}
GET_TOO = {"/flush_cache"}


def _forward(op: str, required: set[str], optional: set[str]):
    async def route(request: Request) -> Response:
        fe = frontend(request)
        body = {} if not required and _no_body(request) else await read_json(request, fe.settings.max_request_bytes)
        check_fields(body, required | optional)
        missing = sorted(required - set(body))
        if missing:
            raise ApiError(400, f"missing field(s) {', '.join(missing)}; required: {', '.join(sorted(required))}", missing[0])
        timeout = body.get("timeout_s")
        if timeout is not None and not (is_number(timeout) and timeout > 0):
            raise ApiError(400, f"timeout_s must be a number of seconds > 0 (got {timeout!r})", "timeout_s")
        if body.pop("load_format", None) not in (None, "auto"):
            raise ApiError(400, "load_format: only null or \"auto\" (the tensors as sent) is supported", "load_format")
        port = body.get("master_port")
        if isinstance(port, str) and port.strip().isdigit():  # SGLang's pydantic takes "29500" as well
            body["master_port"] = int(port)
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(t in MEMORY_TAGS for t in tags)):
            raise ApiError(400, f"tags must be a list of {', '.join(MEMORY_TAGS)} (or null: all of them)", "tags")
        return JSON(await fe.engine.control(op, body))

    route.__name__ = op
    return route


for _path, (_op, _required, _optional) in ROUTES.items():
    router.add_api_route(_path, _forward(_op, _required, _optional), methods=["POST", "GET"] if _path in GET_TOO else ["POST"])


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    return JSON(await frontend(request).engine.control("get_weight_version", timeout=30))


def _no_body(request: Request) -> bool:
    """A GET, or a POST without a body (`curl -X POST`, `requests.post(url)`): routes with no required field allow it."""
    if request.method == "GET":
        return True
    return request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers
