"""What a weight push puts on the wire: tensor specs, dtype names, and flat buckets.

Both sides derive the same bucket layout from the same metadata (names, dtypes, shapes,
`bucket_bytes`), so only the metadata travels by HTTP and only raw bytes travel by
broadcast or IPC. Tensors are packed in the order given, each at a 256-byte aligned offset
of a flat uint8 buffer; a bucket is closed when the next tensor would overflow it, and a
tensor larger than `bucket_bytes` gets a bucket of its own. `bucket_bytes == 0` means one
typed tensor per "bucket" (SGLang's per-tensor broadcast, kept for trainers that speak it).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_sync.errors import WeightSyncError

ALIGN = 256
DEFAULT_BUCKET_BYTES = 128 << 20
HEADER_MAGIC = 0x77_62_75_63_6B  # "wbuck": starts every bucketed broadcast

# Every dtype a push may name. Non-float ones are accepted on the wire so that they are
# rejected by the engine's validation with a clear message, not by a parser.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "double": "float64", "long": "int64", "int": "int32"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Slot:
    index: int  # position in the spec list
    offset: int  # byte offset in the bucket


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    slots: tuple[Slot, ...]
    typed: bool = False  # bucket_bytes == 0: the buffer is the tensor itself, with its dtype and shape


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """`bfloat16`, `torch.bfloat16` or a common alias (`bf16`, `half`, ...)."""
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise WeightSyncError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def parse_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    """The metadata of an update request, checked for form (not against a model)."""
    if not isinstance(names, (list, tuple)) or not isinstance(dtypes, (list, tuple)) or not isinstance(shapes, (list, tuple)):
        raise WeightSyncError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightSyncError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    if not names:
        raise WeightSyncError("the update names no tensors")
    specs, parsed = [], {}  # (a push names a handful of dtypes, 18,867 times for a mixture of experts)
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise WeightSyncError(f"tensor names must be non-empty strings (got {name!r})")
        if not isinstance(shape, (list, tuple)) or any(type(d) is not int or d < 0 for d in shape):  # (bool: no int here)
            raise WeightSyncError(f"{name}: shape must be a list of non-negative integers (got {shape!r})")
        torch_dtype = parsed.get(dtype) if isinstance(dtype, str) else None
        if torch_dtype is None:
            torch_dtype = parsed[str(dtype)] = parse_dtype(dtype)
        specs.append(TensorSpec(name, tuple(shape), torch_dtype))
    return specs


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    if bucket_bytes < 0:
        raise WeightSyncError(f"bucket_bytes must be >= 0 (got {bucket_bytes})")
    if bucket_bytes == 0:
        return [Bucket(s.nbytes, (Slot(i, 0),), typed=True) for i, s in enumerate(specs)]
    buckets, slots, used = [], [], 0
    for i, spec in enumerate(specs):
        offset = align(used)
        if slots and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(used, tuple(slots)))
            slots, offset = [], 0
        slots.append(Slot(i, offset))
        used = offset + spec.nbytes
    if slots:
        buckets.append(Bucket(used, tuple(slots)))
    return buckets


def bucket_buffer(bucket: Bucket, specs: Sequence[TensorSpec], device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised buffer to receive `bucket` into (a slice of `out` when given and large enough)."""
    if bucket.typed:
        spec = specs[bucket.slots[0].index]
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if out is not None and out.numel() >= bucket.nbytes:
        return out[: bucket.nbytes]
    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's bytes, cast to the specs' dtypes on the way (`tensors` are indexed like the specs).

    The buffer lives on `out`'s device when given, else on the tensors' device."""
    if bucket.typed:
        i = bucket.slots[0].index
        return tensors[i].to(dtype=specs[i].dtype, device=out.device if out is not None else None).contiguous()
    if out is None or out.numel() < bucket.nbytes:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=out.device if out is not None else tensors[bucket.slots[0].index].device)
    out = out[: bucket.nbytes]
    # (one call for the bucket, not a copy call a tensor: a mixture of experts' push packs 18,432 of them)
    torch._foreach_copy_([view for _, view in unpack(bucket, out, specs)], [tensors[slot.index] for slot in bucket.slots])
    return out


def header(specs: Sequence[TensorSpec], layout: Sequence[Bucket]) -> list[int]:
    """Broadcast before the buckets of a bucketed push, so a receiver never reads bytes laid out otherwise."""
    names = zlib.crc32("\n".join(s.name for s in specs).encode())
    return [HEADER_MAGIC, len(layout), sum(b.nbytes for b in layout), names]


def unpack(bucket: Bucket, buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into `buf` (no copy)."""
    if bucket.typed:
        return [(specs[bucket.slots[0].index].name, buf)]
    # (one strided view each, of the buffer seen once per dtype: slicing and viewing twice took the host twice as long,
    # bench/probes/push_host_pieces.py, and a push of a mixture of experts unpacks and packs 18,432 tensors)
    flats: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for slot in bucket.slots:
        spec = specs[slot.index]
        size = spec.dtype.itemsize
        flat = flats.get(spec.dtype)
        if flat is None:
            flat = flats[spec.dtype] = buf[: buf.numel() // size * size].view(spec.dtype)
        view = flat.as_strided(spec.shape, _contiguous_strides(spec.shape), flat.storage_offset() + slot.offset // size)
        out.append((spec.name, view))
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def align(n: int) -> int:
    """`n` rounded up to ALIGN bytes: where a tensor starts in a bucket."""
    return (n + ALIGN - 1) // ALIGN * ALIGN
