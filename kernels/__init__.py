"""Triton kernels and their torch references (docs/kernels.md)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SMs, which launch choices fill; on the CPU (Triton's interpreter) 8, a small number
    that exercises the same code."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
