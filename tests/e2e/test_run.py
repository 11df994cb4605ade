"""``flywheel run``: the whole loop in one command (real Redis, hub, reward service, vLLM-CPU
generator, DeepSpeed learner), its report, and clean shutdowns that leave no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "flywheel.cli", "run", QUICKSTART,
            "--launch.run_dir", str(run_dir), "--launch.display", "false", *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


class Watched:
    """The launcher's output, read on a thread (the launcher may print nothing for a while)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
        self.thread.start()

    def text(self) -> str:
        return "".join(self.lines)


def watch(proc: subprocess.Popen[str], timeout_s: float, until: str | None = None) -> tuple[Watched, set[int]]:
    """Follow the launcher until it exits (or prints ``until``); collect every process it
    started along the way, descendants included."""
    out = Watched(proc)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.NoSuchProcess):
            seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        if until is not None and until in out.text():
            break
        time.sleep(0.3)
    return out, seen


def finish(proc: subprocess.Popen[str], out: Watched) -> str:
    proc.wait(timeout=120)
    out.thread.join(timeout=30)
    return out.text()


def assert_no_orphans(pids: set[int]) -> None:
    deadline = time.monotonic() + 20
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not alive, [psutil.Process(p).cmdline() for p in alive if psutil.pid_exists(p)]


@pytest.mark.timeout(900)  # its own watch allows 600 s: 170-190 s on a quiet machine
def test_quickstart_runs_end_to_end_and_writes_the_report(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--train.total_steps", "8", "--sft.steps", "20")
    out, pids = watch(proc, timeout_s=600)
    text = finish(proc, out)
    assert proc.returncode == 0, text[-5000:]
    assert len(pids) >= 6  # redis, hub, reward (+ a worker), generator (+ vLLM's engine), learner
    assert_no_orphans(pids)
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["steps"] == 8 and 0 <= summary["accuracy_start"] <= 1 and 0 <= summary["accuracy_end"] <= 1
    assert sum(summary["staleness_histogram"].values()) == 8 * 32  # steps x the recipe's groups_per_step
    assert max(int(k) for k in summary["staleness_histogram"]) <= 2  # the recipe's η
    for png in ("reward.png", "staleness.png", "throughput.png"):
        assert (run_dir / "report" / png).stat().st_size > 5000
    assert "report:" in text and str(run_dir) in text
    assert (run_dir / "final_model" / "config.json").exists()


def test_a_failing_service_stops_the_run_and_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--sft.steps", "0", "--reward.functions", "tests.integration.reward_fns:no_such_fn")
    out, pids = watch(proc, timeout_s=300)
    text = finish(proc, out)
    assert proc.returncode == 2, text[-3000:]  # the service refused the configuration: so does the run
    assert "reward exited with code 2" in text and "has no function 'no_such_fn'" in text
    assert_no_orphans(pids)


def test_ctrl_c_shuts_everything_down(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--sft.steps", "0")
    out, pids = watch(proc, timeout_s=300, until="waiting for 1 generator")
    assert proc.poll() is None, out.text()[-3000:]
    time.sleep(2)  # the generator is loading vLLM
    pids |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(signal.SIGINT)
    text = finish(proc, out)
    assert proc.returncode == 130, text[-3000:]
    assert "interrupted" in text
    assert_no_orphans(pids)


@pytest.mark.timeout(900)  # its own watch allows 600 s: 170-190 s on a quiet machine
def test_ray_launcher_runs_the_same_loop_as_actors(tmp_path: Path) -> None:
    """... and ends at a `flywheel finish` sent once the learner trains, not at its 1000 steps:
    the final evaluation and the report follow as at train.total_steps."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--launch.launcher", "ray", "--train.total_steps", "1000", "--sft.steps", "10")
    out, pids = watch(proc, timeout_s=600, until="/1000 reward")  # the watch lines have begun
    metrics = run_dir / "learner_metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, out.text()[-5000:]
        time.sleep(0.5)
    asked = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "finish", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert asked.returncode == 0, asked.stdout + asked.stderr + out.text()[-5000:]
    last = int(asked.stdout.split()[-1])  # "training ends at step N"
    proc.wait(timeout=600)
    text = finish(proc, out)
    assert proc.returncode == 0, text[-5000:]
    assert "ray: placement group of 4 bundles on 1 node(s)" in text
    for service in ("hub", "reward", "generator0", "learner"):
        assert f"ray: {service} on " in text
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["steps"] == last < 1000 and "accuracy_end" in summary
    assert_no_orphans(pids)
