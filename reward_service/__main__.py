"""Entry point of a reward worker: ``flywheel-reward`` / ``python -m reward_service``."""

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
        "Run one reward worker connected to the hub (reward.hub_address).",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    setup_logging("reward", cfg.run.log_level)

    from reward_service.functions import RewardFn, exact_match_reward, length_reward
    from reward_service.worker import RewardWorker

    fn: RewardFn
    if cfg.reward.function == "length":
        fn = length_reward(cfg.rollout.max_tokens)
    else:
        path = cfg.reward.tokenizer or cfg.data.tokenizer
        if path is None:
            print(
                "flywheel-reward: exact_match decodes responses: set reward.tokenizer or data.tokenizer",
                file=sys.stderr,
            )
            return 2
        from transformers import AutoTokenizer

        fn = exact_match_reward(AutoTokenizer.from_pretrained(path))
    worker = RewardWorker(
        cfg.reward.hub_address, f"reward-{socket.gethostname()}-{os.getpid()}", cfg.reward.capacity, fn
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    worker.run()
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
