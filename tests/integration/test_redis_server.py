"""The private redis-server: a start that fails raises with its log named and leaves no process
behind, so the launcher can try again on the same port."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from flywheel.redis_server import RedisServer


def _redis_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if "redis" in (p.info["name"] or "")}


def test_a_failed_start_raises_and_leaves_nothing_running(tmp_path: Path) -> None:
    before = _redis_pids()
    with pytest.raises(RuntimeError, match="redis.log"):
        RedisServer(tmp_path / "bad", appendfsync="sometimes", ready_timeout_s=5)  # refused by redis-server
    assert _redis_pids() <= before
    assert "appendfsync" in (tmp_path / "bad" / "redis.log").read_text()
