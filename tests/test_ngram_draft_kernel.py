"""The drafting kernel against its torch reference, on fresh random token streams (GPU, or
TRITON_INTERPRET=1 on the CPU; see tests/triton_kernels.py)."""

from __future__ import annotations

import random

import pytest
import torch
from test_ngram_draft import random_table
from triton_kernels import DEVICE, GPU_ONLY

from kernels.ngram_draft import _draft_triton, draft_trees_ref

pytestmark = GPU_ONLY


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,cands,depth,width", [(1, 4, 4, 4), (3, 8, 8, 8), (6, 8, 5, 12), (2, 2, 3, 2), (4, 1, 8, 8)])
def test_kernel_matches_the_reference(seed, window, cands, depth, width):
    rng = random.Random(seed * 1000 + window * 100 + width)
    vocab = rng.choice([3, 6, 50])
    table, lengths, prompt_lens, groups, history_start = random_table(rng, vocab, 12, 8, 300 if seed % 2 else 40)
    seqs = [(r, g) for g in groups for r in g if r < history_start]
    m = max(len(g) for g in groups) + 2
    scan = [g + [-1] * (m - len(g)) for _, g in seqs]
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = (t(table), t(lengths), t(prompt_lens), history_start, t([r for r, _ in seqs]), t(scan))
    kw = dict(window=window, min_match=1, cands=cands, depth=depth, width=width)
    got = _draft_triton(*args, **kw)
    want = draft_trees_ref(*args, **kw)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
