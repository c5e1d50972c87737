"""The drafting kernel's device time against a decode step's, at RL batch sizes (GPU).

    python bench/draft_cost.py [--seqs 512] [--output-len 1000] [--history 8]

Token rows as an RL rollout leaves them: `--seqs` live samples in groups of 8 (prompts of 100
tokens, `--output-len` tokens of output each) and `--history` finished samples per prompt from
an earlier epoch. Outputs repeat short motifs drawn per prompt, so that matches are found and
trees are built (the kernel's work does not depend much on what matches). Prints the median
device time of `draft_trees` alone and of a replay of the default model's decode graph at the
same batch size, and their ratio (issue 23's target: at most 3% at 512 sequences).
"""

from __future__ import annotations

import argparse

import torch
import triton

from kernels.ngram_draft import draft_trees
from rollout import Engine
from spec.speculator import CANDIDATES, SCAN_WIDTH


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--history", type=int, default=8, help="finished samples per prompt")
    ap.add_argument("--width", type=int, default=8)
    args = ap.parse_args()
    engine = Engine(model="default", spec="ngram", device="cuda", max_running_seqs=args.seqs,
                    max_model_len=args.output_len + 2000)  # (room for the decode replays below to grow the rows)
    table = engine.table
    g = torch.Generator().manual_seed(0)
    groups = args.seqs // 8
    prompt_len = 100
    length = prompt_len + args.output_len
    scan = torch.full((args.seqs, SCAN_WIDTH), -1, dtype=torch.int32)
    hist = table.history_start
    for p in range(groups):
        prompt = torch.randint(0, 49152, (prompt_len,), generator=g)
        motif = torch.randint(0, 49152, (24,), generator=g)
        rows = list(range(8 * p, 8 * p + 8)) + list(range(hist + args.history * p, hist + args.history * (p + 1)))
        for r in rows:
            out = motif[torch.randint(0, 24, (args.output_len,), generator=g)]
            table.tokens[r, :length] = torch.cat([prompt, out]).to(torch.int32)
            table.lengths[r] = length
            table.prompt_lens[r] = prompt_len
        for r in range(8 * p, 8 * p + 8):
            scan[r, : min(len(rows), SCAN_WIDTH)] = torch.tensor(rows[:SCAN_WIDTH], dtype=torch.int32)
    rows = torch.arange(args.seqs, dtype=torch.int32, device="cuda")
    scan = scan.cuda()
    cfg = engine.config.spec

    def draft():
        return draft_trees(table.tokens, table.lengths, table.prompt_lens, table.history_start, rows, scan,
                           cfg.max_match, cfg.min_match, CANDIDATES, args.width, args.width)

    drafted = draft()[1]
    found = int((drafted[:, 1:] >= 0).any(dim=1).sum())
    draft_ms = triton.testing.do_bench(draft, return_mode="median")
    graphs = engine.runner.graphs
    shape = graphs.shape(args.seqs, 0, False, "sample")
    graph = graphs._graphs.get(shape) or graphs._capture(*shape)
    graph.inputs.rows.copy_(rows)  # the real rows: attention over their whole context
    graph.inputs.params[0].fill_(1.0)  # temperature
    step_ms = triton.testing.do_bench(graph.graph.replay, return_mode="median")
    print(f"{args.seqs} sequences, {length} tokens each, {args.history} history rows per prompt, width {args.width}: "
          f"{found} trees with drafts")
    print(f"| drafting kernel | {draft_ms * 1e3:.1f} us | decode step (graph replay) | {step_ms * 1e3:.1f} us | "
          f"ratio | {draft_ms / step_ms:.1%} |")


if __name__ == "__main__":
    main()
