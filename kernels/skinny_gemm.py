"""Matrix products with few rows (decode and verify steps): y = x @ w.T (+ b) for x [M <= 64, K].

At decode, a linear layer reads its whole weight to produce a handful of rows, so it should run at
memory bandwidth; for small layers what matters is the fixed cost of a launch. The Triton kernel
below streams the weight once through one tile of rows (16, 32 or 64: `block_rows`). Whether it or
cuBLAS is faster depends on the shape and the rows (on an H200, Triton wins the 8B shape's products
at TP2 for one row and cuBLAS for 16), so the first call for each (N, K, dtype) and power of two of
rows times both as steps run them and keeps the faster: inside a CUDA graph, each product after a
norm kernel (under programmatic dependent launch the Triton kernel is placed behind that kernel,
cuBLAS's only after it), on copies of the weight that outgrow the L2 cache (a step reads each
layer's weights once). Timed back to back on one weight, the small products ran from L2, which no
step sees (bench/RESULTS.md, tensor parallelism). That first call must happen outside CUDA-graph
capture (the runner's warm-up does it). The RMSNorm before a product stays its own kernel: fused
into this one, every program normalised the rows again before streaming its tile, and on the H100
that cost more than a launch (Llama-3.1-8B's gate/up at TP2: 58 us fused, 43 us apart:
bench/results/tp-20261127b/gemm-norm-h100.log, from bench/gemm_choice.py before the fused path was
removed).

Batch-invariant products (`invariant=True`: deterministic inference, coupled sampling): a row of
the result is the same bits whatever else is in the step. cuBLAS picks its kernel, and with it
each row's summation order, by the row count, and the few-row path above is a different kernel
again, so a row verified beside a draft tree came out in different last bits than the same row
decoded alone, and two coupled samples parted there. The invariant path runs one Triton kernel
that never splits K: each output sums its products in K's order, a tensor-core instruction's
16 at a time into one float32 accumulator, whatever the tile. So the tile may follow the rows
(the largest of INVARIANT_TILES whose programs fill the GPU once): on an H200 every candidate
tile gave every output the same bits, bf16 and fp16, to either output dtype (`python
bench/invariant_tiles.py --across`), and the GPU tests hold rows to it across the tiles. A
product of more than one row block of 16-bit inputs on Hopper loads its tiles by TMA (tensor
descriptors) instead of masked pointer loads, in one program an SM walking the tiles, and stores
its tile by TMA where the output is 16-bit: the same sums in the same order, so the same bits
(`bench/probes/invariant_tma.py`), and a prefill chunk's products (the 8B shape's 32 layers at
4,096 rows in one graph) at 0.99x of cuBLAS, against 0.84x a program a tile (`--stack`). A step
of one row block keeps the pointer loads, whose weight prefetch under PDL serves decode.

Weight prefetch under programmatic dependent launch: the weight is no output of the kernel
before, so a product placed on the SMs while that kernel still runs asks the L2 cache for the
head of each of its weight rows (PREFETCH_BYTES over the whole weight, in bulk prefetches)
before it waits. The kernels before a product at decode (the norm or all-reduce + norm,
attention, silu) use little of the memory's bandwidth, which the prefetch then fills. Loads
and sums are unchanged: the result is bitwise the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import INTERPRET, fused, pdl, sm_count, tma_ready

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    triton = None

# rows up to which a product may take the few-row kernels (the skinny product, the split-K partials), in one row tile:
# at 64 rows cuBLAS read Qwen3-30B-A3B's o product at 1.7 TB/s with its split-K's reduce kernel; the split-K partials
# into the norm took 7.0 us a layer against 9.7, and the b64 decode step 1.03x (the 8B shape's 1.04x; bench/RESULTS.md)
MAX_ROWS = 64
MIN_BLOCK_ROWS = 16  # the smallest row tile (a tensor-core product's)
INVARIANT_TILES = [  # largest first (bench/invariant_tiles.py timed them against cuBLAS on an H200)
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
]
INVARIANT_GROUP_M = 8  # row blocks whose programs take a column block in turn (invariant_linear, many rows)
GRAPH_CALLS = 20  # calls in the CUDA graph that times a choice
MAX_COLD_COPIES = 1024  # weights a choice is timed on, at most (cold_copies)
CPU_BLOCK_ROWS = 8
# a weight's rows that one pass of the CPU's blocks reads (_cpu_linear): the default model's decode 1.29x / 1.32x / 1.91x
# at b1 / b8 / b64 against 4 MiB on the 2-core machine; 512 KiB 1.33x / 1.39x / 1.89x (bench/probes/cpu_chunks.py)
CPU_WEIGHT_CHUNK_BYTES = 1 << 20
PREFETCH_BYTES = 16 << 20  # weight a product prefetches into L2 before its wait (bench/gemm_choice.py)
_use_triton: dict[tuple, bool] = {}  # (N, K, rows, dtype, out dtype, has_bias, PDL) -> Triton beat cuBLAS
# slices of K a few-row product into a norm may take (bench/probes/split_k_partials.py: 2 or 4 were best on an H200)
SPLIT_K_CANDIDATES = (2, 4)
_split_k: dict[tuple, int] = {}  # (N, K, rows, dtype, PDL) -> the fastest slices of K, 0 for `linear`'s product


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, invariant: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias), accumulated in float32 and rounded once to `out_dtype` (default: x's),
    on the CPU too (`_cpu_product`). `invariant`: each row's bits independent of the other rows
    (the CPU's blocks always are)."""
    if x.device.type == "cpu" and not INTERPRET:
        return _cpu_product(x, weight, bias, out_dtype or x.dtype)
    if invariant and triton is not None:
        return invariant_linear(x, weight, bias, out_dtype)
    if takes_triton(x, weight, bias, out_dtype):
        return skinny_linear(x, weight, bias, out_dtype)
    return cublas_linear(x, weight, bias, out_dtype)


def linear_into_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a product whose one consumer adds up partial sums: the residual add + RMSNorm
    (`fused.rms_norm`: the o and down products) or RoPE + the KV write (`fused.rope_and_store`: qkv).
    On the GPU a product of few rows may come out as float32 partial sums over slices of K,
    [rows, slices, n], which the consumer adds up in order and rounds to the dtype where it loads
    them (a few-row product reads its weight faster split over K, and this split needs no reduce
    kernel of its own: cuBLAS's split-K launches one). Timed once per shape against `linear`, each
    with a norm after it as a step runs them (for qkv a stand-in for rope, reading the same
    partials); else `linear`'s [rows, n]."""
    slices = split_k_slices(x, weight)
    return split_k_partials(x, weight, slices) if slices else linear(x, weight)


def split_k_slices(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The slices of K `linear_into_sum` takes for this product (0: none, `linear`'s product)."""
    rows = _few_rows(x, weight) if x.is_cuda and x.dtype == weight.dtype else 0
    if not rows:
        return 0
    key = (weight.shape[0], weight.shape[1], rows, x.dtype, pdl.enabled())
    slices = _split_k.get(key)
    if slices is None:
        slices = _split_k[key] = _fastest_split_k(rows, weight)
    return slices


def _fastest_split_k(rows: int, weight: torch.Tensor) -> int:
    """Each way of `linear_into_sum`, its norm after it, timed as a step runs them (`after_kernel_ms`)."""
    copies = cold_copies(weight)
    n, k = weight.shape
    g = torch.Generator(device=weight.device).manual_seed(0)
    residual = torch.randn(rows, n, generator=g, device=weight.device).to(weight.dtype)
    norm_weight = torch.rand(n, generator=g, device=weight.device).to(weight.dtype)

    def then_norm(slices: int):
        def product(x, w, bias, out_dtype):
            fused.rms_norm(split_k_partials(x, w, slices) if slices else linear(x, w), norm_weight, 1e-6, residual)
        return product

    times = {slices: after_kernel_ms(then_norm(slices), k, copies, rows=rows) for slices in (0, *SPLIT_K_CANDIDATES)}
    return min(times, key=times.get)


def split_k_partials(x: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """[rows, slices, n] float32: x @ weight.T summed over each of `slices` slices of K (equal, in
    whole BLOCK_K tiles), one program a column block and slice; at most MAX_ROWS rows, in one row tile."""
    m, k = x.shape
    n = weight.shape[0]
    parts = torch.empty((m, slices, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return parts
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), slices)  # noqa: E731
    args = (x, weight, parts, m, n, k, x.stride(0), weight.stride(0))
    if INTERPRET:  # the interpreter cannot time configurations
        _split_k_kernel[grid](*args, SLICES=slices, BLOCK_M=block_rows(m), BLOCK_N=32, BLOCK_K=64, PDL=False)
    else:
        _split_k_tuned[grid](*args, SLICES=slices, BLOCK_M=block_rows(m), **pdl.launch_args())
    return parts


def float32_input_linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x (float32) @ weight.T to float32 over a weight in half precision, without a float32 copy of
    the weight: x as its value rounded to the weight's dtype plus the remainder rounded again (16 of
    float32's 24 bits in bfloat16, 22 in float16), the two halves' products summed in float32.
    Few rows go as one product over both halves stacked (it reads the weight once for twice the
    rows: about the cost of one), then a kernel adds the halves; many rows (`halves_apart`) as two
    cuBLAS products, the second adding itself to the first in its epilogue. (The CPU takes the
    float32 product itself.)"""
    if x.dtype == weight.dtype or (x.device.type == "cpu" and not INTERPRET):
        return linear(x, weight, out_dtype=torch.float32, invariant=invariant)
    high = x.to(weight.dtype)
    low = (x - high.float()).to(weight.dtype)
    if invariant or not x.is_cuda or not halves_apart(x.shape[0], weight):
        y = linear(torch.cat([high, low]), weight, out_dtype=torch.float32, invariant=invariant)
        return y[: x.shape[0]] + y[x.shape[0] :]
    y = torch.mm(high, weight.t(), out_dtype=torch.float32)
    return torch.addmm(y, low, weight.t(), out_dtype=torch.float32, out=y)


def halves_apart(rows: int, weight: torch.Tensor) -> bool:
    """Whether `float32_input_linear` takes two products: where adding the stacked halves' outputs
    (16 bytes a row and output: two read, one written, and the second half's own write) costs more
    than reading the weight again (2 bytes a column and output) and the first product once more in
    the second's epilogue (4 bytes a row and output). At 512 rows over the default model's LM head
    the adding took 73 of the 126 us that the float32 input added to a step (bench/RESULTS.md)."""
    return rows * 6 > weight.shape[1]


def _cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`linear` on the CPU, rounded as on the GPU: the CPU's half-precision products round their
    output to their inputs' dtype, and its float16 one takes 5x bf16's time (and was the noisier:
    the default model's mismatch 0.0044, not 0.0038). So only a bf16 (or float32) product into its
    own dtype runs as it is; the rest over float32 copies, rounded once to `out_dtype`."""
    if x.dtype == weight.dtype == out_dtype and x.dtype != torch.float16:
        return _cpu_linear(x, weight, bias)
    return _cpu_linear(x.float(), weight.float(), None if bias is None else bias.float()).to(out_dtype)


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype | None) -> torch.Tensor:
    if out_dtype in (None, x.dtype):
        return F.linear(x, weight, bias)
    if not x.is_cuda:  # (Triton's interpreter: aten's mm to another dtype is CUDA's)
        return F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
    y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype)  # (rounded once, from the accumulator)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def takes_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype | None = None) -> bool:
    """Whether `linear(x, weight, bias, out_dtype)` runs the Triton kernel (timed against cuBLAS once per shape)."""
    rows = _few_rows(x, weight) if x.is_cuda or INTERPRET else 0
    if not rows:
        return False
    key = (weight.shape[0], weight.shape[1], rows, x.dtype, out_dtype, bias is not None, pdl.enabled())
    choice = _use_triton.get(key)
    if choice is None:
        choice = _use_triton[key] = INTERPRET or _triton_is_faster(rows, weight, bias, out_dtype)
    return choice


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The power of two of rows a few-row Triton product of `x` is timed and chosen at, or 0 where none
    runs: no Triton, not 2-D, more than MAX_ROWS rows, strided, or float32 (which stays with cuBLAS:
    tl.dot would round its inputs to tf32)."""
    usable = (
        triton is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1 and weight.stride(1) == 1
    )
    return triton.next_power_of_2(x.shape[0]) if usable else 0


def block_rows(rows: int) -> int:
    """The row tile of a few-row product of `rows` rows: their power of two, at least MIN_BLOCK_ROWS."""
    return max(MIN_BLOCK_ROWS, triton.next_power_of_2(rows))


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in blocks of exactly CPU_BLOCK_ROWS rows (the last one padded). CPU BLAS picks
    its kernel, and with it each row's rounding, by the row count (on AVX-512 MKL up to ~20
    rows); in equal blocks, each one thread's (`_block_products`), a row's result depends on
    nothing else in the step, so a verify step reproduces plain decoding bit for bit (tests
    compare speculation on and off) at any thread count."""
    rows = x.shape[0]
    if x.dim() != 2 or rows == 0:
        return F.linear(x, weight, bias)
    pad = -rows % CPU_BLOCK_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    blocks = x.view(-1, CPU_BLOCK_ROWS, x.shape[1])
    # (an even number: `_block_products` may halve a chunk's columns)
    chunk_rows = max(2, CPU_WEIGHT_CHUNK_BYTES // (weight.shape[1] * weight.element_size()) // 2 * 2)
    if weight.shape[0] <= 2 * chunk_rows:
        return _block_products(blocks, weight, bias).view(-1, weight.shape[0])[:rows]
    # a weight larger than the cache's share (an LM head, an MLP's), each block reading all of it, ran at
    # DRAM speed: a chunk of its rows at a time, every block over it while it is in the cache (with the
    # blocks batched, 3.3-3.7x at 72-256 rows: bench/probes/cpu_blocks.py). Chunked at any row count:
    # the products' shapes, and so a row's bits, stay the step's own.
    chunks = weight.split(chunk_rows)
    biases = [None] * len(chunks) if bias is None else bias.split(chunk_rows)
    out = torch.cat([_block_products(blocks, w, b) for w, b in zip(chunks, biases)], dim=-1)
    return out.view(-1, weight.shape[0])[:rows]


def _block_products(blocks: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[B, CPU_BLOCK_ROWS, N]: each block times weight.T (+ bias), the bits of F.linear on the block
    alone on one thread. In float32 one batched product (MKL runs each block with the small-M
    kernel: 1.4-1.7x faster at 72-256 rows than a call a block, bench/probes/cpu_blocks.py); bf16's
    batched product is 6x slower than its calls a block."""
    n = blocks.shape[0]
    if blocks.dtype != torch.float32:
        return torch.stack([F.linear(block, weight, bias) for block in blocks])
    if n == 1 and torch.get_num_threads() > 1:
        # one block alone: MKL would spread its product over the threads, with other sums than the one thread each
        # block of a batch gets (the bits then depended on the batch); as two entries of halved columns, or where
        # the columns are odd the block twice, each entry is one thread's, the batch's bits (the same as the whole
        # columns': MKL's one-thread sums do not depend on N)
        rows, cols = blocks.shape[1], weight.shape[0]
        if cols % 2:
            return _block_products(blocks.expand(2, -1, -1), weight, bias)[:1]
        halves = weight.reshape(2, cols // 2, -1).transpose(1, 2)
        if bias is None:
            out = torch.bmm(blocks.expand(2, -1, -1), halves)
        else:
            out = torch.baddbmm(bias.view(2, 1, cols // 2).expand(2, rows, -1), blocks.expand(2, -1, -1), halves)
        return out.transpose(0, 1).reshape(1, rows, cols)
    w = weight.t().unsqueeze(0).expand(n, -1, -1)
    if bias is None:
        return torch.bmm(blocks, w)
    return torch.baddbmm(bias.expand(n, blocks.shape[1], -1), blocks, w)


def _triton_is_faster(rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype | None) -> bool:
    """Each kernel timed as a step runs it (the module's docstring); the copies live only for the
    timing (at warm-up, at most twice the L2 cache's memory)."""
    copies = cold_copies(weight)
    k = weight.shape[1]
    return (after_kernel_ms(skinny_linear, k, copies, rows, bias, out_dtype)
            < after_kernel_ms(cublas_linear, k, copies, rows, bias, out_dtype))


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and uninitialised copies of it that together take twice the L2 cache: a product
    called on each in turn reads its weight from memory, as a step reads each layer's. At most
    MAX_COLD_COPIES: a toy weight (an MoE router of a few experts, 512 bytes) would otherwise take
    hundreds of thousands of launches to time, and at that size the launch, not the read, decides."""
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    copies = min(MAX_COLD_COPIES, -(-2 * l2_bytes // weight.nbytes))
    return [weight] + [torch.empty_like(weight) for _ in range(copies - 1)]


def after_kernel_ms(product, k: int, copies: list[torch.Tensor], rows: int, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, before=None) -> float:
    """Milliseconds of a kernel then `product(x, weight, bias, out_dtype)` of `rows` rows, in a CUDA
    graph, each weight of `copies` in turn. The kernel: `before()`, or by default an RMSNorm that
    writes x (what a step puts before a product: under PDL the Triton product is placed behind it)."""
    dtype, device = copies[0].dtype, copies[0].device
    probe = torch.randn(rows, k, dtype=dtype, device=device)
    norm_weight = torch.rand(k, dtype=dtype, device=device)

    def calls() -> None:
        for weight in copies:
            if before is None:
                product(fused.rms_norm(probe, norm_weight, 1e-6), weight, bias, out_dtype)
            else:
                before()
                product(probe, weight, bias, out_dtype)

    return graph_ms(calls) / len(copies)


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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton product."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    prefetch = prefetch_row_bytes(weight)
    args = (x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            prefetch)
    flags = dict(HAS_BIAS=bias is not None, BLOCK_M=block_rows(m), PREFETCH=prefetch > 0)
    if INTERPRET:  # the interpreter cannot time configurations
        _skinny_gemm_kernel[grid](*args, **flags, BLOCK_N=32, BLOCK_K=64, PDL=False)
    else:
        _skinny_gemm_tuned[grid](*args, **flags, **pdl.launch_args())
    return y


def prefetch_row_bytes(weight: torch.Tensor) -> int:
    """Bytes at the head of each row of `weight` that a product prefetches before it waits on the
    kernel before it: PREFETCH_BYTES shared by the rows, in the 16-byte units a bulk prefetch
    takes; 0 without PDL (nothing runs before the wait then) or on an unaligned weight."""
    if not pdl.enabled() or INTERPRET or not weight.is_cuda:
        return 0
    size = weight.element_size()
    if weight.data_ptr() % 16 or weight.stride(0) * size % 16:
        return 0
    return min(weight.shape[1] * size, PREFETCH_BYTES // weight.shape[0]) // 16 * 16


def invariant_tile(m: int, n: int, device: torch.device) -> dict:
    """The first of INVARIANT_TILES whose row block the rows fill (any of 64) and whose programs for
    an [m, n] output fill the GPU's SMs once, or the smallest: large tiles read the weight fewer
    times, small ones keep a few rows' product streaming the weight from every SM."""
    if INTERPRET:  # (no SMs to fill; the interpreter's products are numpy's, batch-invariant or not)
        return INVARIANT_TILES[-1]
    sms = sm_count(device)
    for tile in INVARIANT_TILES:
        rows_fill = tile["BLOCK_M"] <= max(m, 64)
        if rows_fill and triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]) >= sms:
            return tile
    return INVARIANT_TILES[-1]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, tile: dict | None = None) -> torch.Tensor:
    """The batch-invariant product: `invariant_tile`'s tile (or `tile`), a row block per program on
    axis 1 (float32 as float32, not rounded to tf32)."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m:
        tile = tile or invariant_tile(m, n, x.device)
        grid = (triton.cdiv(n, tile["BLOCK_N"]), triton.cdiv(m, tile["BLOCK_M"]))
        one_block = m <= tile["BLOCK_M"] and tile["BLOCK_N"] <= 128  # (blocks would repeat it; _prefetch_rows' limit)
        if m > tile["BLOCK_M"] and tma_ready(x, weight):
            programs = min(grid[0] * grid[1], sm_count(x.device))
            y_tma = tma_ready(y, x)  # (a float32 output's tile would not fit beside the loads' stages)
            _invariant_tma_kernel[(programs,)](
                TensorDescriptor.from_tensor(x, [tile["BLOCK_M"], tile["BLOCK_K"]]),
                TensorDescriptor.from_tensor(weight, [tile["BLOCK_N"], tile["BLOCK_K"]]),
                bias if bias is not None else weight,
                TensorDescriptor.from_tensor(y, [tile["BLOCK_M"], tile["BLOCK_N"]]) if y_tma else y,
                m, n, k, y.stride(0), programs, HAS_BIAS=bias is not None, Y_TMA=y_tma, **tile,
                GROUP_M=INVARIANT_GROUP_M, **pdl.launch_args())
            return y.view(*lead, n)
        prefetch = prefetch_row_bytes(weight) if one_block else 0
        _skinny_gemm_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                                  weight.stride(0), y.stride(0), prefetch, HAS_BIAS=bias is not None, **tile,
                                  PREFETCH=prefetch > 0, IEEE=x.dtype == torch.float32,
                                  GROUP_M=1 if one_block else INVARIANT_GROUP_M,
                                  **({"PDL": False} if INTERPRET else pdl.launch_args()))
    return y.view(*lead, n)


if triton is not None:

    @triton.jit
    def _prefetch_rows(w_ptr, cols, n, stride_wn, nbytes, BLOCK_N: tl.constexpr):
        """Ask the L2 cache for the first `nbytes` of each weight row in `cols` by sm_90's bulk prefetch,
        each row in pieces so that each of the program's (at least 128) threads issues one."""
        tl.static_assert(BLOCK_N <= 128)
        piece = nbytes // (128 // BLOCK_N) // 16 * 16
        rows = tl.minimum(cols, n - 1).to(tl.int64)
        offsets = tl.arange(0, 128 // BLOCK_N) * (piece // (w_ptr.dtype.element_ty.primitive_bitwidth // 8))
        heads = w_ptr + rows[:, None] * stride_wn + offsets[None, :]
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [heads, tl.zeros((BLOCK_N, 128 // BLOCK_N), dtype=tl.int32) + piece], dtype=tl.int32,
            is_pure=False, pack=1)

    @triton.jit
    def _tile_of_program(GROUP_M: tl.constexpr):
        """(column block, row block) of this program. The grid is (column blocks, row blocks), and
        programs start in launch order, the column block fastest: every row block then reads the
        whole weight, from memory once it outgrows L2 (the 8B shape's gate/up, 235 MB, 128 times
        at 16k rows). With GROUP_M > 1, programs in launch order take GROUP_M row blocks of one
        column block, then the next column block: a weight tile serves GROUP_M row blocks from L2."""
        if GROUP_M == 1:
            return tl.program_id(0), tl.program_id(1)
        return _grouped_tile(tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.num_programs(0),
                             tl.num_programs(1), GROUP_M)

    @triton.jit
    def _grouped_tile(pid, col_blocks, row_blocks, GROUP_M: tl.constexpr):
        """(column block, row block) of the pid-th tile in `_tile_of_program`'s order."""
        per_group = GROUP_M * col_blocks
        first_row_block = pid // per_group * GROUP_M
        group_rows = tl.minimum(row_blocks - first_row_block, GROUP_M)  # (the last group may hold fewer)
        return (pid % per_group) // group_rows, first_row_block + pid % per_group % group_rows

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym, prefetch_bytes,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                            IEEE: tl.constexpr = False, GROUP_M: tl.constexpr = 1):
        col_block, row_block = _tile_of_program(GROUP_M)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH:  # before the wait: the kernel before may still run (the module's docstring)
            _prefetch_rows(w_ptr, cols, n, stride_wn, prefetch_bytes, BLOCK_N)
        pdl.wait_for_previous(PDL)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (one row block unless batch-invariant)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < k), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < n) & (kk[None, :] < k),
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IEEE else "tf32")
        _store_tile(acc, b_ptr, y_ptr, rows, cols, m, n, stride_ym, HAS_BIAS)

    @triton.jit
    def _invariant_tma_kernel(x_desc, w_desc, b_ptr, y, m, n, k, stride_ym, programs, HAS_BIAS: tl.constexpr,
                              Y_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
        """`_skinny_gemm_kernel`'s sums over many row blocks, its tiles loaded by TMA (the module's
        docstring); rows and columns past the ends load as zeros. `programs` programs (one an SM)
        walk the tiles in `_tile_of_program`'s order. Y_TMA: `y` is a descriptor, and the tile is
        stored through it (past the ends clipped), else `y` is the output's pointer."""
        pdl.wait_for_previous(PDL)
        col_blocks, row_blocks = tl.cdiv(n, BLOCK_N), tl.cdiv(m, BLOCK_M)
        for tile in tl.range(tl.program_id(0), col_blocks * row_blocks, programs):
            col_block, row_block = _grouped_tile(tile, col_blocks, row_blocks, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, k, BLOCK_K):
                x = x_desc.load([row_block * BLOCK_M, k0])
                w = w_desc.load([col_block * BLOCK_N, k0])
                acc = tl.dot(x, w.T, acc)
            cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
            if Y_TMA:
                if HAS_BIAS:
                    acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
                y.store([row_block * BLOCK_M, col_block * BLOCK_N], acc.to(y.dtype))
            else:
                _store_tile(acc, b_ptr, y, row_block * BLOCK_M + tl.arange(0, BLOCK_M), cols, m, n, stride_ym,
                            HAS_BIAS)

    @triton.jit
    def _store_tile(acc, b_ptr, y_ptr, rows, cols, m, n, stride_ym, HAS_BIAS: tl.constexpr):
        """y[rows, cols] = acc (+ bias), in y's dtype."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows < m)[:, None] & (cols[None, :] < n))

    @triton.jit
    def _split_k_kernel(x_ptr, w_ptr, part_ptr, m, n, k, stride_xm, stride_wn, SLICES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (column block, slice): its slice of K's float32 sums for every row, at part[row, slice]."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        piece = tl.program_id(1)
        pdl.wait_for_previous(PDL)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        per_slice = tl.cdiv(tl.cdiv(k, SLICES), BLOCK_K) * BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(piece * per_slice, tl.minimum(k, (piece + 1) * per_slice), BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows[:, None] < m) & (kk[None, :] < k),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=(cols[:, None] < n) & (kk[None, :] < k),
                        other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(part_ptr + (rows[:, None] * SLICES + piece) * n + cols[None, :], acc,
                 mask=(rows[:, None] < m) & (cols[None, :] < n))

    _split_k_tuned = triton.autotune(  # (bench/probes/split_k_partials.py's best on an H200, and one of 256-wide K tiles)
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=st)
                 for bn, bk, st in [(32, 128, 4), (64, 128, 4), (32, 256, 3)]],
        key=["n", "k", "SLICES", "BLOCK_M"],
    )(_split_k_kernel)

    _skinny_gemm_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3),
                                  (64, 64, 4, 4), (128, 64, 8, 3), (16, 512, 4, 2)]
        ],
        key=["n", "k", "BLOCK_M"],
    )(_skinny_gemm_kernel)
