"""Reads the history rows of an offline W&B run file (`wandb/offline-run-*/run-*.wandb`).

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB
blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last)
and a protobuf `Record` as payload. wandb ships no reader for it any more.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the rest of a block too small for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 or pos + HEADER + length > len(data):  # the end, or a record still being written
            break
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(run_dir: Path, timeout_s: float = 30.0) -> list[dict]:
    """Every logged row of the run in `run_dir` (an offline-run-* directory), in order.

    Waits for the run's exit record, the file's last: W&B's service may still be writing the
    file when `finish()` has returned (once, under a loaded CI machine, no row was there yet)."""
    (run_file,) = Path(run_dir).glob("run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while not any(rec.WhichOneof("record_type") == "exit" for rec in records(run_file)):
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout_s} s"
        time.sleep(0.1)
    rows = []
    for rec in records(run_file):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item})
    return rows
