"""What the simulated-fleet benchmarks share (``async_vs_sync.py --sim``, ``load.py``): the hub and
the reward service as real processes on free ports, the simulated engines spread over several
``generators.fleet`` processes, and the fleet's cumulative figures.

Every process is a ``flywheel.procs.Service``: started by this run, stopped by pid.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from flywheel.hub_client import hub_metrics
from flywheel.procs import Service, wait_for_state_file


def hub_args(run: str, redis_url: str, data: Path, tokenizer: Path, state: Path) -> list[str]:
    """The flags every service of a simulated run shares (ports: free ones, written to ``state``)."""
    return [
        "--run.name", run,
        "--redis.url", redis_url,
        "--data.path", str(data),
        "--data.tokenizer", str(tokenizer),
        "--data.epochs", "1000",
        "--reward.functions", "length",
        "--reward.workers", "1",
        "--hub.generator_port", "0",
        "--hub.reward_port", "0",
        "--hub.metrics_port", "0",
        "--hub.state_file", str(state),
    ]  # fmt: skip


def start_hub_and_reward(work: Path, args: list[str], services: list[Service]) -> tuple[Service, dict[str, int]]:
    """Start the hub, then the reward service on its reward port; both are appended to ``services``
    as soon as they run (so the caller stops them even if this fails)."""
    state = Path(args[args.index("--hub.state_file") + 1])
    hub = Service("hub", "buffer", args, work)
    services.append(hub)
    ports = wait_for_state_file(state, hub, timeout_s=90)
    reward_args = [*args, "--reward.hub_address", f"tcp://127.0.0.1:{ports['reward_port']}"]
    services.append(Service("reward", "reward_service", reward_args, work))
    return hub, ports


def start_fleet(
    work: Path,
    name: str,
    generators: int,
    procs: int,
    common: list[str],
    services: list[Service],
    audit: bool = False,
    nice: int = 0,
) -> tuple[list[Path], list[Path]]:
    """``generators`` simulated engines over ``procs`` fleet processes (engine ids sim0...), each
    with ``common`` flags (hub, redis, run, engine model), at scheduling priority ``nice``. Returns
    their stats files and (with ``audit``) the files where each lists, at exit, every chunk the hub
    acknowledged to it."""
    procs = min(generators, procs)
    stats = [work / f"{name}-{p}.json" for p in range(procs)]
    audits = [work / f"{name}-{p}-audit.json" for p in range(procs)]
    for p in range(procs):
        first, last = generators * p // procs, generators * (p + 1) // procs
        args = [*common, "--engines", str(last - first), "--first", str(first), "--seed", str(p)]
        args += ["--stats-file", str(stats[p])]
        if audit:
            args += ["--audit-file", str(audits[p])]
        services.append(Service(f"{name}{p}", "generators.fleet", args, work))
        if nice:
            psutil.Process(services[-1].pid).nice(nice)
    return stats, audits if audit else []


def wait_registered(metrics_port: int, generators: int, stats_files: list[Path], timeout_s: float) -> float:
    """Wait until the hub counts ``generators`` registered and every fleet process has written its
    stats; return the seconds it took. Raises TimeoutError."""
    start = time.monotonic()
    while hub_metrics("127.0.0.1", metrics_port).get("generators", 0) < generators or not all(
        f.exists() for f in stats_files
    ):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{generators} simulated generators did not register within {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def fleet_totals(files: list[Path]) -> dict[str, float]:
    """The fleet processes' cumulative figures, summed; ``time`` is when they were written (mean)."""
    out: dict[str, float] = {}
    for f in files:
        for k, v in json.loads(f.read_text()).items():
            out[k] = out.get(k, 0.0) + v
    out["time"] /= len(files)
    return out
