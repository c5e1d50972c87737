"""The CPU's products: a row's bits depend on that row alone, so that a verify step reproduces plain
decoding bit for bit (the reference the engine's tests compare speculation against)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm
from kernels.skinny_gemm import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_rows_product_on_the_cpu_is_the_same_bits_in_any_batch(chunked, dtype):
    gen = torch.Generator().manual_seed(7 + chunked)
    k = 64
    chunk_rows = skinny_gemm.CPU_WEIGHT_CHUNK_BYTES // (k * dtype.itemsize)
    n = 3 * chunk_rows + 5 if chunked else 96  # a weight the CPU reads a chunk of rows at a time, or whole
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    weight, bias = randn(n, k), randn(n)
    x = randn(37, k)
    whole = linear(x, weight, bias)
    if not chunked:  # a block: F.linear's own bits
        assert torch.equal(whole[:8], F.linear(x[:8], weight, bias))
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    torch.testing.assert_close(whole.float(), F.linear(x.float(), weight.float(), bias.float()), **tolerance)
    for rows in (1, 5, 8, 13):
        assert torch.equal(linear(x[:rows], weight, bias), whole[:rows])
    others = randn(11, k)
    assert torch.equal(linear(torch.cat([others, x[:3]]), weight, bias)[11:], whole[:3])
