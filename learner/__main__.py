"""Entry point of the learner: ``flywheel-learner`` / ``python -m learner``.

One process per data-parallel rank: ``torchrun --nproc_per_node N -m learner ...`` or the
``deepspeed`` launcher; a single process needs no launcher.
"""

from __future__ import annotations

import logging
import os
import sys

from flywheel.config import FlywheelConfig, service_config
from flywheel.logs import setup_logging

log = logging.getLogger("learner")


def _single_process_env() -> None:
    """Without a launcher: a world of one, on a free port."""
    if "RANK" in os.environ:
        return
    from flywheel.redis_server import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )


STALE_BUILD_LOCK_S = 900  # no op build takes this long; a lock this old was left by a killed build


def _prepare_op_builds() -> None:
    """DeepSpeed builds its ops (on CPU: the shared-memory collective) with torch's JIT
    extensions, under a lock file. Each Python environment gets its own build directory, so two
    virtualenvs do not rebuild over each other; a lock left by a build that was killed would make
    every later start wait for it forever, so an old one is removed, loudly."""
    import hashlib
    import time
    from pathlib import Path

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path.home() / ".cache" / "flywheel" / "torch_extensions" / env_id)
    for lock in Path(os.environ["TORCH_EXTENSIONS_DIR"]).glob("*/lock"):
        age = time.time() - lock.stat().st_mtime
        if age > STALE_BUILD_LOCK_S:
            log.warning("removing %s, left %.0f s ago by an op build that did not finish", lock, age)
            lock.unlink(missing_ok=True)


def train(cfg: FlywheelConfig) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _single_process_env()
    _prepare_op_builds()
    log.info("starting DeepSpeed (a first start in this environment builds its CPU ops: a minute or two)")
    import deepspeed

    from learner.trainer import Trainer, dist_env

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist_env()
    trainer = Trainer(cfg, rank, world)
    try:
        if cfg.train.resume:
            trainer.load_checkpoint()
        trainer.run()
    finally:
        trainer.close()
    log.info("done at version %d", trainer.version)
    return 0


def main(argv: list[str] | None = None) -> int:
    cfg = service_config(
        "flywheel-learner",
        "Train a policy on batches claimed from the hub (redis.url) and broadcast its weights to the generators.",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    problems = [
        f"{flag} is required"
        for flag, value in (("--train.model", cfg.train.model), ("--redis.url", cfg.redis.url))
        if not value
    ]
    est = cfg.algo.advantage.estimator
    if est in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and cfg.data.n_samples_per_prompt < 2:
        problems.append(
            f"--algo.advantage.estimator {est} compares the samples of a prompt: set --data.n_samples_per_prompt >= 2"
        )
    from flywheel.netsec import check_keys, redis_password

    try:
        check_keys(cfg.security, server=True)
        redis_password(cfg.redis)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        print("flywheel-learner: " + "; ".join(problems), file=sys.stderr)
        return 2
    setup_logging(f"learner{os.environ.get('RANK', '')}", cfg.run.log_level)
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
