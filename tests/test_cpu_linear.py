"""The CPU's products: a row's bits depend on that row alone, so that a verify step reproduces plain
decoding bit for bit (the reference the engine's tests compare speculation against)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm
from kernels.skinny_gemm import linear


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The products on one thread and on two: MKL spreads a lone block over the threads (`_block_products`)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunked", [False, True])  # (chunked: the last chunk's columns odd)
def test_a_rows_product_on_the_cpu_is_the_same_bits_in_any_batch(chunked, dtype, threads):
    gen = torch.Generator().manual_seed(7 + chunked)
    k = 576  # (the default model's width: MKL spreads a lone block of it over two threads)
    chunk_rows = skinny_gemm.CPU_WEIGHT_CHUNK_BYTES // (k * dtype.itemsize)
    n = 3 * chunk_rows + 5 if chunked else 576  # a weight the CPU reads a chunk of rows at a time, or whole
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    weight, bias = randn(n, k), randn(n)
    x = randn(37, k)
    whole = linear(x, weight, bias)
    if not chunked and threads == 1:  # a block: F.linear's own bits (one thread's: F.linear spreads a lone block)
        assert torch.equal(whole[:8], F.linear(x[:8], weight, bias))
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    torch.testing.assert_close(whole.float(), F.linear(x.float(), weight.float(), bias.float()), **tolerance)
    for rows in (1, 5, 8, 13):
        assert torch.equal(linear(x[:rows], weight, bias), whole[:rows])
    others = randn(11, k)
    assert torch.equal(linear(torch.cat([others, x[:3]]), weight, bias)[11:], whole[:3])
