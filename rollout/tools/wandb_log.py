"""Acceptance and throughput statistics to Weights & Biases, offline unless W&B is set up."""

from __future__ import annotations

import netrc
import os
from pathlib import Path


def wandb_mode() -> str:
    """WANDB_MODE when the user set it; online when credentials exist; otherwise offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


class WandbLogger:
    """A W&B run. What the user set in W&B's own variables wins over the caller's defaults, as W&B
    documents them: WANDB_PROJECT over `default_project` (a `project` given explicitly wins, as an
    argument to `wandb.init` does), WANDB_DIR over `directory`, WANDB_MODE over `wandb_mode()`'s guess."""

    def __init__(self, project: str | None = None, name: str | None = None, config: dict | None = None,
                 directory: str | Path | None = None, default_project: str = "rollout"):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        project = project or os.environ.get("WANDB_PROJECT") or default_project
        # read here, not left to W&B: its settings are read once a process, so a WANDB_DIR set after an
        # earlier run in the same process (a trainer's second recipe, a test after another) was ignored
        directory = os.environ.get("WANDB_DIR") or directory
        self.run = wandb.init(project=project, name=name, config=config or {}, dir=directory, mode=wandb_mode())

    @property
    def run_dir(self) -> Path:
        """The run's own directory (offline-run-* or run-*), holding its .wandb file."""
        return Path(self.run.dir).parent

    def log(self, metrics: dict, step: int | None = None) -> None:
        """One whole row per call, written at once (with an explicit step, W&B would otherwise hold
        the row until a later step or `finish`)."""
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step, commit=True)

    def finish(self) -> None:
        self.run.finish()
