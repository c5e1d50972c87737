"""The fused Triton kernels against their torch references, on fresh random inputs.

On the H100: `pytest -m gpu tests/test_fused_kernels.py`. Without a GPU they also run under
Triton's interpreter: `TRITON_INTERPRET=1 pytest -o addopts='' tests/test_fused_kernels.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_kernels import DEVICE, GPU_ONLY, ON_GPU, assert_bitwise_alike

from kernels import fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
pytestmark = GPU_ONLY
NUMPY_ORDER = "the interpreter's block products are numpy's, whose sums follow the block's rows"


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.isfinite(a).all()
    assert (a.float() - b.float()).norm() <= tol * b.float().norm(), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 576), (5, 4096), (3, 100)])
def test_rms_norm_with_and_without_residual_matches_reference(dtype, rows, n):
    g = torch.Generator(device=DEVICE).manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g, device=DEVICE).to(dtype)
    r = torch.randn(rows, n, generator=g, device=DEVICE).to(dtype)
    w = torch.randn(n, generator=g, device=DEVICE).to(dtype)
    close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), dtype)
    out, summed = fused.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(summed, x + r)
    close(out, fused.rms_norm_ref(x + r, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("slices,rows,n,k", [(2, 1, 576, 1536), (4, 9, 100, 200), (3, 16, 256, 64), (1, 5, 128, 256),
                                             (2, 29, 200, 384), (4, 64, 256, 512)])
def test_a_product_split_over_k_is_summed_by_the_norm_as_its_reference_sums_it(dtype, slices, rows, n, k):
    """A few-row product into a norm as float32 partial sums over slices of K (kernels/skinny_gemm.py
    `split_k_partials`; K of one BLOCK_K tile leaves slices empty): each slice the product over its
    part of K, and the norm sums them in order, rounds to the dtype, adds the residual
    (`parts_sum_ref`): the sum bitwise, the norm as the reference rounds it."""
    from kernels.skinny_gemm import split_k_partials

    g = torch.Generator(device=DEVICE).manual_seed(rows * n + slices)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    r = torch.randn(rows, n, generator=g, device=DEVICE).to(dtype)
    nw = (1 + torch.randn(n, generator=g, device=DEVICE) / 4).to(dtype)
    parts = split_k_partials(x, w, slices)
    assert parts.shape == (rows, slices, n) and parts.dtype == torch.float32
    if not ON_GPU:  # (the interpreter's BLOCK_K of 64; the GPU's is autotuned): each slice whole tiles of K
        per = math.ceil(math.ceil(k / slices) / 64) * 64
        for j in range(slices):
            part = x[:, j * per : (j + 1) * per].float() @ w[:, j * per : (j + 1) * per].float().T
            assert torch.allclose(parts[:, j], part, atol=1e-4, rtol=1e-4), j
    assert torch.allclose(parts.sum(1), x.float() @ w.float().T, atol=1e-3, rtol=1e-3)
    out, summed = fused.rms_norm(parts, nw, 1e-5, residual=r)
    assert summed.dtype == out.dtype == dtype
    assert torch.equal(summed, fused.parts_sum_ref(parts, dtype) + r)
    close(out, fused.rms_norm_ref(summed, nw, 1e-5), dtype)
    with pytest.raises(ValueError, match="residual"):
        fused.rms_norm(parts, nw, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 576), (9, 4096)])
def test_rms_norm_keeps_a_float32_residual_unrounded_and_rounds_the_norm_to_the_asked_dtype(dtype, rows, n):
    """The float32 islands (--enable-fp32-residual, --enable-fp32-lm-head): a half-precision branch
    added to a float32 residual stream, the sum kept exact, the norm out in either dtype."""
    g = torch.Generator(device=DEVICE).manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g, device=DEVICE).to(dtype)
    r = torch.randn(rows, n, generator=g, device=DEVICE)
    w = (1 + torch.randn(n, generator=g, device=DEVICE) / 4).to(dtype)
    for out_dtype in (dtype, torch.float32):
        out, summed = fused.rms_norm(x, w, 1e-5, r, out_dtype)
        assert summed.dtype == torch.float32 and torch.equal(summed, x.float() + r)
        assert out.dtype == out_dtype
        close(out, fused.rms_norm_ref(x.float() + r, w, 1e-5, out_dtype), out_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
def test_float32_activations_kernels_work_in_float32_and_round_once_to_the_dtype(dtype):
    """--enable-fp32-activations: the norm's weight product in float32, rounded once; rope of a float32 q
    and k, q rounded once for attention and k, v into a cache in the dtype; SiLU x up of float32
    products, rounded once for the next product."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    rows, n, tokens, heads, kv_heads, dim, inter = 9, 576, 5, 9, 3, 64, 1536
    x, r = torch.randn(rows, n, generator=g, device=DEVICE), torch.randn(rows, n, generator=g, device=DEVICE)
    w = (1 + torch.randn(n, generator=g, device=DEVICE) / 4).to(dtype)
    out, summed = fused.rms_norm(x, w, 1e-5, r, dtype, round_once=True)
    assert out.dtype == dtype and torch.equal(summed, x + r)
    close(out, fused.rms_norm_ref(x + r, w, 1e-5, dtype, round_once=True), dtype)
    twice = fused.rms_norm_ref(x + r, w, 1e-5, dtype)
    assert not torch.equal(fused.rms_norm_ref(x + r, w, 1e-5, dtype, round_once=True), twice)  # (it rounds once less)

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device=DEVICE)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    pos = torch.randint(0, 500, (tokens,), generator=g, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.randperm(4 * tokens, generator=g, device=DEVICE)[:tokens]
    caches = [torch.zeros(4 * tokens, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    rotated = fused.rope_and_store(q, k, v, cos, sin, *caches, slots, out_dtype=dtype)
    assert rotated.dtype == dtype
    close(rotated, fused.rope_ref(q, cos, sin).to(dtype), dtype)
    close(caches[0][slots], fused.rope_ref(k, cos, sin).to(dtype), dtype)
    assert torch.equal(caches[1][slots], v.to(dtype))

    gate_up = torch.randn(rows, 2 * inter, generator=g, device=DEVICE)
    act = fused.silu_mul(gate_up, dtype)
    assert act.dtype == dtype
    close(act, fused.silu_mul_ref(gate_up).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 9, 3, 64), (33, 9, 3, 64), (7, 32, 8, 128), (5, 8, 8, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_store_on_qkv_views_matches_reference(dtype, tokens, heads, kv_heads, dim, qk_norm):
    """RoPE (after Qwen3's per-head RMSNorm of q and k, with `qk_norm`) and the KV write, against
    the norms apart then the reference rope; without the norms, bitwise the reference."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens * heads)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g, device=DEVICE) * 3).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)  # views, as in the model
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    pos = torch.randint(0, 4000, (tokens,), generator=g, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    slots = torch.randperm(64, generator=g, device=DEVICE)[:tokens]
    caches = [torch.full((64, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    norms = tuple((1 + torch.randn(dim, generator=g, device=DEVICE) / 4).to(dtype) for _ in range(2)) + (1e-6,)
    out = fused.rope_and_store(q, k, v, emb.cos(), emb.sin(), caches[0], caches[1], slots, norms if qk_norm else None)
    if qk_norm:  # what the model ran before: each head through the norm kernel, then rope
        q = fused.rms_norm(q.reshape(-1, dim), norms[0], 1e-6).view(tokens, heads, dim)
        k = fused.rms_norm(k.reshape(-1, dim), norms[1], 1e-6).view(tokens, kv_heads, dim)
    for rotated, reference in ((out, fused.rope_ref(q, emb.cos(), emb.sin())),
                               (caches[0][slots], fused.rope_ref(k, emb.cos(), emb.sin()))):
        if qk_norm:  # (the head norm's sum of squares runs in its own order)
            close(rotated, reference, dtype)
        else:  # each product rounded, then the sum, as eager torch: no FMA
            assert torch.equal(rotated, reference)
    assert torch.equal(caches[1][slots], v)
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(caches[0][untouched]).all() and torch.isnan(caches[1][untouched]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim,slices", [(1, 9, 3, 64, 2), (29, 32, 4, 128, 4), (5, 8, 8, 128, 3)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_adds_up_the_qkv_products_partial_sums_as_their_reference_sums_them(dtype, tokens, heads, kv_heads, dim,
                                                                                   slices, qk_norm, monkeypatch):
    """The qkv product as float32 partial sums over slices of K (kernels/skinny_gemm.py `linear_into_sum`):
    rope sums each of q, k and v's in order and rounds it to the product's dtype (`parts_sum_ref`), then
    runs as on the product whole: the rotated q and the KV cache bitwise those of the summed product;
    the torch reference close to them."""
    g = torch.Generator(device=DEVICE).manual_seed(tokens * heads + slices)
    n = (heads + 2 * kv_heads) * dim
    parts = torch.randn(tokens, slices, n, generator=g, device=DEVICE) * 2
    pos = torch.randint(0, 4000, (tokens,), generator=g, device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    slots = torch.randperm(64, generator=g, device=DEVICE)[:tokens]
    norms = tuple((1 + torch.randn(dim, generator=g, device=DEVICE) / 4).to(dtype) for _ in range(2)) + (1e-6,)
    norms = norms if qk_norm else None
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]
    whole = fused.parts_sum_ref(parts, dtype)
    outs = []
    runs = ((parts, (tokens, slices), False), (whole, (tokens,), False), (parts, (tokens, slices), True))
    for qkv, lead, reference in runs:  # (the kernel on the partials, on their sum, then the torch reference)
        if reference:
            monkeypatch.setattr(fused, "use_triton", lambda x: False)
        caches = [torch.full((64, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
        q, k, v = (x.view(*lead, -1, dim) for x in qkv.split(sizes, dim=-1))
        rotated = fused.rope_and_store(q, k, v, emb.cos(), emb.sin(), *caches, slots, norms, dtype,
                                       parts_dtype=dtype if qkv is parts else None)
        outs.append((rotated, caches[0][slots], caches[1][slots]))
    for a, b, ref in zip(*outs):
        assert torch.equal(a, b)
        close(a, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (19, 1536), (4, 14336), (2, 1000)])
def test_silu_mul_matches_reference(dtype, rows, inter):
    g = torch.Generator(device=DEVICE).manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g, device=DEVICE) * 3).to(dtype)
    close(fused.silu_mul(gate_up), fused.silu_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("rows,n,k,bias", [(1, 960, 576, False), (7, 3072, 576, True), (16, 576, 1536, False), (3, 100, 70, True),
                                           (17, 300, 576, True), (64, 960, 576, False), (45, 100, 70, False)])
def test_skinny_gemm_matches_linear(dtype, rows, n, k, bias):
    """Up to MAX_ROWS rows in one row tile of 16, 32 or 64 (`block_rows`)."""
    from kernels.skinny_gemm import skinny_linear

    g = torch.Generator(device=DEVICE).manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    close(skinny_linear(x, w, b), ref, dtype)


@pytest.mark.parametrize("n", [3072, 1000])
def test_weight_prefetch_leaves_the_product_bitwise_alike(monkeypatch, n):
    """The skinny product's weight prefetch before programmatic dependent launch's wait is a hint
    to the L2 cache: after a norm kernel that writes its input, eagerly and in a CUDA graph, the
    product is the same bits with it as without (n not a multiple of the tile: the last rows')."""
    from kernels import pdl, skinny_gemm

    if not ON_GPU or not pdl.supported(torch.device(DEVICE)):
        pytest.skip("the bulk prefetch is sm_90's, behind PDL's wait")
    monkeypatch.setattr(pdl, "_enabled", True)
    g = torch.Generator(device=DEVICE).manual_seed(n)
    x = torch.randn(3, 4096, generator=g, device=DEVICE).to(torch.bfloat16)
    norm = torch.rand(4096, generator=g, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(n, 4096, generator=g, device=DEVICE) / 64).to(torch.bfloat16)

    def product() -> torch.Tensor:
        return skinny_gemm.skinny_linear(fused.rms_norm(x, norm, 1e-6), w)

    assert_bitwise_alike(monkeypatch, skinny_gemm, "PREFETCH_BYTES", 0, 16 << 20, product)
    assert skinny_gemm.prefetch_row_bytes(w) > 0


def test_kernel_choice_frees_its_weight_copies():
    """The Triton-or-cuBLAS choice times each product on copies of the weight that outgrow the L2
    cache (kernels/skinny_gemm.cold_copies); none outlives it. Compared between two choices: the
    first left 64 MiB more than before it on 2 x H200, which stays, and is no whole number of
    these 12.6 MB copies."""
    from kernels import skinny_gemm

    if not ON_GPU:
        pytest.skip("the choice times CUDA graphs")
    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(2, 2048, generator=g, device=DEVICE).to(torch.bfloat16)
    w = (torch.randn(3072, 2048, generator=g, device=DEVICE) / 45).to(torch.bfloat16)
    assert len(skinny_gemm.cold_copies(w)) > 1
    held = []
    for _ in range(2):
        skinny_gemm._triton_is_faster(x.shape[0], w, None, None)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[1] == held[0]


@pytest.mark.skipif(not ON_GPU, reason=NUMPY_ORDER)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias,out_dtype", [(960, 576, True, None), (4099, 576, False, torch.float32), (70, 130, True, None)])
def test_invariant_linear_rows_are_alike_in_any_batch(dtype, n, k, bias, out_dtype):
    """Batch-invariant products: each row the same bits alone, in a few rows (the few-row kernel's
    range) or among hundreds (cuBLAS's), and near the exact product."""
    from kernels.skinny_gemm import linear

    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    x = torch.randn(300, k, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    full = linear(x, w, b, out_dtype, invariant=True)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    close(full, ref, dtype if out_dtype is None else out_dtype)
    for lo, hi in [(7, 8), (3, 13), (100, 117), (40, 240)]:
        assert torch.equal(linear(x[lo:hi], w, b, out_dtype, invariant=True), full[lo:hi]), (lo, hi)


@pytest.mark.skipif(not ON_GPU, reason=NUMPY_ORDER)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_every_invariant_tile_gives_a_row_the_same_bits(dtype, out_dtype):
    """The batch-invariant product's tile follows the rows (kernels/skinny_gemm.py), which keeps a
    row's bits only if every tile sums each output in one order: K not a multiple of any BLOCK_K."""
    from kernels.skinny_gemm import INVARIANT_TILES, invariant_linear, invariant_tile

    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(150, 320, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(4099, 320, generator=g, device=DEVICE) / 18).to(dtype)
    first, *rest = (invariant_linear(x, w, None, out_dtype, tile) for tile in INVARIANT_TILES)
    assert all(torch.equal(first, y) for y in rest)
    assert invariant_tile(1, 4099, x.device) != invariant_tile(150, 4099, x.device)  # (the rows choose)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="TMA: Hopper or later")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype,bias", [(None, True), (torch.float32, False)])
@pytest.mark.parametrize("n", [4099, 4104])
def test_the_invariant_product_by_tma_loads_has_the_pointer_loads_bits(dtype, out_dtype, bias, n, monkeypatch):
    """Many row blocks load their tiles by TMA (kernels/skinny_gemm.py), one program an SM walking
    the tiles: the same sums in the same order as the pointer loads, so the same bits; K not a
    multiple of any BLOCK_K, where TMA fills past the end with zeros as the masked loads do; a 16-bit
    output of rows TMA can address (n = 4,104) stored by TMA, clipped at the ends. Rows TMA cannot
    address take the pointer loads."""
    from kernels import skinny_gemm, tma_ready

    g = torch.Generator(device=DEVICE).manual_seed(13)
    x = torch.randn(1000, 4104, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(n, 4104, generator=g, device=DEVICE) / 64).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    assert tma_ready(x, w) and not tma_ready(x[:, 1:], w[:, 1:])  # (rows 2 bytes off)
    by_tma = skinny_gemm.invariant_linear(x, w, b, out_dtype)
    monkeypatch.setattr(skinny_gemm, "tma_ready", lambda *tensors: False)
    assert torch.equal(skinny_gemm.invariant_linear(x, w, b, out_dtype), by_tma)


@pytest.mark.parametrize("n,bias", [(99, True), (104, False), (160, True)])
def test_the_invariant_product_by_tma_walks_every_tile_in_few_programs(n, bias, monkeypatch):
    """The TMA product's programs (one an SM) each walk several tiles, here 3 programs over 5 x 4-5;
    every tile is written, the short last row and column blocks clipped, with the pointer loads' bits.
    The interpreter runs tensor descriptors too, so there TMA is allowed on any 16-byte rows."""
    from kernels import skinny_gemm

    g = torch.Generator(device=DEVICE).manual_seed(n)
    x = torch.randn(300, 136, generator=g, device=DEVICE).to(torch.float16)
    w = (torch.randn(n, 136, generator=g, device=DEVICE) / 12).to(torch.float16)
    b = torch.randn(n, generator=g, device=DEVICE).to(torch.float16) if bias else None
    tile = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    by_pointers = skinny_gemm.invariant_linear(x, w, b, tile=tile)
    if not ON_GPU:
        monkeypatch.setattr(skinny_gemm, "tma_ready", lambda *t: all(u.stride(0) * u.element_size() % 16 == 0
                                                                     for u in t))
    elif torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA: Hopper or later")
    monkeypatch.setattr(skinny_gemm, "sm_count", lambda device: 3)
    assert torch.equal(skinny_gemm.invariant_linear(x, w, b, tile=tile), by_pointers)
    expected = torch.nn.functional.linear(x.float(), w.float(), b if b is None else b.float())
    assert torch.allclose(by_pointers.float(), expected, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_invariant_product_over_many_row_blocks_writes_every_tile(dtype):
    """Many row blocks take their programs in groups (kernels/skinny_gemm.py `_tile_of_program`):
    every tile written, a short last group and a short last column block included, each row's
    bits those it has alone (on the GPU; the interpreter's sums follow the block's rows)."""
    from kernels.skinny_gemm import INVARIANT_GROUP_M, invariant_linear

    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    rows = 16 * (INVARIANT_GROUP_M + 3) + 5  # a group of 8 row blocks, then 4, the last one short
    g = torch.Generator(device=DEVICE).manual_seed(11)
    x = torch.randn(rows, 96, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(100, 96, generator=g, device=DEVICE) / 10).to(dtype)
    y = invariant_linear(x, w, None, None, tile)
    close(y, torch.nn.functional.linear(x.double(), w.double()), dtype)
    if ON_GPU:
        assert torch.equal(invariant_linear(x[150:151], w, None, None, tile), y[150:151])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("rows", [1, 9, 16, 40])
def test_float32_output_is_the_accumulator_rounded_once(dtype, rows):
    """The LM head's logits (out_dtype=float32), by the Triton kernel and by cuBLAS: within float32
    accumulation error of the exact product, far inside one bf16 step."""
    from kernels.skinny_gemm import cublas_linear, linear, skinny_linear

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    x = torch.randn(rows, 576, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(4099, 576, generator=g, device=DEVICE) / 24).to(dtype)
    ref = x.double() @ w.double().T
    outs = [linear(x, w, None, torch.float32)]
    if rows <= 16:
        outs.append(skinny_linear(x, w, None, torch.float32))
    if ON_GPU:
        outs.append(cublas_linear(x, w, None, torch.float32))
    for y in outs:
        assert y.dtype == torch.float32
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 40, 512])
@pytest.mark.parametrize("invariant", [False, True])
def test_a_float32_input_over_a_half_precision_weight_is_the_float32_product(dtype, rows, invariant):
    """--enable-fp32-lm-head's product: as exact as the float32 product over the weight's values
    (to the remainder's rounding), where rounding the input first is off by the dtype's step; at 512
    rows on the GPU, cuBLAS's two products, the second adding itself to the first."""
    from kernels.skinny_gemm import float32_input_linear, linear

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    x = torch.randn(rows, 576, generator=g, device=DEVICE)
    w = (torch.randn(1000, 576, generator=g, device=DEVICE) / 24).to(dtype)
    want = x.double() @ w.double().T
    error = lambda y: ((y.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
    got = float32_input_linear(x, w, invariant)
    assert got.dtype == torch.float32 and got.shape == (rows, 1000)
    rounded_first = linear(x.to(dtype), w, out_dtype=torch.float32, invariant=invariant)
    assert error(got) < 1e-4 and error(got) < error(rounded_first) / 20, (error(got), error(rounded_first))


def _one_rank_buffers(slot: int):
    """A group of one's buffer (two halves of a slot), flags and epochs (8 rows), and a tensor's pointer as the
    kernels take them."""
    buffer = torch.zeros(2 * slot, dtype=torch.uint8, device=DEVICE)
    flags = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    epochs = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    return buffer, flags, epochs, lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("float32_islands", [False, True])
@pytest.mark.parametrize("round_once", [False, True])
def test_all_reduce_norm_over_one_rank_is_the_residual_norm_call_after_call(dtype, float32_islands, round_once):
    """kernels/all_reduce_norm.py with a group of one (its own buffer and flags: no peers needed):
    the residual RMSNorm bit for bit, while the calls' epochs advance and their halves alternate.
    Its sums over 2-4 GPUs: tests/test_all_reduce_norm_gpu.py."""
    from kernels.all_reduce_norm import all_reduce_rms_norm

    slot = 8 * 512 * 4  # (8 rows of 512, float32)
    buffer, flags, epochs, pointers = _one_rank_buffers(slot)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    w = (1 + torch.randn(300, generator=g, device=DEVICE) / 4).to(dtype)
    last = {}  # (half, row) -> the row last written there: a row's calls alternate halves, from half 1
    for rows in (3, 1, 3, 8):  # (row 0 in every call; rows 1-2 in three, rows 3-7 in one)
        x = (torch.randn(rows, 300, generator=g, device=DEVICE) * 3).to(dtype)
        # (a float32 residual stream and a float32 norm out: the islands, as the final norm takes them)
        r = torch.randn(rows, 300, generator=g, device=DEVICE).to(torch.float32 if float32_islands else dtype)
        out_dtype = torch.float32 if float32_islands else None
        calls = epochs.tolist()
        out, summed = all_reduce_rms_norm(x, r, w, 1e-5, pointers(buffer), slot, pointers(flags), epochs, 0, out_dtype,
                                          round_once)
        want_out, want_sum = fused.rms_norm(x, w, 1e-5, r, out_dtype, round_once)
        assert torch.equal(summed, want_sum) and torch.equal(out, want_out)
        last.update({((calls[i] + 1) % 2, i): x[i] for i in range(rows)})
    assert epochs.tolist() == [4, 3, 3, 1, 1, 1, 1, 1] and flags.tolist() == epochs.tolist()
    halves = buffer.view(2, slot)
    for (half, i), row in last.items():
        assert torch.equal(halves[half].view(dtype)[i * 300 : (i + 1) * 300], row), (half, i)


def test_all_reduce_sum_over_one_rank_takes_turns_with_the_norm_on_its_buffer():
    """float16's plain all-reduce (the kernel without the norm, in place) over a group of one: each
    row unchanged bit for bit, its calls and the fused kernel's counted on the same epochs and flags."""
    from kernels.all_reduce_norm import all_reduce_rms_norm, all_reduce_sum

    dtype = torch.float16
    slot = 8 * 512 * 2
    buffer, flags, epochs, pointers = _one_rank_buffers(slot)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    w = (1 + torch.randn(300, generator=g, device=DEVICE) / 4).to(dtype)
    for kind, rows in (("norm", 3), ("sum", 5), ("norm", 1), ("sum", 2)):
        x = (torch.randn(rows, 300, generator=g, device=DEVICE) * 3).to(dtype)
        if kind == "sum":
            got = all_reduce_sum(x.clone(), pointers(buffer), slot, pointers(flags), epochs, 0)
            assert torch.equal(got, x)
        else:
            r = torch.randn(rows, 300, generator=g, device=DEVICE).to(dtype)
            out, summed = all_reduce_rms_norm(x, r, w, 1e-5, pointers(buffer), slot, pointers(flags), epochs, 0)
            want_out, want_sum = fused.rms_norm(x, w, 1e-5, r)
            assert torch.equal(summed, want_sum) and torch.equal(out, want_out)
    assert epochs.tolist() == [4, 3, 2, 1, 1, 0, 0, 0] and flags.tolist() == epochs.tolist()
