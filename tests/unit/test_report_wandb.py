"""The learner's wandb record across restarts."""

from __future__ import annotations

from pathlib import Path

from flywheel.config import load_config
from learner.report import Reporter


def test_a_restarted_learner_logs_on_into_the_same_wandb_run(tmp_path: Path) -> None:
    cfg = load_config(["--train.run_dir", str(tmp_path), "--wandb.mode", "offline"])
    ids = []
    for _ in range(2):  # a learner, then the one its launcher restarted after a crash
        reporter = Reporter(cfg, 0)
        ids.append(reporter.wandb.id)
        reporter.close()
    assert ids[0] == ids[1], "a second wandb run under the same name"
    assert (tmp_path / "wandb_run_id").read_text() == ids[0]
