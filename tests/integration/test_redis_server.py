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
