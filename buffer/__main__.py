"""Entry point of the hub: ``flywheel-buffer`` / ``python -m buffer``.

Parses the config before importing anything heavy, so ``--help`` answers at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from flywheel.config import FlywheelConfig, service_config
from flywheel.logs import setup_logging

log = logging.getLogger("buffer")


def main(argv: list[str] | None = None) -> int:
    cfg = service_config(
        "flywheel-buffer",
        "Run the rollout hub (needs redis.url, data.path and data.tokenizer).",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    setup_logging("hub", cfg.run.log_level)
    if cfg.redis.url is None:
        print(
            "flywheel-buffer: redis.url is required: pass --redis.url redis://HOST:PORT/0 of a Redis with AOF on",
            file=sys.stderr,
        )
        return 2
    if cfg.data.path is None:
        print(
            "flywheel-buffer: data.path is required: a JSONL, parquet or HF datasets directory of prompts",
            file=sys.stderr,
        )
        return 2

    import redis

    from buffer import recovery
    from buffer.hub import Hub
    from buffer.prompts import PromptSource
    from flywheel.netsec import check_keys, mask_credentials, redis_client
    from flywheel.store import shared_settings

    try:
        check_keys(cfg.security, server=True)
        client = redis_client(cfg.redis)
    except ValueError as err:
        print(f"flywheel-buffer: {err}", file=sys.stderr)
        return 2
    shown_url = mask_credentials(cfg.redis.url)
    deadline = time.monotonic() + cfg.redis.connect_timeout_s
    while True:  # Redis may still be starting (docker-compose starts both at once)
        try:
            client.ping()
            break
        except redis.RedisError as err:
            if time.monotonic() > deadline:
                print(f"flywheel-buffer: cannot reach Redis at {shown_url}: {err}; check redis.url", file=sys.stderr)
                return 2
            time.sleep(0.2)
    _warn_unless_persistent(client, shown_url)
    try:
        source = PromptSource.from_config(cfg.data)
    except (ValueError, OSError) as err:
        print(f"flywheel-buffer: cannot load prompts: {err}", file=sys.stderr)
        return 2
    hub = Hub(cfg, source, client)
    recovery.load(hub)
    changed = recovery.prompt_order_changed(hub)
    if changed is not None:
        print(f"flywheel-buffer: {changed}", file=sys.stderr)
        return 2
    client.hset(hub.keys.settings, mapping=shared_settings(cfg))  # what the run's learners must agree with
    hub.start_metrics()
    hub.write_state_file()
    log.info(
        "hub listening: %s, run %r, %d prompts, max_staleness %d, groups_per_step %d",
        hub.ports,
        cfg.run.name,
        len(source),
        cfg.async_.max_staleness,
        cfg.async_.groups_per_step,
    )
    _warn_if_scores_sent_again_early(cfg)
    signal.signal(signal.SIGTERM, lambda *_: hub.stop())
    signal.signal(signal.SIGINT, lambda *_: hub.stop())
    try:
        hub.run()
    except redis.RedisError as err:
        # Memory may now be ahead of Redis, and Redis is the truth: stop without acking anything
        # more; a restart rebuilds from Redis and generators resend what was not acknowledged.
        log.error("Redis failed (%s): exiting so that a restart recovers from Redis", err)
        return 3
    log.info("hub stopped")
    return 0


def _warn_if_scores_sent_again_early(cfg: FlywheelConfig) -> bool:
    """A score request is sent again after ``hub.score_timeout_s``; one call of the reward
    functions may last ``reward.timeout_s``, after the request waited its turn in the service. A
    request sent again while its call still runs is scored twice when it reaches another reward
    service (the one that holds it drops the copy): waste, not harm, so a warning."""
    if cfg.hub.score_timeout_s >= 2 * cfg.reward.timeout_s:
        return False
    log.warning(
        "hub.score_timeout_s %gs is under twice reward.timeout_s %gs: a score request may be sent again while its "
        "reward call still runs, and scored twice by another reward service; raise --hub.score_timeout_s to %g",
        cfg.hub.score_timeout_s,
        cfg.reward.timeout_s,
        2 * cfg.reward.timeout_s,
    )
    return True


def _warn_unless_persistent(client: object, url: str) -> None:
    """Acks promise durability: say so loudly when the Redis behind them keeps no AOF (and, more
    quietly, when it rewrites that AOF so often that each rewrite shows in the ack latency)."""
    import redis

    assert isinstance(client, redis.Redis)
    try:
        settings = client.config_get("appendonly", "auto-aof-rewrite-min-size")
        appendonly = settings.get("appendonly")
        rewrite_min = int(settings.get("auto-aof-rewrite-min-size") or 0)
    except (redis.RedisError, ValueError):  # managed Redis may refuse CONFIG: nothing to check
        return
    if appendonly != b"yes" and appendonly != "yes":
        log.warning(
            "Redis at %s runs without append-only persistence: a Redis crash loses acknowledged chunks; "
            "start it with --appendonly yes",
            url,
        )
    elif rewrite_min < 256 << 20:
        log.info(
            "Redis at %s rewrites its AOF from %d MB on: each rewrite forks Redis beside the hub, a latency "
            "spike every few seconds at high token rates; --auto-aof-rewrite-min-size 1gb avoids most of them "
            "(as redis.aof_rewrite_min_mb does for a private server)",
            url,
            rewrite_min >> 20,
        )


if __name__ == "__main__":
    sys.exit(main())
