"""A mixture of experts' MLP: each row through its top-k experts, weighted by its routing.

The torch reference (`experts_ref`) runs every expert over every row and weights each row's
output by its routing weight, zero for the experts it did not take: exact and capturable, but
it reads every expert's weights each step (at b1 on Qwen3-30B-A3B, 128 experts' where the row
needs 8).

The Triton path reads only the experts the step's rows took, each once per block of its rows:

0. `router_logits`: the router's product. A step of few rows (decode at small batch) takes it in
   float32 slices of the hidden size, a program per slice and block of experts, which routing adds up
   in order and rounds to the activation dtype (as the product's output is rounded): at one row on
   an H200 cuBLAS's product of Qwen3-30B-A3B's router (128 x 2,048) took 5.0 us of a 69 us layer,
   its few programs each streaming a long slice of the weight.
1. `_topk_kernel`: each row's float32 softmax over the router's logits, its top-k (renormalised
   to sum to one when asked, then rounded to the activation dtype, as transformers does), and the
   rows each expert took in the program's rows (a row of counts a program: nothing to zero, no atomics).
2. `_place_kernel`: each expert's run of slots padded to whole blocks, every pick placed in its
   expert's run (after the picks of the programs before, then in pick order: the slots are the
   same in every run of a step), and the expert of every block. A step of few rows (decode at
   small batch) does 1 and 2 in one program (`_route_kernel`): one launch; of up to
   FEW_ROUTE_ROWS rows, in a tile of as many rows.
3. `_expert_gemm_kernel` with GATED: per block of slots, the rows' hidden states times the block's
   expert's gate and up rows, SiLU(gate) x up, into [rows x top-k, width].
4. `_expert_gemm_kernel`: that times the expert's down projection, times the routing weight,
   into [rows x top-k, hidden].
5. `_combine_kernel`: each row's k outputs summed in pick order in float32, rounded once; at one
   rank (`into_sum`) the next residual add + norm sums them instead, the same way (`fused.rms_norm`).

A block's rows follow the step's rows per expert (16 at small decode batches, 64 from 512 rows on,
so that an expert's weights are read by as few blocks as its rows fill), and the tile is timed per shape on
the first call, outside CUDA-graph capture (the runner's warm-up makes it). A path without the
sort for steps of at most four rows (a program per pick, a GEMV per tile, the down product
summing a row's picks as it goes: three launches instead of six) was no faster on an H200
(41.9 against 39.5 us a layer at one row, 101.9 against 90.7 at four: bench/moe_kernels.py).

Every product accumulates in float32 and rounds where the reference does (the products'
outputs, SiLU, the weighted output). With `invariant=True` (deterministic inference) every step
routes in programs of one shape and takes one fixed tile: a row's place inside a block changes
none of its sums and the combine's order is fixed, so a row's bits do not depend on the other rows.
"""

from __future__ import annotations

import torch

from kernels import INTERPRET, fused, pdl, skinny_gemm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference
    triton = None

ROUTE_ROWS = 16  # rows per routing program
# a step of at most this many rows (<= ROUTE_ROWS) routes in one program (H200: 9.0 against the two kernels' 13.9 us at
# 1 row, 12.5 against 16.2 at 8; that program looping over two chunks was slower than the two kernels: 23.6 against 18.2)
ONE_PROGRAM_ROUTE_ROWS = ROUTE_ROWS
ROUTE_WARPS = 4  # warps of a routing program of ROUTE_ROWS rows
ROUTER_SLICE = 128  # hidden columns a program of the few-row router product sums (Qwen3-30B-A3B: 16 slices)
ROUTER_EXPERTS = 32  # experts a program of it takes
# a step of few rows routes in a tile of as many rows (a power of two) in FEW_ROUTE_WARPS warps: at one row the 16-row
# tile's placement compares 128 picks with every expert, 16 times the one row's 8
FEW_ROUTE_ROWS = 4
FEW_ROUTE_WARPS = 1
INVARIANT_TILE = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
INVARIANT_BLOCK_ROWS = 16


# ---------------- torch reference ----------------
def routing_ref(logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype) -> torch.Tensor:
    """[T, E] each row's weight on each expert: the (renormalised) top-k of the float32 softmax, 0 elsewhere."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = probs.topk(top_k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, chosen, top).to(dtype)


def experts_ref(h: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                renormalise: bool, invariant: bool = False) -> torch.Tensor:
    """Every expert over every row, in expert order, each weighted by the row's routing weight."""
    weights = routing_ref(logits, top_k, renormalise, h.dtype)
    out = torch.zeros_like(h)
    for e in range(gate_up.shape[0]):
        mid = fused.silu_mul_ref(skinny_gemm.linear(h, gate_up[e], invariant=invariant))
        out += skinny_gemm.linear(mid, down[e], invariant=invariant) * weights[:, e, None]
    return out


# ---------------- dispatch ----------------
def router_logits(h: torch.Tensor, router: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """The router's logits for `h` [T, hidden] (`router`: [E, hidden]): [T, E] in h's dtype, or for a step
    of at most ONE_PROGRAM_ROUTE_ROWS rows on the GPU [S, T, E] float32 sums over S slices of the hidden
    size, which `route` adds up in order and rounds to h's dtype (the module's docstring). Batch-invariant
    steps keep the one product whose row bits do not depend on the step's rows."""
    rows, hidden = h.shape
    if invariant or not fused.use_triton(h) or not 0 < rows <= ONE_PROGRAM_ROUTE_ROWS:
        return skinny_gemm.linear(h, router, invariant=invariant)
    num_experts = router.shape[0]
    slices = triton.cdiv(hidden, ROUTER_SLICE)
    partials = torch.empty(slices, rows, num_experts, dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(num_experts, ROUTER_EXPERTS), slices)
    _router_slices_kernel[grid](h, router, partials, rows, num_experts, hidden, h.stride(0), router.stride(0),
                                R=ROUTE_ROWS, BLOCK_E=ROUTER_EXPERTS, BLOCK_K=ROUTER_SLICE,
                                IEEE=h.dtype == torch.float32, **_pdl())
    return partials


def experts(h: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
            renormalise: bool, invariant: bool = False, into_sum: bool = False) -> torch.Tensor:
    """The experts' output for the normalised hidden states `h` [T, hidden], routed by `logits`
    (`router_logits`: [T, E], or a few rows' [S, T, E] float32 slices): gate_up [E, 2 x width, hidden]
    (gate rows, then up rows), down [E, hidden, width]. With `into_sum` (the output's one consumer the
    residual add + norm) the kernels' output is each row's weighted picks [T, top_k, hidden], which
    `fused.rms_norm` sums in pick order, rounded to the dtype, as `combine` sums them: the same values
    without the combine's launch."""
    if not fused.use_triton(h):
        return experts_ref(h, logits, gate_up, down, top_k, renormalise, invariant)
    if h.shape[0] == 0:
        return torch.empty_like(h)
    routed = route(logits, top_k, renormalise, h.dtype, block=INVARIANT_BLOCK_ROWS if invariant else None,
                   invariant=invariant)
    return _routed_experts(routed, h, gate_up, down, invariant, into_sum)


def layer(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
          renormalise: bool, invariant: bool = False, into_sum: bool = False) -> torch.Tensor:
    """The layer whole for the normalised hidden states `h`: the router's product (`router`: [E, hidden]),
    the routing, the experts (`SparseMoE.block`). A step of at most ONE_PROGRAM_ROUTE_ROWS rows on the
    GPU takes the router's product and the routing in one launch (`route_in_router`); else as
    `experts(h, router_logits(h, router), ...)`, which computes the same bits; `into_sum` as there."""
    rows = h.shape[0]
    counter = None
    if fused.use_triton(h) and not invariant and 0 < rows <= ONE_PROGRAM_ROUTE_ROWS:
        counter = _route_counter(h.device)
    if counter is None:
        return experts(h, router_logits(h, router, invariant), gate_up, down, top_k, renormalise, invariant,
                       into_sum)
    return _routed_experts(route_in_router(h, router, counter, top_k, renormalise), h, gate_up, down,
                           invariant=False, into_sum=into_sum)


def _routed_experts(routed: Route, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    invariant: bool, into_sum: bool) -> torch.Tensor:
    """The experts' products over `routed`'s slots, then each row's picks combined (`into_sum`: left
    for the norm to sum, [T, top_k, hidden])."""
    rows, hidden = h.shape
    mid = torch.empty(rows * routed.top_k, down.shape[2], dtype=h.dtype, device=h.device)
    _expert_gemm(routed, h, gate_up, mid, gated=True, invariant=invariant)
    picks = torch.empty(rows * routed.top_k, hidden, dtype=h.dtype, device=h.device)
    _expert_gemm(routed, mid, down, picks, gated=False, invariant=invariant)
    if into_sum:
        return picks.view(rows, routed.top_k, hidden)
    out = torch.empty_like(h)
    combine(picks, out, routed.top_k)
    return out


_route_counters: dict[torch.device, torch.Tensor] = {}


def _route_counter(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed int32 that `route_in_router`'s programs count themselves on (the last one
    routes, then zeroes it for the next launch: the steps of a device run one at a time, in one
    stream). Made by the first eager call; None inside a CUDA graph's capture before one (the two
    launches then)."""
    counter = _route_counters.get(device)
    if counter is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counter = _route_counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def combine(picks: torch.Tensor, out: torch.Tensor, top_k: int) -> None:
    """out[row] = the row's `top_k` weighted picks [rows x top_k, hidden] summed in pick order."""
    rows, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(rows, triton.cdiv(hidden, block))](picks, out, hidden, K=top_k, BLOCK=block, **_pdl())


def block_rows(assignments: int, experts: int) -> int:
    """Slots per block: twice the rows an expert takes on average, as a power of two within 16..64, so
    that an expert with more rows than the mean still fits one block and its weights are read once."""
    return min(64, max(16, triton.next_power_of_2(-(-2 * assignments // experts))))


class Route:
    """A step's routing on the device, as `route` or `route_in_router` fill it: each row's picks (`ids`,
    `weights` [T, k]) and its slots grouped by expert in blocks of `block` (`slots`: the flat pick index
    in each slot; `block_expert`: each block's expert, -1 past the used ones; `starts`, `counts` per
    expert)."""

    def __init__(self, rows: int, num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device,
                 block: int | None = None):
        picks = rows * top_k
        self.rows, self.num_experts, self.top_k = rows, num_experts, top_k
        self.ids = torch.empty(rows, top_k, dtype=torch.int32, device=device)
        self.weights = torch.empty(rows, top_k, dtype=dtype, device=device)
        self.block = block or block_rows(picks, num_experts)
        # the blocks: each expert's run rounds up by at most block - 1 slots, and at most `picks` experts have rows
        self.num_blocks = picks // self.block + min(num_experts, picks) + 1
        self.counts = torch.empty(num_experts, dtype=torch.int32, device=device)
        self.starts = torch.empty(num_experts, dtype=torch.int32, device=device)
        self.slots = torch.empty(self.num_blocks * self.block, dtype=torch.int32, device=device)
        self.block_expert = torch.empty(self.num_blocks, dtype=torch.int32, device=device)

    def tile(self, invariant: bool) -> dict:
        """The routing programs' shape: ROUTE_ROWS rows a program, or a step of few rows in a tile of as many."""
        tile = ROUTE_ROWS if invariant or self.rows > FEW_ROUTE_ROWS else triton.next_power_of_2(self.rows)
        return dict(E=triton.next_power_of_2(self.num_experts), K=self.top_k, KP=triton.next_power_of_2(self.top_k),
                    R=tile, num_warps=ROUTE_WARPS if tile == ROUTE_ROWS else FEW_ROUTE_WARPS, **_pdl())

    def runs(self) -> dict:
        """The placement's shape: slots a block, and the blocks `_store_runs` takes at a time."""
        return dict(BLOCK_M=self.block, NB=min(64, triton.next_power_of_2(self.num_blocks)))

    def one_program(self, logits: torch.Tensor, renormalise: bool, invariant: bool = False) -> tuple[tuple, dict]:
        """The arguments of the one program that routes this step from `logits` (`_route_kernel`'s, which
        `_router_route_kernel` takes after its own)."""
        slices = logits.shape[0] if logits.dim() == 3 else 0
        args = (logits, logits.stride(-2), self.rows * self.num_experts, self.rows, self.num_experts, self.weights,
                self.ids, self.counts, self.starts, self.slots, self.block_expert, self.num_blocks)
        return args, dict(RENORM=renormalise, SLICES=slices, **self.tile(invariant), **self.runs())


def route(logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype, block: int | None = None,
          invariant: bool = False) -> Route:
    """A step routed by its router's `logits`: [T, E], or (at most ONE_PROGRAM_ROUTE_ROWS rows)
    `router_logits`' [S, T, E] float32 slices, added up in order and rounded to `dtype`. A step of at
    most ONE_PROGRAM_ROUTE_ROWS rows routes in one program; a larger one in two kernels of a program
    per ROUTE_ROWS rows. `invariant`: every step's programs alike (ROUTE_ROWS rows in ROUTE_WARPS
    warps), so that a row's softmax sums alike in any step."""
    rows, num_experts = logits.shape[-2:]
    if logits.dim() == 3 and rows > ONE_PROGRAM_ROUTE_ROWS:
        raise ValueError(f"the router's slices route steps of at most {ONE_PROGRAM_ROUTE_ROWS} rows, got {rows}")
    routed = Route(rows, num_experts, top_k, dtype, logits.device, block)
    if rows <= ONE_PROGRAM_ROUTE_ROWS:
        args, flags = routed.one_program(logits, renormalise, invariant)
        _route_kernel[(1,)](*args, **flags)
        return routed
    shape = routed.tile(invariant)
    programs = triton.cdiv(rows, shape["R"])
    taken = torch.empty(programs, num_experts, dtype=torch.int32, device=logits.device)  # each program's row of counts
    rank = torch.empty(rows, top_k, dtype=torch.int32, device=logits.device)  # each pick's place in its program's run
    _topk_kernel[(programs,)](logits, logits.stride(0), rows, num_experts, routed.weights, routed.ids, rank, taken,
                              RENORM=renormalise, **shape)
    _place_kernel[(programs,)](routed.ids, rank, rows, num_experts, taken, programs, routed.counts, routed.starts,
                               routed.slots, routed.block_expert, routed.num_blocks,
                               PB=min(64, triton.next_power_of_2(programs)), **shape, **routed.runs())
    return routed


def route_in_router(h: torch.Tensor, router: torch.Tensor, counter: torch.Tensor, top_k: int,
                    renormalise: bool) -> Route:
    """`route(router_logits(h, router), ...)` of a step of at most ONE_PROGRAM_ROUTE_ROWS rows in one
    launch: the router's programs each store their float32 slice of the logits, and the last of them
    to finish (counted on `counter`, `_route_counter`) routes the step as `_route_kernel` does, from
    the same slices in the same order: the same bits, a launch (and its wait on the one before) fewer."""
    rows, hidden = h.shape
    num_experts = router.shape[0]
    if rows > ONE_PROGRAM_ROUTE_ROWS:
        raise ValueError(f"the router's launch routes steps of at most {ONE_PROGRAM_ROUTE_ROWS} rows, got {rows}")
    partials = torch.empty(triton.cdiv(hidden, ROUTER_SLICE), rows, num_experts, dtype=torch.float32, device=h.device)
    routed = Route(rows, num_experts, top_k, h.dtype, h.device)
    args, flags = routed.one_program(partials, renormalise)
    _router_route_kernel[(triton.cdiv(num_experts, ROUTER_EXPERTS), partials.shape[0])](
        h, router, counter, hidden, h.stride(0), router.stride(0), *args, RR=ROUTE_ROWS, BLOCK_E=ROUTER_EXPERTS,
        BLOCK_K=ROUTER_SLICE, IEEE=h.dtype == torch.float32, **flags)
    return routed


def _expert_gemm(routed: Route, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, gated: bool,
                 invariant: bool) -> None:
    """out[pick] = SiLU(a[row] @ gate.T) x (a[row] @ up.T) (gated) or (a[pick] @ down.T) x weight."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    args = (a, w, out, routed.slots, routed.block_expert, routed.counts, routed.starts, routed.weights,
            n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0))
    flags = dict(A_DIV=routed.top_k if gated else 1, GATED=gated, BLOCK_M=routed.block, IEEE=a.dtype == torch.float32)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), routed.num_blocks)  # noqa: E731
    if invariant or INTERPRET:  # (the interpreter cannot time configurations)
        _expert_gemm_kernel[grid](*args, **flags, **INVARIANT_TILE, **_pdl())
    else:
        _expert_gemm_tuned[grid](*args, **flags, **pdl.launch_args())


def _pdl() -> dict:
    return {"PDL": False} if INTERPRET else pdl.launch_args()


# ---------------- kernels ----------------
if triton is not None:

    @triton.jit
    def _topk_rows(logits_ptr, stride_l, stride_slice, r, rows, num_experts, weights_ptr, ids_ptr, E: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, RENORM: tl.constexpr, SLICES: tl.constexpr,
                   VOLATILE: tl.constexpr = False):
        """Rows `r`'s top-k of their float32 softmax, stored; returns how many of them took each expert, and
        each pick's (`chosen` [R, KP]) place among its expert's picks in these rows (`rank`).
        SLICES > 0: the logits are that many float32 slices, added up in order and rounded as a product's
        output is (VOLATILE: loaded past this SM's cache, other programs of the launch stored them)."""
        es = tl.arange(0, E)
        picks = tl.arange(0, KP)
        expert_ok = es < num_experts
        row_ok = r < rows
        at = logits_ptr + r[:, None].to(tl.int64) * stride_l + es[None, :]
        ok = row_ok[:, None] & expert_ok[None, :]
        if SLICES == 0:
            x = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(at, mask=ok, other=0.0, volatile=VOLATILE)
            for s in tl.static_range(1, SLICES):
                x += tl.load(at + s * stride_slice, mask=ok, other=0.0, volatile=VOLATILE)
            x = x.to(weights_ptr.dtype.element_ty).to(tl.float32)
        x = tl.where(expert_ok[None, :], x, -float("inf"))  # (rows past the last: uniform, never stored)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        # a row of NaN or inf logits (an overflow upstream) as zeros: argmax, whose comparisons a NaN fails, would
        # repeat an expert, and the counts below (one per expert a row took) would leave other rows' picks unplaced
        p = tl.where(p == p, p, 0.0)
        top = tl.zeros((R, KP), dtype=tl.float32)
        chosen = tl.zeros((R, KP), dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, axis=1)
            idx = tl.argmax(p, axis=1).to(tl.int32)  # (ties: the lower expert)
            top = tl.where(picks[None, :] == j, best[:, None], top)
            chosen = tl.where(picks[None, :] == j, idx[:, None], chosen)
            p = tl.where(es[None, :] == idx[:, None], -1.0, p)
        # the picks are the -1s (a probability is never negative): one sum over the rows, not one a pick
        took = ((p < 0) & row_ok[:, None]).to(tl.int32)
        taken = tl.sum(took, axis=0)
        # each pick's place among its expert's picks in these rows: the rows before it that took the expert (a row
        # takes an expert once)
        rank = tl.gather(tl.cumsum(took, axis=0) - took, chosen, axis=1)
        if RENORM:
            top = top / tl.sum(top, axis=1)[:, None]
        where = r[:, None] * K + picks[None, :]
        ok = row_ok[:, None] & (picks[None, :] < K)
        tl.store(weights_ptr + where, top.to(weights_ptr.dtype.element_ty), mask=ok)
        tl.store(ids_ptr + where, chosen, mask=ok)
        return taken, rank, chosen

    @triton.jit
    def _store_runs(padded, ends, num_experts, starts_ptr, block_expert_ptr, num_blocks, E: tl.constexpr,
                    BLOCK_M: tl.constexpr, NB: tl.constexpr):
        """Each expert's run start, and each block's expert (-1 past the used blocks)."""
        es = tl.arange(0, E)
        expert_ok = es < num_experts
        tl.store(starts_ptr + es, ends - padded, mask=expert_ok)
        for b0 in range(0, num_blocks, NB):
            b = b0 + tl.arange(0, NB)
            passed = (ends[None, :] <= b[:, None] * BLOCK_M) & expert_ok[None, :]
            expert = tl.sum(passed.to(tl.int32), axis=1)  # the first expert whose run reaches past the block's start
            tl.store(block_expert_ptr + b, tl.where(expert < num_experts, expert, -1), mask=b < num_blocks)

    @triton.jit
    def _place_rows(r, rows, chosen, rank, free, slots_ptr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                    R: tl.constexpr):
        """Rows `r`'s picks (`chosen` [R, KP], each one's `rank` among its expert's picks in these rows)
        placed in their experts' runs, in pick order from `free` (each expert's first slot not taken by the
        programs before)."""
        picks = tl.arange(0, KP)[None, :]
        first = tl.gather(tl.broadcast_to(free[None, :], (R, E)), chosen, axis=1)
        tl.store(slots_ptr + first + rank, r[:, None] * K + picks, mask=(r[:, None] < rows) & (picks < K))

    @triton.jit
    def _topk_kernel(logits_ptr, stride_l, rows, num_experts, weights_ptr, ids_ptr, rank_ptr, taken_ptr,
                     E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, RENORM: tl.constexpr,
                     PDL: tl.constexpr):
        """A program's rows' top-k, each pick's place among its expert's picks in these rows (`rank` [T, k]),
        and the rows each expert took among them (the program's row of `taken`)."""
        pdl.wait_for_previous(PDL)
        r = tl.program_id(0) * R + tl.arange(0, R)
        taken, rank, _ = _topk_rows(logits_ptr, stride_l, 0, r, rows, num_experts, weights_ptr, ids_ptr, E, K, KP, R,
                                    RENORM, 0)
        es = tl.arange(0, E)
        tl.store(taken_ptr + tl.program_id(0) * num_experts + es, taken, mask=es < num_experts)
        picks = tl.arange(0, KP)[None, :]
        tl.store(rank_ptr + r[:, None] * K + picks, rank, mask=(r[:, None] < rows) & (picks < K))

    @triton.jit
    def _place_kernel(ids_ptr, rank_ptr, rows, num_experts, taken_ptr, programs, counts_ptr, starts_ptr, slots_ptr,
                      block_expert_ptr, num_blocks, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      R: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr, PB: tl.constexpr, PDL: tl.constexpr):
        """Each expert's run of slots (its count padded to whole blocks), every pick of the program's
        rows placed in its expert's run after those of the programs before, and (program 0) the
        counts, the runs' starts and each block's expert."""
        pdl.wait_for_previous(PDL)
        es = tl.arange(0, E)
        expert_ok = es < num_experts
        pid = tl.program_id(0)
        counts = tl.zeros((E,), dtype=tl.int32)
        before = tl.zeros((E,), dtype=tl.int32)  # the picks of the programs before this one, per expert
        for p0 in range(0, programs, PB):
            ps = p0 + tl.arange(0, PB)
            t = tl.load(taken_ptr + ps[:, None] * num_experts + es[None, :],
                        mask=(ps[:, None] < programs) & expert_ok[None, :], other=0)
            counts += tl.sum(t, axis=0)
            before += tl.sum(tl.where(ps[:, None] < pid, t, 0), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        if pid == 0:
            tl.store(counts_ptr + es, counts, mask=expert_ok)
            _store_runs(padded, ends, num_experts, starts_ptr, block_expert_ptr, num_blocks, E, BLOCK_M, NB)
        r = pid * R + tl.arange(0, R)
        picks = tl.arange(0, KP)[None, :]
        ok = (r[:, None] < rows) & (picks < K)
        chosen = tl.load(ids_ptr + r[:, None] * K + picks, mask=ok, other=0)
        rank = tl.load(rank_ptr + r[:, None] * K + picks, mask=ok, other=0)
        _place_rows(r, rows, chosen, rank, ends - padded + before, slots_ptr, E, K, KP, R)

    @triton.jit
    def _route_kernel(logits_ptr, stride_l, stride_slice, rows, num_experts, weights_ptr, ids_ptr, counts_ptr,
                      starts_ptr, slots_ptr, block_expert_ptr, num_blocks, E: tl.constexpr, K: tl.constexpr,
                      KP: tl.constexpr, R: tl.constexpr, RENORM: tl.constexpr, SLICES: tl.constexpr,
                      BLOCK_M: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
        """A step of at most R rows routed in one program: the top-k, the runs, the placement (one
        launch where the two kernels above take two)."""
        pdl.wait_for_previous(PDL)
        _route_rows(logits_ptr, stride_l, stride_slice, rows, num_experts, weights_ptr, ids_ptr, counts_ptr,
                    starts_ptr, slots_ptr, block_expert_ptr, num_blocks, E, K, KP, R, RENORM, SLICES, BLOCK_M, NB,
                    False)

    @triton.jit
    def _router_route_kernel(h_ptr, w_ptr, counter_ptr, hidden, stride_h, stride_w, logits_ptr, stride_l, stride_slice,
                             rows, num_experts, weights_ptr, ids_ptr, counts_ptr, starts_ptr, slots_ptr,
                             block_expert_ptr, num_blocks, RR: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_K: tl.constexpr, IEEE: tl.constexpr, E: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr, R: tl.constexpr, RENORM: tl.constexpr, SLICES: tl.constexpr,
                             BLOCK_M: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
        """`_router_slices_kernel`'s program, then, in the last of them to finish, `_route_kernel`'s
        (`route_in_router`)."""
        pdl.wait_for_previous(PDL)
        _router_slice(h_ptr, w_ptr, logits_ptr, rows, num_experts, hidden, stride_h, stride_w, RR, BLOCK_E, BLOCK_K,
                      IEEE)
        tl.debug_barrier()  # (every thread's slice stored before the count releases it)
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # (for the next launch)
            _route_rows(logits_ptr, stride_l, stride_slice, rows, num_experts, weights_ptr, ids_ptr, counts_ptr,
                        starts_ptr, slots_ptr, block_expert_ptr, num_blocks, E, K, KP, R, RENORM, SLICES, BLOCK_M,
                        NB, True)

    @triton.jit
    def _route_rows(logits_ptr, stride_l, stride_slice, rows, num_experts, weights_ptr, ids_ptr, counts_ptr, starts_ptr,
                    slots_ptr, block_expert_ptr, num_blocks, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                    R: tl.constexpr, RENORM: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                    NB: tl.constexpr, VOLATILE: tl.constexpr):
        """`_route_kernel`'s work (VOLATILE: the logits other programs of this launch stored)."""
        es = tl.arange(0, E)
        r = tl.arange(0, R)
        taken, rank, chosen = _topk_rows(logits_ptr, stride_l, stride_slice, r, rows, num_experts, weights_ptr, ids_ptr,
                                         E, K, KP, R, RENORM, SLICES, VOLATILE)
        tl.store(counts_ptr + es, taken, mask=es < num_experts)
        padded = (taken + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        _store_runs(padded, ends, num_experts, starts_ptr, block_expert_ptr, num_blocks, E, BLOCK_M, NB)
        _place_rows(r, rows, chosen, rank, ends - padded, slots_ptr, E, K, KP, R)

    @triton.jit
    def _router_slices_kernel(h_ptr, w_ptr, part_ptr, rows, num_experts, hidden, stride_h, stride_w, R: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """Slice program_id(1) of the hidden size: its part of the rows' logits for a block of experts, in float32."""
        pdl.wait_for_previous(PDL)
        _router_slice(h_ptr, w_ptr, part_ptr, rows, num_experts, hidden, stride_h, stride_w, R, BLOCK_E, BLOCK_K, IEEE)

    @triton.jit
    def _router_slice(h_ptr, w_ptr, part_ptr, rows, num_experts, hidden, stride_h, stride_w, R: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        r = tl.arange(0, R)
        row_ok, expert_ok, k_ok = r < rows, es < num_experts, ks < hidden
        x = tl.load(h_ptr + r[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + es[:, None] * stride_w + ks[None, :], mask=expert_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w), input_precision="ieee" if IEEE else "tf32")
        tl.store(part_ptr + (tl.program_id(1) * rows + r[:, None]) * num_experts + es[None, :], part,
                 mask=row_ok[:, None] & expert_ok[None, :])

    @triton.jit
    def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, slots_ptr, block_expert_ptr, counts_ptr, starts_ptr, weights_ptr,
                            n, k, stride_a, stride_we, stride_wn, stride_out, A_DIV: tl.constexpr,
                            GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        blk = tl.program_id(1)
        expert = tl.load(block_expert_ptr + blk)
        used = expert >= 0
        expert = tl.maximum(expert, 0)
        end = tl.load(starts_ptr + expert) + tl.load(counts_ptr + expert)
        slot = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = slot < tl.where(used, end, 0)  # (one comparison: the interpreter made int32 of `&` with a scalar)
        pick = tl.load(slots_ptr + slot, mask=row_ok, other=0)
        a_rows = a_ptr + (pick // A_DIV).to(tl.int64)[:, None] * stride_a
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.where(used, k, 0)  # (an unused block reads nothing)
        for k0 in range(0, k_end, BLOCK_K):
            kk = k0 + ks
            k_ok = kk[None, :] < k
            a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee" if IEEE else "tf32")
            if GATED:  # the expert's up rows sit `n` rows below its gate rows
                w = tl.load(w_rows + n * stride_wn + kk[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
                up = tl.dot(a, tl.trans(w), up, input_precision="ieee" if IEEE else "tf32")
        dtype = out_ptr.dtype.element_ty
        if GATED:  # rounded where the reference rounds: each product, then SiLU, then the product of the two
            g = acc.to(dtype).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        else:
            weight = tl.load(weights_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
            y = acc.to(dtype).to(tl.float32) * weight[:, None]
        tl.store(out_ptr + pick.to(tl.int64)[:, None] * stride_out + cols[None, :], y.to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])

    _expert_gemm_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in [(32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3),
                                  (128, 128, 8, 3), (32, 256, 4, 3), (16, 256, 4, 3)]
        ],
        key=["n", "k", "BLOCK_M", "GATED"],
    )(_expert_gemm_kernel)

    @triton.jit
    def _combine_kernel(picks_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < hidden
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(picks_ptr + (row * K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
