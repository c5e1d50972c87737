"""GPU time of a verify step's tree walk (kernels/tree_accept.py): the Triton kernel against the torch
reference, each captured alone in a CUDA graph and replayed back to back.

    python bench/tree_accept_bench.py

Shapes are those of verify graphs: (sequences, padded tokens, the longest tree). Trees are chains
with random tokens and draws; the walk's cost does not depend on what it accepts.
"""

from __future__ import annotations

import torch

from kernels.tree_accept import verify_outcome, verify_outcome_ref

SHAPES = [(1, 16, 9), (8, 64, 9), (64, 256, 4), (64, 512, 9)]
REPLAYS = 500


def chain_step(num_seqs: int, num_tokens: int, tree_tokens: int, device: str):
    """Every sequence a chain of `tree_tokens` nodes, as many as fit into `num_tokens`."""
    q = min(tree_tokens, num_tokens // num_seqs)
    n = q * num_seqs
    local = torch.arange(n, device=device) % q
    node = torch.arange(n, device=device)
    g = torch.Generator(device=device).manual_seed(0)

    def pad(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([x, torch.full((num_tokens - n,), fill, dtype=x.dtype, device=device)])

    step = dict(
        parents=pad(torch.where(local > 0, node - 1, -1), -1),
        ancestors=pad((torch.ones_like(node) << (local + 1)) - 1, 1),
        tokens=pad(torch.randint(0, 4, (n,), generator=g, device=device), 0),
        positions=pad(100 + local, 0),
        out_slots=pad(1 + node, 0),
        drawn=pad(torch.randint(0, 4, (n,), generator=g, device=device), 0).double(),
        qo_indptr=(torch.arange(num_seqs + 1, device=device) * q).int(),
        seq_rows=torch.arange(num_seqs, device=device).int(),
    )
    table = torch.zeros(num_seqs + 1, 1024, dtype=torch.int32, device=device)
    return step, table, q


def replay_us(fn) -> float:
    for _ in range(3):  # compile and settle outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS * 1e3


def main() -> None:
    print(f"{torch.cuda.get_device_name()}: us per replay of a graph holding only the walk ({REPLAYS} replays)")
    print("| sequences | tokens | tree | Triton kernel | torch reference | ratio |")
    print("|---|---|---|---|---|---|")
    for num_seqs, num_tokens, tree_tokens in SHAPES:
        step, table, q = chain_step(num_seqs, num_tokens, tree_tokens, "cuda")
        kernel = replay_us(lambda: verify_outcome(**step, slot_table=table, padding_row=num_seqs, max_tree_tokens=q))
        ref_step = {k: v for k, v in step.items() if k != "ancestors"}
        ref = replay_us(lambda: verify_outcome_ref(**ref_step, slot_table=table, padding_row=num_seqs, max_tree_tokens=q))
        print(f"| {num_seqs} | {num_tokens} | {q} | {kernel:.1f} | {ref:.1f} | {ref / kernel:.1f}x |")


if __name__ == "__main__":
    main()
