"""Entry point of the reward service: ``flywheel-reward`` / ``python -m reward_service``."""

from __future__ import annotations

import os
import signal
import socket
import sys

from flywheel.config import service_config
from flywheel.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    cfg = service_config(
        "flywheel-reward",
        "Run the reward service: a pool of reward workers fed by the hub (reward.hub_address).",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    setup_logging("reward", cfg.run.log_level)

    from flywheel.netsec import check_keys
    from reward_service.pool import PoolError, WorkerPool
    from reward_service.registry import check_kwargs, resolve
    from reward_service.scoring import FunctionSpec
    from reward_service.service import RewardService

    specs = [FunctionSpec(s.name, s.weight, dict(s.kwargs)) for s in cfg.reward.functions]
    tokenizer = cfg.reward.tokenizer or cfg.data.tokenizer
    try:  # fail here, with the fix, rather than in every worker
        functions = [resolve(s.name) for s in specs]
        for fn, spec in zip(functions, specs, strict=True):
            check_kwargs(fn, spec.kwargs)
        check_keys(cfg.security, server=False)
    except ValueError as err:
        print(f"flywheel-reward: {err}", file=sys.stderr)
        return 2
    if tokenizer is None and any(fn.needs_text for fn in functions):
        print(
            "flywheel-reward: these reward functions read text: set reward.tokenizer or data.tokenizer", file=sys.stderr
        )
        return 2
    pool = WorkerPool(
        cfg.reward.workers,
        specs,
        tokenizer,
        {"max_tokens": cfg.rollout.max_tokens, "call_timeout_s": cfg.reward.timeout_s},
        cfg.reward.timeout_s,
    )
    service = RewardService(cfg.reward, f"reward-{socket.gethostname()}-{os.getpid()}", pool, security=cfg.security)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    try:
        service.run()
    except PoolError as err:
        print(f"flywheel-reward: {err}", file=sys.stderr)
        return 1
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
