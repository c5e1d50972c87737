"""Plot GRPO runs from the step tables `recipes/grpo.py` prints: reward and accept rate per
step, rollout time per step and, where the tables have it, the rollout's logprob mismatch against
the trainer, one line per run (e.g. speculation on and off, or bf16 and fp16).

    python bench/plot_grpo_logs.py bench/results/grpo-h100/grpo-ngram.log bench/results/grpo-h100/grpo-off.log \
        --out bench/results/grpo-h100/grpo.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def read_table(path: Path) -> dict[str, list[float]]:
    rows = [line.strip().strip("|").split("|") for line in path.read_text().splitlines() if line.startswith("| ")]
    head = [h.strip() for h in rows[0]]
    cols: dict[str, list[float]] = {h: [] for h in head}
    for row in rows[1:]:
        for h, cell in zip(head, row):
            cols[h].append(float(cell) if cell.strip() != "-" else float("nan"))  # ("-": not applicable)
    return cols


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = {log.stem: read_table(log) for log in args.logs}
    panels = {"reward": "mean reward", "accept rate": "n-gram accept rate", "rollout s": "rollout s"}
    if all("mismatch" in t for t in tables.values()):
        panels["mismatch"] = "mean abs logprob mismatch"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.5))
    for name, t in tables.items():
        for ax, column in zip(axes, panels):
            ax.plot(t["step"], t[column], marker=".", label=name)
        print(f"{name}: reward {t['reward'][0]:.3f} -> {t['reward'][-1]:.3f}, "
              f"rollout s median {statistics.median(t['rollout s']):.2f}, mean {statistics.mean(t['rollout s']):.2f}"
              + (f", mismatch median {statistics.median(t['mismatch']):.2e}" if "mismatch" in t else ""))
    for ax, label in zip(axes, panels.values()):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
