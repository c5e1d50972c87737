"""Programmatic dependent launch (PDL; Hopper and later) for the decoder's Triton kernels.

A decode step of a small model is some 300 short kernels, and each normally starts only
after the one before it has finished and the GPU has launched it: a gap of about a
microsecond per kernel, inside a CUDA graph too. A kernel launched with PDL may be put on
the SMs while the kernel before it still runs; it then waits (`griddepcontrol.wait`) until
that kernel has finished and its writes are visible. Each of our kernels waits first thing,
before reading or writing global memory, and right after lets its own successor launch, so
the order of every read and write is exactly that of plain launches: results are bitwise
the same, only the gaps shrink. A kernel launched without PDL (torch's, cuBLAS's) waits for
everything before it as usual, so mixing them is safe.

The setting is process-wide: off by default, and set by each engine as it starts, on for
GPUs that have it (`EngineConfig.pdl`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_enabled = False


def supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def launch_args() -> dict:
    """Keyword arguments for a launch of a kernel that takes the `PDL` constexpr."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """First thing in a kernel: wait for the kernel before it, then let the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
