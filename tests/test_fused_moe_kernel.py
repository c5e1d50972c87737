"""The fused mixture-of-experts kernels against the torch reference, on fresh random inputs.

On a GPU: `pytest -m gpu tests/test_fused_moe_kernel.py`; without one, under Triton's interpreter:
`TRITON_INTERPRET=1 pytest -o addopts='' tests/test_fused_moe_kernel.py`.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernels import DEVICE, GPU_ONLY, ON_GPU

from kernels import fused_moe

DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
pytestmark = GPU_ONLY
# (rows, experts, top-k, hidden, width): decode (one row, a few), a verify step, a prefill; experts not a power of two;
# routed in one program (a tile of the rows up to FEW_ROUTE_ROWS, then of ROUTE_ROWS up to ONE_PROGRAM_ROUTE_ROWS) and
# in two kernels
SHAPES = [(1, 8, 2, 64, 32), (3, 12, 4, 64, 32), (5, 16, 4, 128, 48), (16, 16, 4, 64, 32), (70, 8, 2, 64, 32),
          (33, 6, 3, 96, 64)]
if ON_GPU:
    SHAPES += [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (1024, 128, 8, 2048, 768)]  # Qwen3-30B-A3B's layer


def moe_inputs(rows, experts, top_k, hidden, width, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, device=DEVICE).to(dtype)
    logits = (2 * torch.randn(rows, experts, generator=g, device=DEVICE)).to(dtype)
    gate_up = (torch.randn(experts, 2 * width, hidden, generator=g, device=DEVICE) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, width, generator=g, device=DEVICE) / width**0.5).to(dtype)
    return h, logits, gate_up, down


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("shape", SHAPES + [(1100, 12, 3, 64, 32)])  # (more programs than the placement reads at once)
def test_routing_picks_the_top_k_and_places_every_pick_once(shape, renormalise):
    """Every pick in its expert's run, each run in pick order (the same slots in every run of a step)."""
    rows, experts, top_k = shape[:3]
    _, logits, _, _ = moe_inputs(*shape, torch.float32, seed=sum(shape))
    route = fused_moe.route(logits, top_k, renormalise, torch.float32)
    expected = fused_moe.routing_ref(logits, top_k, renormalise, torch.float32)
    got = torch.zeros_like(expected).scatter_(1, route.ids.long(), route.weights)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    counts = torch.bincount(route.ids.flatten().long(), minlength=experts)
    assert torch.equal(route.counts.cpu(), counts.int().cpu())
    placed = []
    for b, e in enumerate(route.block_expert.tolist()):
        if e < 0:
            continue
        start, count = route.starts[e].item(), route.counts[e].item()
        assert start <= b * route.block < start + count  # a used block starts inside its expert's rows
        slots = route.slots[b * route.block : min((b + 1) * route.block, start + count)].long()
        assert (route.ids.flatten()[slots] == e).all()
        placed += slots.tolist()
    assert sorted(placed) == list(range(rows * top_k))
    for e in range(experts):
        run = route.slots[route.starts[e] : route.starts[e] + route.counts[e]]
        assert torch.equal(run.cpu(), run.sort().values.cpu())


@pytest.mark.parametrize("rows", [3, 40])  # (one routing program; two kernels)
def test_a_row_of_overflowed_logits_takes_k_experts_and_leaves_the_other_rows_placed(rows):
    """A row whose logits are NaN or inf (fp16 overflow upstream) takes k distinct experts, so every
    pick of every row is counted and placed once, and the other rows route as the reference does."""
    experts, top_k = 16, 4
    _, logits, _, _ = moe_inputs(rows, experts, top_k, 64, 32, torch.float32, seed=rows)
    logits[1] = float("nan")
    logits[rows - 1, 3] = float("inf")
    route = fused_moe.route(logits, top_k, True, torch.float32)
    ids = route.ids.long()
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert torch.equal(route.counts.cpu(), torch.bincount(ids.flatten(), minlength=experts).int().cpu())
    placed = sorted(s for e in range(experts)
                    for s in route.slots[route.starts[e] : route.starts[e] + route.counts[e]].tolist())
    assert placed == list(range(rows * top_k))
    healthy = [r for r in range(rows) if r not in (1, rows - 1)]
    expected = fused_moe.routing_ref(logits[healthy], top_k, True, torch.float32)
    got = torch.zeros_like(expected).scatter_(1, ids[healthy], route.weights[healthy])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_router_product_in_slices_routes_as_its_ordered_sum(shape, dtype):
    """A few rows' router product comes as float32 slices of the hidden size (more rows: one product in
    the dtype); routing adds them up in order and rounds the sum to the dtype."""
    rows, experts, top_k, hidden = shape[:4]
    h = moe_inputs(*shape, dtype, seed=5 * sum(shape))[0]
    g = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    router = (2 * torch.randn(experts, hidden, generator=g, device=DEVICE) / hidden**0.5).to(dtype)
    logits = fused_moe.router_logits(h, router)
    expected = h.float() @ router.float().T
    if rows > fused_moe.ONE_PROGRAM_ROUTE_ROWS:
        assert logits.shape == (rows, experts) and logits.dtype == dtype
        return
    assert logits.shape == (-(-hidden // fused_moe.ROUTER_SLICE), rows, experts) and logits.dtype == torch.float32
    total = logits[0].clone()
    for part in logits[1:]:
        total += part
    torch.testing.assert_close(total, expected, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-4)
    route = fused_moe.route(logits, top_k, True, dtype)
    got = torch.zeros(rows, experts, dtype=dtype, device=DEVICE).scatter_(1, route.ids.long(), route.weights)
    want = fused_moe.routing_ref(total.to(dtype), top_k, True, dtype)
    assert torch.equal(got != 0, want != 0)  # the same picks
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [sh for sh in SHAPES if sh[0] <= fused_moe.ONE_PROGRAM_ROUTE_ROWS])
def test_the_router_and_routing_in_one_launch_route_as_the_two_launches(shape, dtype):
    """A step of few rows takes the router's product and its routing in one launch (`route_in_router`: the
    last program to finish routes): every routing tensor and the layer's output the same bits as the two
    launches', call after call (the count starts from zero again), in a CUDA graph too on the GPU."""
    experts, top_k, hidden = shape[1:4]
    h, _, gate_up, down = moe_inputs(*shape, dtype, seed=3 * sum(shape))
    g = torch.Generator(device=DEVICE).manual_seed(2 * sum(shape))
    router = (2 * torch.randn(experts, hidden, generator=g, device=DEVICE) / hidden**0.5).to(dtype)
    two = fused_moe.experts(h, fused_moe.router_logits(h, router), gate_up, down, top_k, renormalise=True)
    one = fused_moe.layer(h, router, gate_up, down, top_k, renormalise=True)
    assert torch.equal(one, two)
    counter = fused_moe._route_counter(h.device)
    apart = fused_moe.route(fused_moe.router_logits(h, router), top_k, True, dtype)
    for _ in range(3):
        fused = fused_moe.route_in_router(h, router, counter, top_k, True)
        for name in ("ids", "weights", "counts", "starts", "block_expert"):
            assert torch.equal(getattr(fused, name), getattr(apart, name)), name
        for start, count in zip(apart.starts.tolist(), apart.counts.tolist()):  # (a run's padding is never written)
            assert torch.equal(fused.slots[start:start + count], apart.slots[start:start + count])
        assert int(counter) == 0
    if ON_GPU:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe.layer(h, router, gate_up, down, top_k, renormalise=True)
        for _ in range(20):
            graph.replay()
            assert torch.equal(out, two)


def test_router_slices_of_more_rows_than_one_routing_program_takes_are_refused():
    partials = torch.randn(2, fused_moe.ONE_PROGRAM_ROUTE_ROWS + 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        fused_moe.route(partials, 2, True, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_experts_match_the_reference(shape, dtype):
    h, logits, gate_up, down = moe_inputs(*shape, dtype, seed=7 * sum(shape))
    top_k = shape[2]
    got = fused_moe.experts(h, logits, gate_up, down, top_k, renormalise=True)
    expected = fused_moe.experts_ref(h.float(), logits.float(), gate_up.float(), down.float(), top_k, True)
    assert torch.isfinite(got).all()
    err = (got.float() - expected).norm() / expected.norm()
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]] + ([SHAPES[-2]] if ON_GPU else []))
def test_the_picks_into_the_norm_sum_as_the_combine_does(shape, dtype):
    """`into_sum`: the layer leaves each row's weighted picks [T, top_k, hidden] and the residual add + norm
    sums them (`fused.rms_norm`'s 3-D input): the sum and the norm the combined output's, then the norm's."""
    from kernels import fused

    rows, experts, top_k, hidden = shape[:4]
    h, _, gate_up, down = moe_inputs(*shape, dtype, seed=5 * sum(shape))
    g = torch.Generator(device=DEVICE).manual_seed(sum(shape))
    router = (2 * torch.randn(experts, hidden, generator=g, device=DEVICE) / hidden**0.5).to(dtype)
    residual = torch.randn(rows, hidden, generator=g, device=DEVICE).to(dtype)
    norm = (1 + torch.randn(hidden, generator=g, device=DEVICE) / 4).to(dtype)
    picks = fused_moe.layer(h, router, gate_up, down, top_k, renormalise=True, into_sum=True)
    assert picks.shape == (rows, top_k, hidden) and picks.dtype == dtype
    combined = fused_moe.layer(h, router, gate_up, down, top_k, renormalise=True)
    assert torch.equal(fused.parts_sum_ref(picks, dtype), combined)
    out, summed = fused.rms_norm(picks, norm, 1e-6, residual)
    expected_out, expected_summed = fused.rms_norm(combined, norm, 1e-6, residual)
    assert torch.equal(summed, expected_summed) and torch.equal(out, expected_out)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter's tl.dot is NumPy's, whose sums depend on a row's place in the tile")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_gets_the_same_bits_as_in_a_batch_with_the_invariant_tile(dtype):
    rows, experts, top_k, hidden, width = (40, 16, 4, 128, 64) if not ON_GPU else (300, 128, 8, 2048, 768)
    h, logits, gate_up, down = moe_inputs(rows, experts, top_k, hidden, width, dtype, seed=3)
    batched = fused_moe.experts(h, logits, gate_up, down, top_k, True, invariant=True)
    for r in (0, rows // 2, rows - 1):
        alone = fused_moe.experts(h[r : r + 1], logits[r : r + 1], gate_up, down, top_k, True, invariant=True)
        assert torch.equal(alone[0], batched[r])
