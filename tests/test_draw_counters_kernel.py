"""The draw-counters kernel against its torch reference, on fresh random steps (GPU, or
TRITON_INTERPRET=1 on the CPU; see tests/triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from test_sampler import random_step
from triton_kernels import DEVICE, GPU_ONLY

from kernels.draw_counters import _draw_counters_triton, draw_counters_ref

pytestmark = GPU_ONLY


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("vocab,s,n,capacity", [(5, 1, 1, 20), (7, 64, 9, 700), (49_152, 300, 1, 2_200), (3, 33, 17, 90)])
def test_kernel_matches_the_reference(seed, vocab, s, n, capacity):
    step = random_step(torch.Generator().manual_seed(seed * 1000 + s), vocab, s, n, capacity)
    step = [t.to(DEVICE) for t in step]
    got = _draw_counters_triton(*step, vocab)
    assert torch.equal(got.cpu(), draw_counters_ref(*step, vocab).cpu())
