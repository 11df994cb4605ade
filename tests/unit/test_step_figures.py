"""The step's figures over every data-parallel rank: two real gloo processes, each with its own
share of a batch, and rank 0's report against the figures of the whole batch computed at once.
(Rank 0 reported its own share of the policy loss, entropy, clip fraction, advantages and group
counts: half the batch at world 2.)"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections import Counter
from typing import Any

import pytest
import torch

from flywheel.config import load_config
from flywheel.redis_server import free_port
from learner.trainer import StepStats, Trainer, moments, pooled_mean_std

# Each rank's share: its rewards, advantages on its response tokens, trained tokens, the metric
# means over those tokens, and counts.
SHARES: list[dict[str, Any]] = [
    {
        "rewards": [1.0, 0.0, 1.0, 1.0],
        "adv": [0.5, -1.5, 0.5, 0.5, 0.5],
        "trained": 5.0,
        "seqs": 4.0,
        "metrics": {
            "policy/entropy": 2.0,
            "policy/clip_frac": 0.1,
            "loss/policy": 0.4,
            "batch/groups": 1.0,
            "batch/response_len": 1.25,
            "offpolicy/behav_weight_max": 1.5,
            "adv/max": 0.5,
        },
        "staleness": {0: 1},
    },
    {
        "rewards": [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
        "adv": [-1.0, -1.0, 1.0, 2.0, -1.0, 1.0, 1.0],
        "trained": 15.0,
        "seqs": 8.0,
        "metrics": {
            "policy/entropy": 1.0,
            "policy/clip_frac": 0.3,
            "loss/policy": -0.2,
            "batch/groups": 2.0,
            "batch/response_len": 2.0,
            "offpolicy/behav_weight_max": 3.0,
            "adv/max": 2.0,
        },
        "staleness": {1: 1, 2: 1},
    },
]


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        share = SHARES[rank]
        trainer = Trainer.__new__(Trainer)
        trainer.cfg, trainer.world, trainer.device = load_config(["--async.max_staleness", "2"]), 2, "cpu"
        stats = StepStats(0, metrics=dict(share["metrics"]), staleness=Counter(share["staleness"]))
        rewards, adv = torch.tensor(share["rewards"]), torch.tensor(share["adv"])
        stats.metrics.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()),
                "adv/mean": float(adv.mean()),
                "adv/std": float(adv.std()),
            }
        )
        stats.counts.update(trained=share["trained"], seqs=share["seqs"])
        stats.moments.update(reward=moments(rewards), adv=moments(adv))
        trainer._whole_step_figures(stats)
        out.put((rank, stats.metrics, dict(stats.staleness)))
    finally:
        dist.destroy_process_group()


def test_rank_zero_reports_the_whole_batch_not_its_share() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, metrics, staleness = out.get(timeout=60)
            results[rank] = (metrics, staleness)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    m, staleness = results[0]
    rewards = torch.tensor(SHARES[0]["rewards"] + SHARES[1]["rewards"])
    adv = torch.tensor(SHARES[0]["adv"] + SHARES[1]["adv"])
    assert m["reward/mean"] == pytest.approx(float(rewards.mean()))
    assert m["reward/std"] == pytest.approx(float(rewards.std()))
    assert m["adv/mean"] == pytest.approx(float(adv.mean()))
    assert m["adv/std"] == pytest.approx(float(adv.std()))
    assert m["adv/max"] == 2.0 and m["offpolicy/behav_weight_max"] == 3.0
    # token-weighted: 5 tokens at 2.0 and 15 at 1.0
    assert m["policy/entropy"] == pytest.approx((5 * 2.0 + 15 * 1.0) / 20)
    assert m["policy/clip_frac"] == pytest.approx((5 * 0.1 + 15 * 0.3) / 20)
    assert m["batch/response_len"] == pytest.approx((4 * 1.25 + 8 * 2.0) / 12)
    assert m["loss/policy"] == pytest.approx((0.4 - 0.2) / 2)  # DeepSpeed's mean of the ranks' losses
    assert m["batch/groups"] == 3.0
    assert staleness == {0: 1, 1: 1, 2: 1}
    assert "policy/kl" not in m  # a figure neither rank has stays absent
    assert results[1][0]["batch/groups"] == 3.0  # every rank gets the whole step's figures


@pytest.mark.parametrize("values", [[], [3.0], [1.0, 2.0, 4.0], [0.5] * 7])
def test_pooled_mean_std_matches_torch(values: list[float]) -> None:
    mean, std = pooled_mean_std(*moments(torch.tensor(values, dtype=torch.float64)))
    if not values:
        assert (mean, std) == (0.0, 0.0)
        return
    x = torch.tensor(values, dtype=torch.float64)
    assert mean == pytest.approx(float(x.mean()))
    assert std == pytest.approx(0.0 if len(values) < 2 else float(x.std()), abs=1e-12)
    assert not math.isnan(std)
