"""The CPU's products: a row's bits depend on that row alone, so that a verify step reproduces plain
decoding bit for bit (the reference the engine's tests compare speculation against)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm
from kernels.skinny_gemm import linear


@pytest.mark.parametrize("chunked", [False, True])
def test_a_rows_product_on_the_cpu_is_the_same_bits_in_any_batch(chunked):
    gen = torch.Generator().manual_seed(7 + chunked)
    k = 64
    chunk_rows = skinny_gemm.CPU_WEIGHT_CHUNK_BYTES // (k * 4)
    n = 3 * chunk_rows + 5 if chunked else 96  # a weight the CPU reads a chunk of rows at a time, or whole
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(37, k, generator=gen)
    whole = linear(x, weight, bias)
    torch.testing.assert_close(whole, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for rows in (1, 5, 8, 13):
        assert torch.equal(linear(x[:rows], weight, bias), whole[:rows])
    others = torch.randn(11, k, generator=gen)
    assert torch.equal(linear(torch.cat([others, x[:3]]), weight, bias)[11:], whole[:3])
