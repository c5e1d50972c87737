"""Matrix products with few rows (decode and verify steps): y = x @ w.T (+ b) for x [M <= 16, K].

At decode, a linear layer reads its whole weight to produce a handful of rows, so it should
run at memory bandwidth; for small layers what matters is the fixed cost of a launch. The
Triton kernel below streams the weight once through one tile of 16 rows. Whether it or
cuBLAS is faster depends on the shape, so the first call for each (N, K, dtype) times both,
back to back inside a CUDA graph as steps run them, and keeps the faster: this path is never
slower than `F.linear` beyond timing noise. That first call must happen outside CUDA-graph
capture (the runner's warm-up does it). `norm_linear` also takes the RMSNorm before a product
(and its residual add) into the same kernel: one launch fewer, twice per decoder layer.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import fused, pdl

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16
GRAPH_CALLS = 20  # calls in the CUDA graph that times a choice
CPU_BLOCK_ROWS = 8
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_use_triton: dict[tuple, bool] = {}  # (N, K, dtype, has_bias, PDL) -> Triton beat cuBLAS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and not INTERPRET:
        return _cpu_linear(x, weight, bias)
    return skinny_linear(x, weight, bias) if takes_triton(x, weight, bias) else F.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): fused.rms_norm, then `linear`. Where the
    skinny GEMM serves the product, one kernel: every program normalises the rows itself (they
    are short), and the first also writes the sum, the residual stream's next value."""
    if x.device.type != "cpu" or INTERPRET:
        if takes_triton(x, weight, bias) and (residual is None or residual.stride(1) == 1):
            return _skinny(x, weight, bias, (residual, norm_weight, eps))
    if residual is None:
        return linear(fused.rms_norm(x, norm_weight, eps), weight, bias), x
    h, summed = fused.rms_norm(x, norm_weight, eps, residual)
    return linear(h, weight, bias), summed


def takes_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear(x, weight, bias)` runs the Triton kernel (timed against cuBLAS once per shape)."""
    usable = (
        triton is not None and (x.is_cuda or INTERPRET) and x.dim() == 2 and x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
    )  # float32 stays with cuBLAS: tl.dot would round its inputs to tf32
    if not usable:
        return False
    key = (weight.shape[0], weight.shape[1], x.dtype, bias is not None, pdl.enabled())
    choice = _use_triton.get(key)
    if choice is None:
        choice = _use_triton[key] = INTERPRET or _triton_is_faster(x, weight, bias)
    return choice


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in blocks of exactly CPU_BLOCK_ROWS rows (the last one padded). CPU BLAS picks
    its kernel, and with it each row's rounding, by the row count (on AVX-512 MKL up to ~20
    rows); in equal blocks a row's result depends on nothing else in the step, so a verify
    step reproduces plain decoding bit for bit (tests compare speculation on and off)."""
    rows = x.shape[0]
    if x.dim() != 2 or rows == 0:
        return F.linear(x, weight, bias)
    pad = -rows % CPU_BLOCK_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([F.linear(block, weight, bias) for block in x.split(CPU_BLOCK_ROWS)])[:rows]


def _triton_is_faster(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    probe = torch.randn(MAX_ROWS, x.shape[1], dtype=x.dtype, device=x.device)
    ours = graph_ms(lambda: skinny_linear(probe, weight, bias))
    theirs = graph_ms(lambda: F.linear(probe, weight, bias))
    return ours < theirs


def graph_ms(fn) -> float:
    """Milliseconds per call of `fn` replayed back to back inside a CUDA graph, as steps run it.
    Timing single calls would count a launch overhead that graphs do not have, and can pick
    the kernel that is slower inside the graph."""
    fn()  # compile (and autotune) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=20, return_mode="median") / GRAPH_CALLS


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _skinny(x, weight, bias, None)[0]


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            norm: tuple[torch.Tensor | None, torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton product, with the input rows RMS-normalised first when `norm` = (residual or
    None, norm weight, eps); returns (y, the normalised rows' sum with the residual, or x)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual, norm_weight, eps = norm if norm is not None else (None, weight, 0.0)
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else x
    if m == 0:
        return y, summed
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (x, residual if residual is not None else x, norm_weight, summed, weight,
            bias if bias is not None else weight, y, m, n, k, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), y.stride(0))
    flags = dict(NORM=norm is not None, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS)
    if INTERPRET:  # the interpreter cannot time configurations
        _skinny_gemm_kernel[grid](*args, **flags, BLOCK_N=32, BLOCK_K=64, PDL=False)
    else:
        _skinny_gemm_tuned[grid](*args, **flags, **pdl.launch_args())
    return y, summed


if triton is not None:

    @triton.jit
    def _norm_input(x_ptr, r_ptr, rows, kk, ok, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr):
        """A tile of x, or of x + residual rounded to x's dtype as an eager sum is."""
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + rows[:, None] * stride_rm + kk[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, r_ptr, nw_ptr, s_ptr, w_ptr, b_ptr, y_ptr, m, n, k, eps,
                            stride_xm, stride_rm, stride_wn, stride_ym,
                            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < m
        if NORM:  # the rows' inverse RMS (as fused.rms_norm, up to the order of the fp32 sum)
            sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                kk = k0 + ks
                ok = row_ok[:, None] & (kk[None, :] < k)
                x = _norm_input(x_ptr, r_ptr, rows, kk, ok, stride_xm, stride_rm, HAS_RESIDUAL)
                if HAS_RESIDUAL:  # the first program writes the residual stream's next value
                    tl.store(s_ptr + rows[:, None] * k + kk[None, :], x, mask=ok & (tl.program_id(0) == 0))
                xf = x.to(tl.float32)
                sum_sq += tl.sum(xf * xf, axis=1)
            inv = tl.rsqrt(sum_sq / k + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + ks
            ok = row_ok[:, None] & (kk[None, :] < k)
            if NORM:
                x = _norm_input(x_ptr, r_ptr, rows, kk, ok, stride_xm, stride_rm, HAS_RESIDUAL)
                dtype = x.dtype
                nw = tl.load(nw_ptr + kk, mask=kk < k, other=0.0).to(tl.float32)
                x = ((x.to(tl.float32) * inv[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype)
            else:
                x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=ok, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < n) & (kk[None, :] < k),
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < n))

    _skinny_gemm_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3),
                                  (64, 64, 4, 4), (128, 64, 8, 3), (16, 512, 4, 2)]
        ],
        key=["n", "k", "NORM"],
    )(_skinny_gemm_kernel)
