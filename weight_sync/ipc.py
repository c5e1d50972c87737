"""CUDA IPC handles as plain JSON values, for a trainer that shares the engine's GPU.

`torch.multiprocessing.reductions.reduce_tensor` describes a CUDA tensor by a handful of
fields (sizes, dtype, the cudaIpcMemHandle bytes, a ref-counter handle, an event handle).
We send those fields, base64 for the bytes, instead of a pickle, and rebuild the tensor on
the engine side with `rebuild_cuda_tensor`, choosing the tensor and storage classes
ourselves (never from the wire). The GPU is named by UUID, since device indices differ
between processes with different CUDA_VISIBLE_DEVICES.

The trainer must keep the shared tensors alive (and unmodified) until the engine answers.
"""

from __future__ import annotations

import base64

import torch

from weight_sync.buckets import dtype_name, parse_dtype
from weight_sync.errors import WeightSyncError

_FIELDS = ("size", "stride", "offset", "dtype", "device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes",
           "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share_cuda_tensor(tensor: torch.Tensor) -> dict:
    """JSON-able description of a CUDA tensor another process on the same GPU can open."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise WeightSyncError("IPC pushes need CUDA tensors; move the model to the GPU the engine uses")
    _, args = reduce_tensor(tensor.detach())
    return encode_reduced(args, device_uuid(args[6]))


def encode_reduced(args: tuple, uuid: str) -> dict:
    """The fields of reduce_tensor's CUDA argument tuple, as JSON values."""
    (_, size, stride, offset, _, dtype, _, handle, storage_size, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device_uuid": uuid,
        "handle": _b64(handle),
        "storage_size_bytes": int(storage_size),
        "storage_offset_bytes": int(storage_offset),
        "ref_counter_handle": _b64(ref_handle),
        "ref_counter_offset": int(ref_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync),
    }


def decode_fields(d: dict) -> dict:
    """Check and convert a handle's fields (no CUDA needed); raises WeightSyncError on anything malformed."""
    if not isinstance(d, dict):
        raise WeightSyncError("each IPC handle must be a JSON object")
    missing = [f for f in _FIELDS if f not in d]
    if missing:
        raise WeightSyncError(f"IPC handle is missing field(s) {missing}")
    try:
        out = {
            "size": tuple(int(x) for x in d["size"]),
            "stride": tuple(int(x) for x in d["stride"]),
            "offset": int(d["offset"]),
            "dtype": parse_dtype(d["dtype"]),
            "device_uuid": str(d["device_uuid"]),
            "handle": _unb64(d["handle"]),
            "storage_size_bytes": int(d["storage_size_bytes"]),
            "storage_offset_bytes": int(d["storage_offset_bytes"]),
            "ref_counter_handle": _unb64(d["ref_counter_handle"]),
            "ref_counter_offset": int(d["ref_counter_offset"]),
            "event_handle": _unb64(d["event_handle"]),
            "event_sync_required": bool(d["event_sync_required"]),
        }
    except WeightSyncError:
        raise
    except (TypeError, ValueError) as e:
        raise WeightSyncError(f"malformed IPC handle: {e}") from e
    if out["handle"] is None or out["ref_counter_handle"] is None:
        raise WeightSyncError("IPC handle has no memory handle")
    return out


def open_cuda_tensor(d: dict, device: torch.device) -> torch.Tensor:
    """Rebuild a tensor shared by `share_cuda_tensor`; it must live on the engine's own GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = decode_fields(d)
    if device.type != "cuda":
        raise WeightSyncError("update_weights_from_tensor needs a CUDA engine on the trainer's GPU; this engine runs on CPU", 400)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if device_uuid(index) != f["device_uuid"]:
        raise WeightSyncError(
            f"the trainer's tensors live on GPU {f['device_uuid']}, the engine on {device_uuid(index)}: "
            "IPC works only on a shared GPU; push with method='distributed' instead"
        )
    return rebuild_cuda_tensor(
        torch.Tensor, f["size"], f["stride"], f["offset"], torch.UntypedStorage, f["dtype"], index,
        f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], False,
        f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"], f["event_sync_required"],
    )


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    if s is None:
        return None
    if not isinstance(s, str):
        raise WeightSyncError("IPC handle byte fields must be base64 strings")
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise WeightSyncError(f"IPC handle field is not valid base64: {e}") from e
