"""Entry point of the learner: ``flywheel-learner`` / ``python -m learner``.

One process per data-parallel rank: ``torchrun --nproc_per_node N -m learner ...`` or the
``deepspeed`` launcher; a single process needs no launcher.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from flywheel.config import FlywheelConfig, service_config
from flywheel.logs import setup_logging

log = logging.getLogger("learner")


def _single_process_env(fresh_port: bool = False) -> None:
    """Without a launcher: a world of one, on a free port (``fresh_port``: another one now, for a
    standby learner that chose its port long before it starts)."""
    from flywheel.redis_server import free_port

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        os.environ["MASTER_PORT"] = str(free_port())
        os.environ["FLYWHEEL_OWN_WORLD"] = "1"
    elif fresh_port and os.environ.get("FLYWHEEL_OWN_WORLD") == "1":
        os.environ["MASTER_PORT"] = str(free_port())


def _stand_by(model: str | None, standby_file: Path) -> None:
    """The standby learner (launch.standby_learner): with torch, DeepSpeed and the trainer
    imported, also import the model's code, mark itself ready and wait for the launcher's
    takeover. What a learner start then has left is DeepSpeed's set-up and the checkpoint."""
    from flywheel import standby

    if model:
        try:  # the model class's module: transformers imports it (and torch's compiler) lazily
            from transformers import AutoConfig
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]
        except Exception as err:  # only a head start: the learner imports it again for real
            log.warning("standby: could not import the code of %s ahead: %s", model, err)
    standby.mark_ready(standby_file)
    log.info("standing by (%s): imports done, waiting to take the learner's place", standby_file)
    takeover = asyncio.run(standby.wait_for_takeover(standby_file))
    log.info("taking the learner's place (%s)", takeover.generator_id)
    _single_process_env(fresh_port=True)


STALE_BUILD_LOCK_S = 900  # no op build takes this long; a lock this old was left by a killed build


def _prepare_op_builds() -> None:
    """DeepSpeed builds its ops (on CPU: the shared-memory collective) with torch's JIT
    extensions, under a lock file. Each Python environment gets its own build directory, so two
    virtualenvs do not rebuild over each other; a lock left by a build that was killed would make
    every later start wait for it forever, so an old one is removed, loudly."""
    import hashlib
    import time

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

    if cfg.train.standby_file:
        _stand_by(cfg.train.model, Path(cfg.train.standby_file))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist_env()
    trainer = Trainer(cfg, rank, world)
    try:
        if cfg.train.resume:
            trainer.load_checkpoint()
        trainer.take_over_run()
        trainer.run()
    finally:
        trainer.close()
    # Left to the interpreter's exit, the process group's threads were torn down while still
    # running, and a rank could abort after its run was done ("terminate called without an
    # active exception", exit -6: a whole run counted failed). Only here, on success: after an
    # error a peer may still be blocked in a collective, and the teardown could wait on it.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    log.info("done at version %d", trainer.version)
    return 0


def _preflight(cfg: FlywheelConfig) -> list[str]:
    """What in Redis says this learner must not start, as fixes to print:

    - settings that differ from the ones the run's hub published (``flywheel.store.SHARED_SETTINGS``):
      a learner with another bound, group size or sampling temperature than its hub trains on
      batches it misreads (a wrong temperature skews every log-probability, silently);
    - a fresh learner (train.resume false) on a Redis that already holds a version of its run:
      it would train from version 0 beside the earlier run's counters, claims and groups."""
    import redis

    from flywheel.netsec import redis_client
    from flywheel.store import RunKeys, settings_disagree

    keys = RunKeys(cfg.run.name)
    client = redis_client(cfg.redis, socket_timeout=5, socket_connect_timeout=5)
    try:
        published = int(client.get(keys.version) or 0)
        problems = settings_disagree(client.hgetall(keys.settings), cfg)
    except redis.RedisError:
        return []  # not reachable yet: the learner waits for it as it always does
    finally:
        client.close()
    if published and not cfg.train.resume:
        problems.append(
            f"run {cfg.run.name!r} is already at version {published} in {cfg.redis.url}: continue it with "
            "--train.resume true, start another with a new --run.name, or delete its keys (fw:{NAME}:*)"
        )
    if published and cfg.train.resume and not _has_checkpoint(cfg.train.checkpoint_dir):
        # Within the first checkpoint_every steps, starting over from the initial weights loses
        # no more than a resume from a checkpoint would; past them, no checkpoint means a wrong
        # directory or none ever written, and the run's steps would be lost without a word.
        every = cfg.train.checkpoint_every
        if not every or published > every:
            problems.append(
                f"run {cfg.run.name!r} is at version {published}, but train.checkpoint_dir "
                f"({cfg.train.checkpoint_dir}) holds no checkpoint to resume from: this learner would start over from "
                "the initial weights and lose those steps. Point --train.checkpoint_dir at the run's checkpoints, "
                "or start a new --run.name; set --train.checkpoint_every N so that a restarted learner can resume"
            )
    return problems


def _has_checkpoint(directory: str | None) -> bool:
    return directory is not None and (Path(directory) / "latest").exists()


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
    from flywheel.netsec import check_keys, redis_password

    try:
        check_keys(cfg.security, server=True)
        redis_password(cfg.redis)
    except ValueError as err:
        problems.append(str(err))
    if cfg.train.attn_implementation == "flash_attention_2":
        import torch

        if not torch.cuda.is_available():  # transformers' ImportError was a crash, and a restart loop
            problems.append(
                "--train.attn_implementation flash_attention_2 needs a GPU, and this machine has none: use sdpa"
            )
    if not problems:
        problems += _preflight(cfg)
    if problems:
        print("flywheel-learner: " + "; ".join(problems), file=sys.stderr)
        return 2
    setup_logging(f"learner{os.environ.get('RANK', '')}", cfg.run.log_level)
    return train(cfg)


if __name__ == "__main__":
    sys.exit(main())
