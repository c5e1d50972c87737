"""WandbLogger against the real W&B client (offline): the user's W&B variables win over the caller's defaults."""

from __future__ import annotations

from rollout.tools.wandb_log import WandbLogger


def test_a_wandb_dir_set_after_an_earlier_run_in_the_process_is_where_the_next_run_goes(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    first = WandbLogger("rollout-test", directory=tmp_path / "out")
    first.finish()
    assert first.run_dir.is_relative_to(tmp_path / "out"), first.run_dir
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "user"))  # (W&B itself reads its settings once a process)
    second = WandbLogger("rollout-test", directory=tmp_path / "out")
    second.finish()
    assert second.run_dir.is_relative_to(tmp_path / "user"), second.run_dir
