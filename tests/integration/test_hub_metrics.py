"""The hub's /metrics endpoint, served from a hub built in this process on a real Redis."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest

from buffer import recovery
from buffer.hub import Hub
from buffer.prompts import PromptSource
from flywheel.config import load_config
from flywheel.redis_server import RedisServer


def test_a_scrape_reads_the_stats_through_the_hub_loop_and_a_silent_loop_gets_the_last_ones(
    redis_server: RedisServer, tokenizer_dir: Path, prompts_jsonl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stats are the loop's own dicts and deques; read on a metrics thread they could change
    size mid-read (the scrape then failed with HTTP 500). A scrape now asks the loop, which takes
    the snapshot between turns; with the loop stopped, the last snapshot is served again."""
    taken_on: list[str] = []
    snapshot = Hub.snapshot

    def spy(self: Hub) -> dict[str, object]:
        taken_on.append(threading.current_thread().name)
        return snapshot(self)

    monkeypatch.setattr(Hub, "snapshot", spy)
    cfg = load_config(
        [
            "--redis.url", redis_server.url,
            "--data.path", str(prompts_jsonl), "--data.tokenizer", str(tokenizer_dir),
            "--hub.generator_port", "0", "--hub.reward_port", "0", "--hub.metrics_port", "0",
        ]
    )  # fmt: skip
    hub = Hub(cfg, PromptSource.from_config(cfg.data), redis_server.client())
    recovery.load(hub)
    hub.start_metrics()
    url = f"http://127.0.0.1:{hub.ports['metrics_port']}/metrics"
    loop = threading.Thread(target=hub.run, name="hub-loop", daemon=True)
    loop.start()
    try:
        for _ in range(5):
            body = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "flywheel_hub_chunks_in_total 0.0" in body
            assert "process_cpu_seconds_total" in body  # the standard collectors, in the hub's own registry
        assert taken_on and set(taken_on) == {"hub-loop"}, f"snapshots taken on {sorted(set(taken_on))}"
    finally:
        hub.stop()
        loop.join(timeout=10)
    hub.snapshots.timeout_s = 0.3
    started = time.monotonic()
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    assert time.monotonic() - started < 5
    assert "flywheel_hub_chunks_in_total 0.0" in body and "flywheel_hub_stale_scrapes_total 1.0" in body
    assert set(taken_on) == {"hub-loop"}
    hub.gen_sock.close(linger=0)
    hub.reward_sock.close(linger=0)
