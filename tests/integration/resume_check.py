"""Run by test_learner: train two steps on real hub batches, checkpoint, then compare a learner
that goes on with one resumed from the checkpoint on the same next batches, and with one that
computes the proximal log-probabilities by a forward of their own. Prints JSON.

    python -m tests.integration.resume_check MODEL REDIS_URL CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, redis_url, ckpt = sys.argv[1:4]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from flywheel.config import load_config
    from flywheel.redis_server import free_port

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from learner.trainer import Trainer

    cfg = load_config(
        [
            "--redis.url", redis_url, "--train.model", model, "--train.lr", "1e-3",
            "--train.micro_batch_tokens", "64", "--train.checkpoint_dir", ckpt,
            "--async.max_staleness", "100", "--async.groups_per_step", "2", "--data.n_samples_per_prompt", "4",
            "--sync.announce_port", str(free_port()), "--sync.join_port", str(free_port()), "--wandb.mode", "disabled",
        ]
    )  # fmt: skip
    first = Trainer(cfg, 0, 1)
    for _ in range(2):
        first.train_step(first.claim())
        first.version += 1
    first.save_checkpoint()
    next_batch, following = first.claim(), first.claim()
    loss_next_a = first.loss_on(next_batch)
    first.train_step(next_batch)
    loss_after_a = first.loss_on(following)
    first.close()

    second = Trainer(cfg, 0, 1)
    second.load_checkpoint()
    loss_next_b = second.loss_on(next_batch)
    second.train_step(next_batch)
    loss_after_b = second.loss_on(following)
    second.close()

    # the same step with the proximal log-probabilities from a forward of their own before it (as
    # KL-in-reward runs need) instead of from each micro-batch's forward: the same update
    third = Trainer(cfg, 0, 1)
    third.load_checkpoint()
    third._prox_before_step = lambda: True  # type: ignore[method-assign]
    third.train_step(next_batch)
    loss_after_c = third.loss_on(following)
    third.close()
    print(
        json.dumps(
            {
                "resumed_version": second.version,
                "loss_next": [loss_next_a, loss_next_b],
                "loss_after_step": [loss_after_a, loss_after_b],
                "loss_after_step_separate_prox": loss_after_c,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
