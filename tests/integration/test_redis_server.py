"""The private redis-server: a start that fails raises with its log named and leaves no process
behind, so the launcher can try again on the same port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flywheel.redis_server import RedisServer
from tests.conftest import ROOT, wait_until


def _redis_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if "redis" in (p.info["name"] or "")}


def test_a_failed_start_raises_and_leaves_nothing_running(tmp_path: Path) -> None:
    before = _redis_pids()
    with pytest.raises(RuntimeError, match="redis.log"):
        RedisServer(tmp_path / "bad", appendfsync="sometimes", ready_timeout_s=5)  # refused by redis-server
    assert _redis_pids() <= before
    assert "appendfsync" in (tmp_path / "bad" / "redis.log").read_text()


def test_the_private_server_rewrites_its_aof_only_past_the_configured_size(tmp_path: Path) -> None:
    """Each AOF rewrite forks Redis beside the hub (a latency spike): a private server waits for
    redis.aof_rewrite_min_mb of AOF, not Redis's 64 MB."""
    server = RedisServer(tmp_path / "r", aof_rewrite_min_mb=2048)
    try:
        client = server.client()
        assert client.config_get("auto-aof-rewrite-min-size") == {"auto-aof-rewrite-min-size": str(2048 << 20)}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        server.stop()


OWNER = """
import signal, sys, time
from flywheel.redis_server import RedisServer
server = RedisServer(sys.argv[1])
signal.signal(signal.SIGINT, lambda *_: print("interrupted", flush=True))  # a launcher's handler
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_redis_outlives_a_ctrl_c_to_its_owners_group_and_not_its_owners_death(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the launcher's whole process group: Redis, in a session of
    its own, is not in it (the launcher stops it last, after the services' drain). A launcher
    killed with kill -9 takes its Redis with it (a clean shutdown), leaving no server holding
    the port and the AOF directory a restarted run needs."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "r")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the owner leads a process group, as a launcher run from a shell does
    )
    try:
        assert owner.stdout is not None
        redis_proc = psutil.Process(int(owner.stdout.readline()))
        os.killpg(owner.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        assert owner.stdout.readline().strip() == "interrupted"
        time.sleep(0.5)
        assert redis_proc.is_running() and redis_proc.status() != psutil.STATUS_ZOMBIE, "Ctrl-C stopped Redis"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        wait_until(
            lambda: not redis_proc.is_running() or redis_proc.status() == psutil.STATUS_ZOMBIE,
            15,
            "Redis stopped with its owner",
        )
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_the_ray_launchers_redis_is_watched_and_restarted_with_its_data(tmp_path: Path) -> None:
    """On Ray the launcher reads Redis's exit through its actor (``RedisRunner``, the class the
    actor runs) and has it start Redis again on the same port and AOF, as the local launcher does."""
    from flywheel.ray_launch import RedisRunner

    runner = RedisRunner(str(tmp_path / "r"), "127.0.0.1", "always", 1024, None, None)
    try:
        runner.server.client().set("kept", "yes")
        assert runner.returncode() is None
        os.kill(runner.server.proc.pid, signal.SIGKILL)
        wait_until(lambda: runner.returncode() is not None, 10, "Redis's exit seen")
        port = runner.port()
        runner.restart(ready_timeout_s=10)
        assert runner.port() == port and runner.returncode() is None
        assert runner.server.client().get("kept") == b"yes"
    finally:
        runner.stop()
