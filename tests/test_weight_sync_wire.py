"""The wire format of weight pushes: dtype names, bucket layout, IPC handle fields, name cleanup."""

from __future__ import annotations

import pytest
import torch

from weight_sync import WeightSyncError
from weight_sync.buckets import (
    ALIGN,
    TensorSpec,
    header,
    pack,
    parse_dtype,
    parse_specs,
    plan_buckets,
    unpack,
)
from weight_sync.ipc import decode_fields, encode_reduced
from weight_sync.pusher import strip_wrapper_prefixes


def random_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(2, 2, 2, generator=g).to(torch.float16)),
        ("big", torch.randn(300, generator=g)),
        ("d", torch.randn(1, generator=g).double()),
        ("empty", torch.zeros(0, 4)),
        ("scalar", torch.tensor(2.5)),
        ("int", torch.arange(6).view(2, 3)),
    ]


@pytest.mark.parametrize("bucket_bytes", [0, 64, 1024, 1 << 20])
def test_pack_then_unpack_gives_back_every_tensor_bit_for_bit(bucket_bytes):
    named = random_tensors()
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    layout = plan_buckets(specs, bucket_bytes)
    assert [s.index for b in layout for s in b.slots] == list(range(len(specs)))  # every tensor once, in order
    out = []
    for bucket in layout:
        packed = pack(bucket, [t for _, t in named], specs)
        # as received on the other side: a bucket into part of a larger buffer, a tensor alone into its own
        buf = packed.clone() if bucket.typed else torch.empty(len(packed) + 1024, dtype=torch.uint8)[256 : 256 + len(packed)]
        out.extend(unpack(bucket, buf.copy_(packed), specs))
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, got), (_, want) in zip(out, named):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)


def test_buckets_respect_the_size_and_alignment_and_oversized_tensors_go_alone():
    specs = [TensorSpec(str(i), (n,), torch.float32) for i, n in enumerate([10, 10, 500, 10, 3])]
    layout = plan_buckets(specs, 1024)
    assert [[s.index for s in b.slots] for b in layout] == [[0, 1], [2], [3, 4]]
    assert all(s.offset % ALIGN == 0 for b in layout for s in b.slots)
    assert all(b.nbytes <= 1024 or len(b.slots) == 1 for b in layout)
    assert header(specs, layout)[1:3] == [3, sum(b.nbytes for b in layout)]
    assert header(specs, layout) != header(specs[::-1], plan_buckets(specs[::-1], 1024))


def test_dtypes_parse_from_sglang_and_torch_spellings():
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    with pytest.raises(WeightSyncError, match="unknown dtype 'float8_e9m9'"):
        parse_dtype("float8_e9m9")


@pytest.mark.parametrize(
    "names,dtypes,shapes,message",
    [
        (["a", "b"], ["float32"], [[1], [2]], "differ in length"),
        ([], [], [], "no tensors"),
        (["a"], ["float32"], [[-1]], "non-negative integers"),
        (["a"], ["float32"], ["12"], "non-negative integers"),
        ([""], ["float32"], [[1]], "non-empty strings"),
        ("abc", ["float32"], [[1]], "must be lists"),
    ],
)
def test_malformed_metadata_is_rejected_with_the_reason(names, dtypes, shapes, message):
    with pytest.raises(WeightSyncError, match=message):
        parse_specs(names, dtypes, shapes)


def test_ipc_handle_fields_round_trip_through_json_values():
    args = (torch.Tensor, torch.Size([6, 4]), (4, 1), 8, torch.storage.TypedStorage, torch.bfloat16, 0,
            b"\x01\x02handle", 4096, 512, False, b"/torch_123_ref", 16, b"\x00event", True)
    enc = encode_reduced(args, "GPU-1234")
    assert all(isinstance(v, (int, str, bool, list, type(None))) for v in enc.values())
    dec = decode_fields(enc)
    assert dec["size"] == (6, 4) and dec["stride"] == (4, 1) and dec["offset"] == 8 and dec["dtype"] is torch.bfloat16
    assert dec["handle"] == b"\x01\x02handle" and dec["ref_counter_handle"] == b"/torch_123_ref" and dec["event_handle"] == b"\x00event"
    assert dec["storage_size_bytes"] == 4096 and dec["storage_offset_bytes"] == 512 and dec["event_sync_required"] is True


@pytest.mark.parametrize("field,value,message", [("handle", "%%%", "not valid base64"), ("dtype", "object", "unknown dtype"), ("size", None, "malformed")])
def test_malformed_ipc_handles_are_rejected(field, value, message):
    args = (torch.Tensor, torch.Size([4]), (1,), 0, None, torch.uint8, 0, b"h", 4, 0, False, b"r", 0, None, False)
    enc = encode_reduced(args, "GPU-0")
    enc[field] = value
    with pytest.raises(WeightSyncError, match=message):
        decode_fields(enc)


def test_wrapper_prefixes_are_stripped_from_names():
    assert strip_wrapper_prefixes("module._orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert strip_wrapper_prefixes("_fsdp_wrapped_module.model.norm.weight") == "model.norm.weight"
    assert strip_wrapper_prefixes("lm_head.weight") == "lm_head.weight"
