"""Plot GRPO runs from the step tables `recipes/grpo.py` prints: reward and accept rate per
step, and rollout time per step, one line per run (e.g. speculation on and off).

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
            cols[h].append(float(cell))
    return cols


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_a, ax_t) = plt.subplots(1, 3, figsize=(13, 3.5))
    for log in args.logs:
        t = read_table(log)
        name = log.stem
        ax_r.plot(t["step"], t["reward"], marker="o", label=name)
        ax_a.plot(t["step"], t["accept rate"], marker="s", label=name)
        ax_t.plot(t["step"], t["rollout s"], marker=".", label=name)
        print(f"{name}: reward {t['reward'][0]:.3f} -> {t['reward'][-1]:.3f}, "
              f"rollout s median {statistics.median(t['rollout s']):.2f}, mean {statistics.mean(t['rollout s']):.2f}")
    for ax, label in ((ax_r, "mean reward"), (ax_a, "n-gram accept rate"), (ax_t, "rollout s")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
