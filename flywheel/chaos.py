"""Chaos: kill -9 services of a running ``flywheel run`` at random and measure how it recovers.

The run is an ordinary ``flywheel run`` (its launcher restarts what dies: ``launch.restart``);
this module only injects faults and keeps score. Used by ``tests/chaos`` (a short run) and
``bench/chaos.py`` (a long one).

For each fault: which service, when, and how long until the system had recovered, meaning both
- the service is back: a new process, and ready (a generator registered at the hub again, the
  reward service connected, the hub answering, Redis answering, the learner training), and
- training progressed: the learner finished a step after the kill.

At the end, an audit from the run's files and its Redis (reopened from the AOF):
- chunks acknowledged (every generator's ack log, ``generator.ack_log``) against chunks persisted
  (the hub's counter, written in the same transaction as the chunks): an acknowledged chunk that
  Redis lost would show as more acks than chunks;
- groups claimed twice (every learner rank's claims log): must be 0;
- whether the learner reached ``train.total_steps``, or the step a finish request (``flywheel
  finish``, sent once the faults are over) ended training at.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from flywheel.hub_client import hub_metrics, request_finish
from flywheel.launcher import read_services, run_redis_url
from flywheel.redis_server import RedisServer
from flywheel.store import RunKeys

ROOT = Path(__file__).resolve().parents[1]
VICTIMS = ("generator", "hub", "reward", "redis", "learner")


@dataclass
class Fault:
    service: str
    at_s: float  # since the run started
    version_at_kill: int
    back_s: float | None = None  # until the service was back and ready
    progress_s: float | None = None  # until the learner finished a step after the kill

    @property
    def recovery_s(self) -> float | None:
        if self.back_s is None or self.progress_s is None:
            return None
        return max(self.back_s, self.progress_s)


@dataclass
class ChaosReport:
    faults: list[Fault] = field(default_factory=list)
    chunks_acked: int = 0
    chunks_persisted: int = 0
    groups_claimed: int = 0
    groups_claimed_twice: int = 0
    final_version: int = 0
    target_version: int = 0
    launcher_exit: int | None = None
    wall_s: float = 0.0
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def acked_not_persisted(self) -> int:
        return max(0, self.chunks_acked - self.chunks_persisted)

    @property
    def reached_target(self) -> bool:
        return self.launcher_exit == 0 and self.final_version >= self.target_version

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for f, d in zip(self.faults, out["faults"], strict=True):
            d["recovery_s"] = f.recovery_s
        out |= {"acked_not_persisted": self.acked_not_persisted, "reached_target": self.reached_target}
        return out

    def table(self) -> str:
        rows = [
            "| # | service | at (s) | version | back (s) | progress (s) | recovery (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, f in enumerate(self.faults, 1):
            cells = [f.back_s, f.progress_s, f.recovery_s]
            shown = " | ".join("never" if c is None else f"{c:.1f}" for c in cells)
            rows.append(f"| {i} | {f.service} | {f.at_s:.0f} | {f.version_at_kill} | {shown} |")
        rows += [
            "",
            f"faults injected: {len(self.faults)}; restarts by the launcher: {self.restarts}",
            f"chunks acknowledged: {self.chunks_acked}; persisted: {self.chunks_persisted}; "
            f"acknowledged but not persisted: {self.acked_not_persisted}",
            f"groups claimed: {self.groups_claimed}; claimed twice: {self.groups_claimed_twice}",
            f"learner version {self.final_version} of {self.target_version}; launcher exit {self.launcher_exit}; "
            f"wall {self.wall_s:.0f}s",
        ]
        return "\n".join(rows)


class ChaosRun:
    """One ``flywheel run`` under fault injection."""

    def __init__(self, recipe: str, run_dir: Path, overrides: list[str], seed: int = 0) -> None:
        self.run_dir = run_dir
        self.rng = random.Random(seed)
        self.log_path = run_dir.with_name(run_dir.name + ".launcher.log")
        self._log = self.log_path.open("w")
        cmd = [sys.executable, "-m", "flywheel.cli", "run", recipe, "--launch.run_dir", str(run_dir)]
        cmd += ["--launch.display", "false", *overrides]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        self.started = time.monotonic()
        self.report = ChaosReport()

    # ------------------------------------------------------------------ what the run shows

    def pids(self) -> dict[str, int]:
        try:
            data = read_services(self.run_dir)
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data["pids"].items() if v is not None}

    def version(self) -> int:
        """The learner's last finished step (its metrics file)."""
        path = self.run_dir / "learner_metrics.jsonl"
        if not path.exists():
            return 0
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 8192))
            lines = f.read().splitlines()
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                return int(json.loads(line)["step"])
        return 0

    def hub(self) -> dict[str, float]:
        try:
            port = json.loads((self.run_dir / "hub.json").read_text())["metrics_port"]
        except (OSError, ValueError, KeyError):
            return {}
        return hub_metrics("127.0.0.1", port)

    def redis_answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(run_redis_url(self.run_dir), socket_timeout=1).ping())
        except (OSError, ValueError, KeyError, redis.RedisError):
            return False

    def _ready(self, service: str, before: dict[str, float]) -> bool:
        """``service`` is back: registered again at the hub (which may not have noticed the death
        yet), answering, or (the learner) training, which the progress check sees."""
        if service in ("generator", "reward"):
            key = f"{service}_registrations"
            return self.hub().get(key, 0) > before.get(key, 0)
        if service == "redis":
            return self.redis_answers()
        if service == "hub":
            return bool(self.hub())
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, what: str, cond: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if not self.alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.25)
        return True

    # ------------------------------------------------------------------ faults

    def kill(self, service: str, recover_timeout_s: float) -> Fault | None:
        """kill -9 one instance of ``service`` (a random generator), then wait until the system
        recovered (or ``recover_timeout_s`` passed)."""
        pids = self.pids()
        names = sorted(n for n in pids if n == service or (service == "generator" and n.startswith("generator")))
        if not names:
            return None
        name = self.rng.choice(names)
        pid, version = pids[name], self.version()
        before = self.hub()
        t0 = time.monotonic()
        fault = Fault(name, t0 - self.started, version)
        try:
            if name == "redis":  # not a process group of its own
                os.kill(pid, signal.SIGKILL)
            else:  # the service and what it started (vLLM's engine core), as a dying container
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.report.faults.append(fault)
        back = self.wait(
            "back",
            lambda: self.pids().get(name, pid) != pid and self._ready(service, before),
            recover_timeout_s,
        )
        if back:
            fault.back_s = time.monotonic() - t0
        if self.wait("progress", lambda: self.version() > version, recover_timeout_s):
            fault.progress_s = time.monotonic() - t0
        return fault

    def inject(
        self,
        faults: int,
        interval_s: tuple[float, float],
        recover_timeout_s: float,
        victims: tuple[str, ...] = VICTIMS,
        until_version: int | None = None,
    ) -> None:
        """``faults`` kills at random intervals, every kind of victim before any twice; none once
        the learner reached ``until_version`` (a recovery needs steps left to show)."""
        order: list[str] = []
        while len(self.report.faults) < faults and self.alive():
            if until_version is not None and self.version() >= until_version:
                return
            if not order:
                order = list(victims)
                self.rng.shuffle(order)
            time.sleep(self.rng.uniform(*interval_s))
            if self.alive():
                self.kill(order.pop(), recover_timeout_s)

    # ------------------------------------------------------------------ the end

    def finish_early(self, steps_left: int) -> int | None:
        """End training ``steps_left`` steps from now (``flywheel finish``): once the faults are
        over, the rest of ``train.total_steps`` would show nothing more. Returns the last step,
        or None when the run's Redis could not be asked (the run then goes to its end)."""
        try:
            url = run_redis_url(self.run_dir)
            name = _yaml(self.run_dir / "config.yaml")["run"]["name"]
            client = redis.Redis.from_url(url, socket_timeout=10)
            return request_finish(client, name, self.version() + steps_left)
        except (OSError, ValueError, KeyError, redis.RedisError):
            return None

    def finish(self, timeout_s: float) -> ChaosReport:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
        self._log.close()
        self.report.launcher_exit = self.proc.returncode
        self.report.wall_s = time.monotonic() - self.started
        self.report.final_version = self.version()
        self._audit()
        return self.report

    def stop(self) -> None:
        """Stop the launcher if it still runs (it shuts its services down)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()

    def _audit(self) -> None:
        r, run_dir = self.report, self.run_dir
        with contextlib.suppress(OSError, ValueError):
            r.restarts = read_services(run_dir)["restarts"]
        cfg = json.loads(json.dumps(_yaml(run_dir / "config.yaml")))
        r.target_version = int(cfg["train"]["total_steps"])  # or sooner, if a finish was asked (below)
        r.chunks_acked = sum(
            int(line) for f in (run_dir / "acks").glob("*.log") for line in f.read_text().split() if line.isdigit()
        )
        claimed = Counter(int(g) for f in run_dir.glob("claims.rank*.log") for g in f.read_text().split())
        r.groups_claimed = len(claimed)
        r.groups_claimed_twice = sum(1 for n in claimed.values() if n > 1)
        # Redis again, from the run's AOF: what it persisted is what survived every crash
        with RedisServer(run_dir / "redis", ready_timeout_s=300) as server:  # a long run's AOF loads first
            client = redis.Redis.from_url(server.url, socket_timeout=10)
            keys = RunKeys(cfg["run"]["name"])
            r.chunks_persisted = int(client.hget(keys.counters, "chunks_persisted") or 0)
            finish_at = client.get(keys.finish_at)
            if finish_at is not None:
                r.target_version = min(r.target_version, int(finish_at))


def _yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())
