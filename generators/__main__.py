"""Entry point of a vLLM generator: ``flywheel-generator`` / ``python -m generators``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from flywheel.config import FlywheelConfig, service_config
from flywheel.logs import setup_logging
from flywheel.standby import mark_ready, wait_for_takeover

log = logging.getLogger("generators")


async def serve(cfg: FlywheelConfig, max_seconds: float | None = None) -> int:
    from generators.engine import build_engine, engine_max_model_len
    from generators.hub_link import HubLink
    from generators.service import GeneratorService
    from generators.sync_link import SyncLink

    engine = build_engine(cfg.generator)
    if cfg.generator.standby_file:  # a spare: loaded, idle until a generator's place is handed over
        standby = Path(cfg.generator.standby_file)
        mark_ready(standby)
        log.info("spare generator loaded: waiting for a takeover at %s", standby)
        try:
            takeover = await wait_for_takeover(standby)
        except BaseException:  # a bad takeover file, or stopped while waiting: free the engine first
            engine.shutdown()
            raise
        log.info("spare generator taking over as %s", takeover.generator_id)
        gen = cfg.generator.model_copy(update={"id": takeover.generator_id, "ack_log": takeover.ack_log})
        cfg = cfg.model_copy(update={"generator": gen})
    gcfg = cfg.generator
    generator_id = gcfg.id or f"{socket.gethostname()}-{os.getpid()}"
    link = HubLink(
        gcfg.hub_address,
        generator_id,
        gcfg.model or "",
        gcfg.capacity,
        resend_after_s=gcfg.resend_after_s,
        heartbeat_s=gcfg.heartbeat_s,
        ack_log=gcfg.ack_log,
        security=cfg.security,
        max_message_bytes=cfg.hub.max_message_bytes,  # the hub's limit: its frames stay under it
    )
    sync = SyncLink(
        cfg.sync.host,
        cfg.sync.announce_port,
        cfg.sync.join_port,
        generator_id,
        gcfg.tensor_parallel_size,
        security=cfg.security,
    )
    service = GeneratorService(cfg, engine, link, sync, generator_id, engine_max_model_len(engine))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.drain)
    log.info("generator %s serving %s, hub %s", generator_id, gcfg.model, gcfg.hub_address)
    try:
        await service.run(max_seconds)
    finally:
        link.close()
        sync.close()
        engine.shutdown()
        # vLLM's __del__ shuts the engine down again, at interpreter exit, when its module
        # globals are gone: a TypeError traceback at the end of every generator log
        engine.shutdown = lambda *_, **__: None
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = service_config(
        "flywheel-generator",
        "Run one vLLM generator: take leases from the hub (generator.hub_address), stream chunks back, "
        "load new weights from the learner (sync.*) in flight.",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    if cfg.generator.model is None:
        print("flywheel-generator: generator.model is required: pass --generator.model PATH", file=sys.stderr)
        return 2
    from flywheel.netsec import check_keys

    try:
        check_keys(cfg.security, server=False)
    except ValueError as err:
        print(f"flywheel-generator: {err}", file=sys.stderr)
        return 2
    setup_logging("generator", cfg.run.log_level)
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
