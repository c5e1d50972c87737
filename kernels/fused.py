"""Fused elementwise kernels for the decoder: RMSNorm (+ residual add), RoPE (+ KV write), SiLU-and-mul.

On the GPU a small model's decode step is launch-bound: the torch versions of these take
5-10 kernels each, per layer. Each function here is one Triton kernel on CUDA and the
plain torch reference elsewhere; the two agree to the rounding transformers does, since
the kernels round intermediates to the activation dtype where transformers does.
"""

from __future__ import annotations

import torch

from kernels import INTERPRET, pdl

try:
    import triton
    import triton.language as tl

    TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
except ImportError:  # CPU-only installs: the torch references below are used
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or INTERPRET)


# ---------------- torch references ----------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
                 round_once: bool = False) -> torch.Tensor:
    """transformers' RMSNorm: the normalised input rounded to the output's dtype, then times the weight
    (`round_once`: times the weight in float32, rounded once)."""
    dtype = out_dtype or x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if round_once:
        return (weight.float() * x).to(dtype)
    return (weight * x.to(dtype)).to(dtype)


def parts_sum_ref(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, parts, n] -> [rows, n]: each row's parts summed in order in float32, rounded once to `dtype`."""
    total = parts[:, 0].float()
    for j in range(1, parts.shape[1]):
        total = total + parts[:, j]
    return total.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] float32."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---------------- dispatch ----------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, round_once: bool = False):
    """norm(x) or, with `residual`, (norm(x + residual), x + residual): the residual add fused in.
    The sum is kept in the residual's dtype (a float32 residual stream: `--enable-fp32-residual`),
    the norm rounded to `out_dtype` (default x's; float32 for a float32 LM head's input), twice as
    transformers rounds it or, `round_once`, once (`rms_norm_ref`). A 3-D `x` [rows, parts, n] is the
    terms of a sum: a product's float32 partial sums over slices of K (`skinny_gemm.linear_into_sum`)
    or a mixture of experts' weighted picks in the dtype (`fused_moe.layer(into_sum=True)`): each row's
    parts summed in order in float32 and rounded to the residual's dtype (the product's or the layer's
    own output, `parts_sum_ref`) before the add; it needs the residual, whose dtype is then the norm's
    default."""
    parts = x.shape[1] if x.dim() == 3 else 0  # (0: a whole product, not partial sums)
    if x.dim() == 3 and residual is None:
        raise ValueError("a product's partial sums are added to a residual: pass it")
    out_dtype = out_dtype or (residual.dtype if x.dim() == 3 else x.dtype)
    if not use_triton(x):
        x = parts_sum_ref(x, residual.dtype) if x.dim() == 3 else x
        if residual is None:
            return rms_norm_ref(x, weight, eps, out_dtype, round_once)
        summed = (x + residual).to(residual.dtype)
        return rms_norm_ref(summed, weight, eps, out_dtype, round_once), summed
    rows, n = x.shape[0], x.shape[-1]
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    summed = torch.empty((rows, n), dtype=residual.dtype, device=x.device) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed,
            x.stride(0), x.stride(1) if parts else 0, residual.stride(0) if residual is not None else 0, n, eps,
            PARTS=parts, HAS_RESIDUAL=residual is not None, ROUND_ONCE=round_once, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), **pdl.launch_args(),
        )
    return out if residual is None else (out, summed)


def rope_and_store(
    q: torch.Tensor,  # [T, num_heads, head_dim], may be a strided view into the qkv projection
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim] float32, at the tokens' positions
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,  # [T] int64
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    out_dtype: torch.dtype | None = None,
    parts_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RoPE on q and k, and the rotated k with v written into the KV cache: one kernel on the GPU.
    `qk_norm`: q's and k's RMSNorm weights over a head and their eps (Qwen3's), each head
    normalised first in the same kernel (two launches a layer fewer than the norms apart).
    With `parts_dtype`, q, k and v are [T, parts, heads, head_dim] views of the qkv product's float32
    partial sums over slices of K (`skinny_gemm.linear_into_sum`): each summed in order and rounded to
    `parts_dtype` (`parts_sum_ref`) where the kernel loads it, then as the product's output.

    Returns the rotated q [T, num_heads, head_dim], rounded to `out_dtype` (default q's: a float32
    q of --enable-fp32-activations is rotated in float32, then rounded once for attention).
    """
    if parts_dtype is not None:
        if use_triton(q):
            return _rope_and_store_kernel(q, k, v, cos, sin, k_cache, v_cache, out_slots, qk_norm,
                                          out_dtype or parts_dtype, parts_dtype)
        q, k, v = (parts_sum_ref(x.flatten(2), parts_dtype).view(x.shape[0], *x.shape[2:]) for x in (q, k, v))
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not use_triton(q):
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            q = rms_norm_ref(q.reshape(-1, dim), q_weight, eps).view(tokens, heads, dim)
            k = rms_norm_ref(k.reshape(-1, dim), k_weight, eps).view(tokens, kv_heads, dim)
        k_cache.index_copy_(0, out_slots, rope_ref(k, cos, sin).to(k_cache.dtype))
        v_cache.index_copy_(0, out_slots, v.to(v_cache.dtype))
        return rope_ref(q, cos, sin).to(out_dtype or q.dtype)
    return _rope_and_store_kernel(q, k, v, cos, sin, k_cache, v_cache, out_slots, qk_norm, out_dtype or q.dtype)


def _rope_and_store_kernel(q, k, v, cos, sin, k_cache, v_cache, out_slots, qk_norm, out_dtype,
                           parts_dtype=None) -> torch.Tensor:
    """`rope_and_store`'s launch: q, k, v [T, heads, head_dim], or [T, parts, heads, head_dim] partial sums
    rounded to `parts_dtype`."""
    tokens, heads, dim = q.shape[0], q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    parts = q.shape[1] if q.dim() == 4 else 0
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # (pointers unread without the norm)
    out = torch.empty((tokens, heads, dim), dtype=out_dtype, device=q.device)
    if tokens:
        _rope_store_kernel[(tokens,)](
            q, k, v, cos, sin, out, k_cache, v_cache, out_slots, q_weight, k_weight, eps,
            q.stride(0), q.stride(-2), k.stride(0), k.stride(-2), v.stride(0), v.stride(-2),
            q.stride(1) if parts else 0, k.stride(1) if parts else 0, v.stride(1) if parts else 0, cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            heads, kv_heads, HALF=dim // 2, QK_NORM=qk_norm is not None, PARTS=parts,
            PART_DTYPE=TL_DTYPES[parts_dtype] if parts else tl.float32,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads), num_warps=4,
            # (LLVM turns a product rounded to a 16-bit dtype, then added, into a 16-bit multiply and add, then
            # fuses them into one FMA where its instruction selection likes: the product unrounded, and bits that
            # depend on how q was loaded. Unfused, each product is rounded as eager torch rounds it.)
            enable_fp_fusion=False, **pdl.launch_args(),
        )
    return out


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * inter] laid out as [gate | up], rounded to `out_dtype`
    (default gate_up's)."""
    if not use_triton(gate_up):
        return silu_mul_ref(gate_up).to(out_dtype or gate_up.dtype)
    rows, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((rows, inter), dtype=out_dtype or gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4, **pdl.launch_args()
        )
    return out


# ---------------- kernels ----------------
if triton is not None:

    @triton.jit
    def _summed(x_ptrs, stride_part, ok, PARTS: tl.constexpr, dtype: tl.constexpr):
        """The tile at x_ptrs; with PARTS > 0, the terms of a sum `stride_part` apart (a product's float32
        partial sums, a mixture of experts' picks), added up in order in float32 and rounded to `dtype`
        (`parts_sum_ref`)."""
        x = tl.load(x_ptrs, mask=ok, other=0.0)
        if PARTS > 0:
            x = x.to(tl.float32)
            for j in tl.static_range(1, PARTS):
                x += tl.load(x_ptrs + j * stride_part, mask=ok, other=0.0).to(tl.float32)
            x = x.to(dtype)
        return x

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_part, stride_r, n, eps,
                         PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_ONCE: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        # (a sum's terms rounded to the residual's dtype: the product's or the layer's own output)
        x = _summed(x_ptr + row * stride_x + cols, stride_part, ok, PARTS, res_ptr.dtype.element_ty).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        if HAS_RESIDUAL:
            # The sum is rounded to the residual's dtype, as an eager `x + residual` is (none for a float32 residual).
            x += tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            x = x.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * n + cols, x, mask=ok)
            x = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = x * inv
        if not ROUND_ONCE:
            y = y.to(dtype).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (y * w.to(tl.float32)).to(dtype), mask=ok)

    @triton.jit
    def _summed_halves(x_ptrs, stride_part, ok, HALF: tl.constexpr, PARTS: tl.constexpr, dtype: tl.constexpr):
        """The two halves of the [heads, 2 * HALF] tile at x_ptrs, each `_summed`."""
        d = tl.arange(0, HALF)[None, :]
        return (_summed(x_ptrs + d, stride_part, ok, PARTS, dtype),
                _summed(x_ptrs + HALF + d, stride_part, ok, PARTS, dtype))

    @triton.jit
    def _head_norm(x1, x2, w_ptr, eps, HALF: tl.constexpr):
        """Each head's [x1 | x2] through RMSNorm over the head, rounded as _rms_norm_kernel rounds:
        the normalised values to x's dtype, times the weight, rounded again."""
        dtype = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        d = tl.arange(0, HALF)[None, :]
        w1, w2 = tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + HALF + d).to(tl.float32)
        return ((a * inv).to(dtype).to(tl.float32) * w1).to(dtype), ((b * inv).to(dtype).to(tl.float32) * w2).to(dtype)

    @triton.jit
    def _rotate(x1, x2, c, s):
        """Rotated halves, rounded like the eager `x * cos + rotate_half(x) * sin`: each product to
        x's dtype, then the sum."""
        dtype = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        c, s = c.to(dtype).to(tl.float32), s.to(dtype).to(tl.float32)
        lo = (a * c).to(dtype).to(tl.float32) + (-b * s).to(dtype).to(tl.float32)
        hi = (b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)
        return lo.to(dtype), hi.to(dtype)

    @triton.jit
    def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, slots_ptr, qw_ptr, kw_ptr, eps,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qp, stride_kp, stride_vp, stride_c,
        stride_kcs, stride_kch, stride_vcs, stride_vch,
        heads, kv_heads, HALF: tl.constexpr, QK_NORM: tl.constexpr, PARTS: tl.constexpr, PART_DTYPE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
    ):
        """PARTS > 0: q, k and v are a product's float32 partial sums, each rounded to PART_DTYPE (`_summed`)."""
        pdl.wait_for_previous(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        # cos/sin repeat after HALF (emb = cat(freqs, freqs))
        c = tl.load(cos_ptr + t * stride_c + d)
        s = tl.load(sin_ptr + t * stride_c + d)

        h = tl.arange(0, BLOCK_H)[:, None]
        ok = h < heads
        x1, x2 = _summed_halves(q_ptr + t * stride_qt + h * stride_qh, stride_qp, ok, HALF, PARTS, PART_DTYPE)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, qw_ptr, eps, HALF)
        lo, hi = _rotate(x1, x2, c, s)
        q_out = q_out_ptr + t * heads * 2 * HALF + h * 2 * HALF
        tl.store(q_out + d, lo.to(q_out_ptr.dtype.element_ty), mask=ok)  # (q rotated in its dtype, rounded to out's)
        tl.store(q_out + HALF + d, hi.to(q_out_ptr.dtype.element_ty), mask=ok)

        g = tl.arange(0, BLOCK_KV)[:, None]
        ok = g < kv_heads
        x1, x2 = _summed_halves(k_ptr + t * stride_kt + g * stride_kh, stride_kp, ok, HALF, PARTS, PART_DTYPE)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, kw_ptr, eps, HALF)
        lo, hi = _rotate(x1, x2, c, s)
        k_out = kc_ptr + slot * stride_kcs + g * stride_kch
        tl.store(k_out + d, lo.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(k_out + HALF + d, hi.to(kc_ptr.dtype.element_ty), mask=ok)
        dd = tl.arange(0, 2 * HALF)[None, :]
        v = _summed(v_ptr + t * stride_vt + g * stride_vh + dd, stride_vp, ok, PARTS, PART_DTYPE)
        tl.store(vc_ptr + slot * stride_vcs + g * stride_vch + dd, v.to(vc_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_r, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gu_ptr + row * stride_r + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * stride_r + inter + cols, mask=ok, other=0.0)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * up.to(tl.float32)).to(dtype).to(out_ptr.dtype.element_ty), mask=ok)
