"""What a learner shows while it runs: a rich progress line for people, wandb for the record
(offline unless a key or a mode is configured), and a JSONL file of every step's metrics."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flywheel.config import FlywheelConfig
from flywheel.files import write_atomically

log = logging.getLogger(__name__)

WANDB_FINISH_TIMEOUT_S = 120.0


class Reporter:
    def __init__(self, cfg: FlywheelConfig, rank: int) -> None:
        self.cfg = cfg
        run_dir = Path(cfg.train.run_dir or Path("runs") / cfg.run.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file = (run_dir / "learner_metrics.jsonl").open("a")
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]learner"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            transient=False,
            disable=not self.console.is_terminal,
        )
        self.task = self.progress.add_task("", total=cfg.train.total_steps)
        self.progress.start()
        self.wandb: Any = None
        mode = cfg.wandb.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            import wandb

            # One wandb run for the whole training run: a learner restarted (by the launcher,
            # after a crash) logs on into it rather than opening another under the same name.
            id_file = run_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            write_atomically(id_file, run_id)
            self.wandb = wandb.init(
                project=cfg.wandb.project,
                name=cfg.run.name,
                id=run_id,
                resume="allow",
                mode=mode,
                dir=str(run_dir),
                config=cfg.model_dump(mode="json", by_alias=True),
            )

    def __call__(self, stats: Any) -> None:
        m = dict(stats.metrics)
        hist = {f"staleness/{k}": v for k, v in sorted(stats.staleness.items())}
        line = (
            f"v{stats.version} reward {m.get('reward/mean', 0):.3f} "
            f"staleness {m.get('batch/staleness_mean', 0):.2f} "
            f"tok/s {m.get('perf/tokens_per_s', 0):.0f} idle {m.get('perf/idle_frac', 0):.0%}"
        )
        self.progress.update(self.task, completed=stats.version, description=line)
        if not self.console.is_terminal:
            log.info("step %s", line)
        record = {"step": stats.version, "time": time.time(), **m, **hist}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log({**m, **hist}, step=stats.version)

    def close(self) -> None:
        self.progress.stop()
        self.metrics_file.close()
        if self.wandb is not None:
            # online, finish uploads what is left: on a network in trouble that can take long, and
            # the learner must still exit (the files stay in the run directory for `wandb sync`)
            finisher = threading.Thread(target=self.wandb.finish, name="wandb-finish", daemon=True)
            finisher.start()
            finisher.join(WANDB_FINISH_TIMEOUT_S)
            if finisher.is_alive():
                log.warning(
                    "wandb did not finish within %.0fs: its files are in %s (upload them with `wandb sync`)",
                    WANDB_FINISH_TIMEOUT_S,
                    getattr(self.wandb, "dir", "the run directory"),
                )
