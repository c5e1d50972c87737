"""The draft-rows kernel against its torch reference, on fresh random trees (GPU, or
TRITON_INTERPRET=1 on the CPU; see tests/triton_kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_device_speculation import random_trees
from triton_kernels import DEVICE, GPU_ONLY

from kernels.draft_rows import _lay_out_triton, lay_out_drafts_ref

pytestmark = GPU_ONLY


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("s,n", [(1, 2), (5, 9), (64, 9), (150, 5), (97, 17)])
def test_kernel_matches_the_reference(seed, s, n):
    """Across the kernel's blocks of sequences, with ties at the lowest kept key, for capacities
    from none to more than the batch has drafts."""
    trees = [t.to(DEVICE) for t in random_trees(torch.Generator().manual_seed(seed * 100 + s), s, n)]
    drafts = int((trees[1][:, 1:] >= 0).sum())
    for capacity in sorted({0, 1, s // 2 + 1, drafts // 2 + 1, drafts, drafts + 3}):
        slots = torch.randperm(s + capacity, device=DEVICE) + 1
        got = _lay_out_triton(*trees, slots, capacity)
        want = lay_out_drafts_ref(*trees, slots, capacity)
        for field in dataclasses.fields(want):
            g, w = getattr(got, field.name), getattr(want, field.name)
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), (field.name, capacity)
