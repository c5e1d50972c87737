"""Reading checkpoints and writing HF-named tensors into the model, validated whole first.

The same path serves the initial load and every weight update from a trainer: nothing is
written until every name, shape and dtype has been checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from rollout.models.llama import WeightTarget, ranges

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; we compute them
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class WeightError(ValueError):
    """A weight set that cannot be applied; nothing was changed."""


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_checkpoint(path: str | Path, targets: dict[str, WeightTarget] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint; with `targets` (a tensor-parallel rank's), only each target's
    part is read from the file."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = targets.get(name) if targets is not None else None
                if target is None or target.part is None:
                    yield name, f.get_tensor(name)
                else:
                    dim, index = target.part
                    pieces = [f.get_slice(name)[(slice(None),) * dim + (s,)] for s in ranges(index)]
                    yield name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def checkpoint_specs(path: str | Path) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor, read from the headers only (safetensors checks that the
    file holds every byte they promise: a truncated or garbled file fails here, before any write).
    The one reader of checkpoint headers: the initial load, `Engine.update_weights_from_disk` and
    the server's disk updates (weight_sync/receiver.py) all ask it."""
    specs = []
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(s.get_dtype())
                    if dtype is None:
                        raise WeightError(f"{file.name}: {name} has dtype {s.get_dtype()}, which cannot be loaded into the model")
                    specs.append((name, tuple(s.get_shape()), dtype))
        except WeightError:
            raise
        except Exception as e:  # SafetensorError is a plain Exception
            raise WeightError(f"cannot read {file}: {e}") from e
    return specs


def check_weights(
    targets: dict[str, WeightTarget],
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    require_all: bool,
    optional: Iterable[str] = (),
) -> list[str]:
    """Validate (name, shape, dtype) triples; returns the names to apply, raises WeightError listing every problem."""
    problems, names = [], []
    for name, shape, dtype in specs:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target = targets.get(name)
        if target is None:
            problems.append(f"unknown weight {name!r}")
        elif tuple(shape) != target.shape:
            problems.append(f"{name}: shape {tuple(shape)} != expected {target.shape}")
        elif not dtype.is_floating_point:
            problems.append(f"{name}: dtype {dtype} is not a floating-point type")
        else:
            names.append(name)
    if len(set(names)) != len(names):
        problems.append("some weights are given more than once")
    if require_all:
        missing = set(targets) - set(names) - set(optional)
        if missing:
            problems.append(f"missing {len(missing)} weight(s), e.g. {sorted(missing)[:3]}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
        raise WeightError(f"weights rejected, nothing changed: {shown}")
    return names


COPY_GROUP = 256  # copies made by one call


def copy_weights(targets: dict[str, WeightTarget], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write already-validated tensors (cast to each parameter's dtype and device), each cut to
    this rank's part of it under tensor parallelism. A copy call costs the host ~5 us on a GPU, more
    than a few MB take to copy there, and a mixture of experts' push is 18,432 expert tensors: the
    copies go in groups, and consecutive experts' tensors that lie evenly spaced in one buffer (a
    push's bucket, as the trainer packed them) land in their stacked parameter as one copy."""
    with torch.no_grad():
        dst, src = [], []
        for to, got in copy_pairs(targets, tensors):
            dst.append(to)
            src.append(got)
            if len(dst) == COPY_GROUP:
                torch._foreach_copy_(dst, src)
                dst, src = [], []
        if dst:
            torch._foreach_copy_(dst, src)


def copy_pairs(targets: dict[str, WeightTarget],
               tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """What copy_weights copies, as (destination, source) pairs: a tensor each, or a run of experts
    e, e+1, ... of one stacked parameter (the same rows of each, the whole tensor kept) whose sources
    share a shape, strides and storage and start a fixed number of bytes apart, as one strided view
    on either side (a 128-MB bucket holds ~40 of Qwen3-30B-A3B's 3-MB expert tensors: ~13 experts a run). Runs
    of several parameters grow side by side (a checkpoint names expert 0's gate, up and down, then
    expert 1's); any other tensor ends them first, so that tensors land in the order given."""
    runs: dict[tuple, _Run] = {}
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target = targets[name]
        if target.expert is None or target.part is not None:
            yield from (run.pair() for run in runs.values())
            runs.clear()
            yield target.view(), target.take(tensor)
            continue
        key = (id(target.param), None if target.rows is None else target.rows.start)  # (slices hash from Python 3.12)
        run = runs.get(key)
        if run is None or not run.extend(target, tensor):
            if run is not None:
                yield run.pair()
            runs[key] = _Run(target, tensor)
    yield from (run.pair() for run in runs.values())


class _Run:
    """Experts e, e+1, ... of one stacked parameter, their sources `step` bytes apart in one storage."""

    def __init__(self, target: WeightTarget, first: torch.Tensor):
        self.target, self.first, self.count, self.step = target, first, 1, 0
        self.address, self.storage = first.data_ptr(), first.untyped_storage().data_ptr()

    def extend(self, target: WeightTarget, tensor: torch.Tensor) -> bool:
        first = self.first
        if not (target.expert == self.target.expert + self.count and tensor.dtype == first.dtype
                and tensor.shape == first.shape and tensor.stride() == first.stride()
                and tensor.untyped_storage().data_ptr() == self.storage):
            return False
        gap = tensor.data_ptr() - self.address
        if self.count == 1 and gap > 0 and gap % first.element_size() == 0:
            self.step = gap
        elif gap != self.step * self.count or self.count == 1:
            return False
        self.count += 1
        return True

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        target, first, count = self.target, self.first, self.count
        if count == 1:
            return target.view(), first
        whole = target.param.data[target.expert : target.expert + count]
        strides = (self.step // first.element_size(), *first.stride())
        source = first.as_strided((count, *first.shape), strides, first.storage_offset())
        return (whole if target.rows is None else whole[:, target.rows]), source
