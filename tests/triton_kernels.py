"""Where the Triton kernel tests run: on a CUDA GPU (their tests are then marked `gpu`) or, without
one, under Triton's CPU interpreter (`TRITON_INTERPRET=1 pytest -o addopts='' <file>`). A test
module that imports this is skipped anywhere else (CI: no Triton, no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"
GPU_ONLY = pytest.mark.gpu if ON_GPU else []  # a module's `pytestmark`

if not ON_GPU:  # the interpreter keeps scalars as 1-element arrays, which NumPy 2 will not turn into an int
    from triton.runtime import interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor


def assert_bitwise_alike(monkeypatch, module, name: str, off, on, run) -> None:
    """`run()` gives the same bits with `module.name` set to `off` and to `on` (left on), eagerly and
    replayed in a CUDA graph: for a hint to the hardware, such as a prefetch, which must change no bit."""
    monkeypatch.setattr(module, name, off)
    plain = run()
    monkeypatch.setattr(module, name, on)
    assert torch.equal(run(), plain)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    assert torch.equal(out, plain)
