"""Triton kernels and their torch references (docs/kernels.md)."""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter, for kernel tests


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SMs, which launch choices fill; on the CPU (Triton's interpreter) 8, a small number
    that exercises the same code."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may load these 2-D tensors' tiles by TMA (tensor descriptors): 16-bit, on
    Hopper or later, each tensor and its rows 16-byte aligned with unit column stride (TMA's rule);
    not in Triton's interpreter, whose runs stay on the pointer loads the GPU tests compare with."""
    if INTERPRET:
        return False
    ok = all(t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.dtype == tensors[0].dtype
             and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(-2) * t.element_size() % 16 == 0
             for t in tensors)
    return ok and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9
