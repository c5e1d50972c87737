"""The tables after `CYCLES=N bench/ab_versions.sh run REV...`: for each version, each row's
ratio to spec off (from the same run), per cycle, and the median over cycles; then each row's
median step ms per cycle, their median, and that against the first version's (a single mode's A/B,
where the versions' samples differ: steps compare where tokens/s hangs on how long they ran).

    python bench/ab_summary.py OUT REV...

OUT/REV/CYCLE/*.json are `rollout bench`'s results (bench/ab_versions.sh writes them there).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def ratios(run: Path) -> dict[tuple, float]:
    """(workload, spec, batch size, temperature) -> tokens/s over spec off's in the same run."""
    out = {}
    for file in sorted(run.glob("*.json")):
        rows = json.loads(file.read_text())["rows"]
        off = {(r["workload"], r["batch_size"], r["temperature"]): r["tokens_per_s"] for r in rows if r["spec"] == "off"}
        for r in rows:
            base = off.get((r["workload"], r["batch_size"], r["temperature"]))
            if r["spec"] != "off" and base:
                out[(r["workload"], r["spec"], r["batch_size"], r["temperature"])] = r["tokens_per_s"] / base
    return out


def step_ms(run: Path) -> dict[tuple, float]:
    """(workload, spec, batch size, temperature) -> the run's median step ms."""
    return {(r["workload"], r["spec"], r["batch_size"], r["temperature"]): r["step_ms_median"]
            for file in sorted(run.glob("*.json")) for r in json.loads(file.read_text())["rows"]}


def by_key(out: Path, rev: str, read) -> list[tuple[tuple, list[float]]]:
    """(row key, its value in each cycle that has it), from `read` over each cycle's run of `rev`."""
    cycles = [read(d) for d in sorted((out / rev).iterdir(), key=lambda p: int(p.name)) if d.name.isdigit()]
    return [(key, [c[key] for c in cycles if key in c]) for key in sorted({k for c in cycles for k in c})]


def main(out: Path, revs: list[str]) -> None:
    print("| version | workload | spec | batch | temp | ratio per cycle | median |\n|---|---|---|---|---|---|---|")
    for rev in revs:
        for key, seen in by_key(out, rev, ratios):
            each = " / ".join(f"{r:.2f}" for r in seen)
            print(f"| {rev} | {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {each} | **{statistics.median(seen):.2f}x** |")
    print(f"\n| version | workload | spec | batch | temp | step ms per cycle | median "
          f"| speed vs {revs[0]} (its step / this) |\n|---|---|---|---|---|---|---|---|")
    first = {}
    for rev in revs:
        for key, seen in by_key(out, rev, step_ms):
            median = statistics.median(seen)
            first.setdefault(key, median)
            print(f"| {rev} | {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {' / '.join(f'{m:.2f}' for m in seen)} "
                  f"| {median:.2f} | **{first[key] / median:.2f}x** |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
