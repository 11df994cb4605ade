"""Deadlines of the weight sync with a real vLLM-CPU generator: a generator frozen (SIGSTOP) is
evicted at the deadline and the learner goes on; a learner frozen mid-broadcast does not wedge
the generator, which serves the next learner (a restart on the same ports) at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from flywheel.config import SyncConfig
from flywheel.redis_server import free_port
from learner.weight_sync import WeightBroadcaster
from tests.conftest import ROOT, Cluster, wait_started, wait_until

DEADLINE_S = 4.0


def weights(model_dir: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1 * p.std())
    return list(model.state_dict().items())


def test_frozen_generator_is_evicted_and_a_frozen_learner_wedges_nothing(
    cluster: Cluster, checkpoint_dir: Path
) -> None:
    ports = (free_port(), free_port())
    cfg = SyncConfig(announce_port=ports[0], join_port=ports[1], timeout_s=DEADLINE_S, member_timeout_s=30)
    cluster.start_hub("--async.max_staleness", "100", "--async.groups_per_step", "2", "--hub.generator_timeout_s", "4")
    cluster.start_reward()
    gen = cluster.start_generator("g0", checkpoint_dir, ports)
    wb = WeightBroadcaster(cfg)
    try:
        wait_started(gen, wb)

        # 1. the generator freezes: the sync ends at its deadline, evicting it; the next one does not wait
        os.killpg(gen.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            report = wb.sync(1, weights(checkpoint_dir, 1))
            assert report.evicted == {"g0": "missed the deadline"}, report
            assert time.monotonic() - t0 < DEADLINE_S + 5
            t0 = time.monotonic()
            report = wb.sync(2, weights(checkpoint_dir, 2))
            assert report.members == [] and time.monotonic() - t0 < 2, report
        finally:
            os.killpg(gen.pid, signal.SIGCONT)
        # thawed, it rejoins and takes the next sync
        assert wb.wait_for_members(1, timeout_s=30)
        report = wb.sync(3, weights(checkpoint_dir, 3))
        assert report.acked == ["g0"], report
    finally:
        wb.close()

    # 2. a learner freezes after the first bucket of its broadcast
    mark = len(gen.log_path.read_text())  # (part 1's freeze outlasted the hub's generator timeout)
    frozen = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.frozen_learner", str(checkpoint_dir), str(ports[0]), str(ports[1])]
        + ["4", str(DEADLINE_S)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert frozen.stdout is not None
        assert frozen.stdout.readline().strip() == "syncing", "the frozen learner never saw the generator join"
        wait_until(
            lambda: "could not load weights v4" in gen.log_path.read_text(), 60, "the generator to give up on v4"
        )
        assert frozen.poll() is None  # still frozen: the generator gave up on its own deadline
        assert gen.alive()
        # half-loaded, it gave its leases back and told the hub first: none was leased straight back
        time.sleep(2)
        after = gen.log_path.read_text()[mark:].split("could not load weights v4", 1)[1]
        assert "returning lease" not in after, after[-3000:]
        # ... and the hub still hears it (heartbeats went on), past the hub's generator timeout
        time.sleep(5)
        assert "no longer knows this generator" not in gen.log_path.read_text()[mark:]
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
    # 3. the learner restarts on the same ports: the generator joins its new group and loads v5
    wb = WeightBroadcaster(cfg)
    try:
        assert wb.wait_for_members(1, timeout_s=30)
        report = wb.sync(5, weights(checkpoint_dir, 5))
        assert report.acked == ["g0"], (report, gen.tail())
    finally:
        wb.close()
    wait_until(lambda: "now serving weights v5" in gen.log_path.read_text(), 30, "the engine resumed on v5")
