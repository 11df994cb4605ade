"""Run by test_learner: one optimizer step on a fixed batch, at world size 1 (the whole batch) or
2 (a group on each rank, run under torch.distributed.run), and print the step's gradient norm.
The loss's normaliser is the step's over every rank, so both must read the same norm.

    python -m tests.integration.norm_check MODEL REDIS_URL AGGREGATION [FINISH [ESTIMATOR [FLAG VALUE ...]]]

FINISH (default stop) is every sample's finish reason: with ``abort`` (cut off by the engine) no
sample may give a gradient; ``floor`` ends them with stop but gives every token the behaviour
log-probability of a token the sampler gave no probability (-1e9), which may give none either.
The flags at the end go to the learner's config.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def fixed_groups(finish: str) -> list[object]:
    """Two groups of two samples: one of short answers (3 and 2 tokens), one of long ones (12, 9)."""
    from flywheel.hub_client import RolloutGroup, RolloutSample

    def sample(n: int, reward: float, start: int) -> RolloutSample:
        return RolloutSample(
            tokens=np.arange(start, start + n, dtype=np.int32),
            logprobs=np.full(n, -1e9 if finish == "floor" else -3.0, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
            finish_reason="stop" if finish == "floor" else finish,
            reward=reward,
            reward_breakdown={},
            reward_error=None,
        )

    def group(gid: int, lengths: tuple[int, int]) -> RolloutGroup:
        return RolloutGroup(
            group_id=gid,
            version=0,
            staleness=0,
            prompt_index=gid,
            prompt_tokens=np.arange(40 + gid, 45 + gid, dtype=np.int32),
            metadata={},
            samples=[sample(lengths[0], 1.0, 60), sample(lengths[1], 0.0, 90)],
        )

    return [group(0, (3, 2)), group(1, (12, 9))]


def answer_logprobs(model: object, groups: list[object]) -> list[list[float]]:
    """Each answer's summed log-probability under ``model`` (an HF causal LM), group by group."""
    import torch

    out = []
    with torch.no_grad():
        for group in groups:
            prompt = torch.as_tensor(group.prompt_tokens, dtype=torch.long)  # type: ignore[attr-defined]
            row = []
            for s in group.samples:  # type: ignore[attr-defined]
                answer = torch.as_tensor(s.tokens, dtype=torch.long)
                logits = model(torch.cat([prompt, answer])[None]).logits[0, len(prompt) - 1 : -1]  # type: ignore[operator]
                row.append(float(torch.log_softmax(logits.float(), -1).gather(1, answer[:, None]).sum()))
            out.append(row)
    return out


def main() -> None:
    model, redis_url, aggregation = sys.argv[1:4]
    finish = sys.argv[4] if len(sys.argv) > 4 else "stop"
    estimator = sys.argv[5] if len(sys.argv) > 5 else "grpo"
    extra = sys.argv[6:]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:
        from flywheel.redis_server import free_port

        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    from flywheel.config import load_config
    from flywheel.hub_client import Batch
    from flywheel.redis_server import free_port
    from learner.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_config(
        [
            "--redis.url", redis_url, "--train.model", model, "--train.lr", "1e-3",
            "--train.micro_batch_tokens", "24", "--algo.loss.aggregation", aggregation, "--algo.advantage.estimator", estimator,
            "--async.groups_per_step", "2", "--data.n_samples_per_prompt", "2", "--rollout.max_tokens", "16",
            "--sync.announce_port", str(free_port()), "--sync.join_port", str(free_port()), "--wandb.mode", "disabled",
            *extra,
        ]
    )  # fmt: skip
    trainer = Trainer(cfg, rank, world)
    groups = fixed_groups(finish)
    mine = groups if world == 1 else [groups[rank]]
    before = answer_logprobs(trainer.engine.module, mine)
    stats = trainer.train_step(Batch(learner_version=0, groups=mine, dropped=0, wait_s=0.0))  # type: ignore[arg-type]
    assert stats is not None
    if rank == 0:
        m = stats.metrics
        out = {
            "grad_norm": m["grad_norm"],
            "aborted": m["batch/aborted"],
            "behav_weight_mean": m["offpolicy/behav_weight_mean"],
        }
        # how the step moved each answer's log-probability (rewarded: sample 0 of each group)
        after = answer_logprobs(trainer.engine.module, mine)
        out["logprob_change"] = [
            [a - b for a, b in zip(ga, gb, strict=True)] for ga, gb in zip(after, before, strict=True)
        ]
        print(json.dumps(out))
    trainer.close()


if __name__ == "__main__":
    main()
