"""The Ray launcher's handle on a service actor (``RayService``), against a real local Ray: an
actor too busy to answer within the call timeout is no sign that its service died, and must not
end the run (the call raised ``GetTimeoutError`` through the launcher's supervision loop)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def test_a_busy_service_actor_reads_as_running_and_is_still_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from flywheel import ray_launch

    monkeypatch.setattr(ray_launch, "CALL_TIMEOUT_S", 1.0)
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        sleeper = ["-n", "1", "-r", "1", "__import__('time').sleep(120)"]
        actor = ray_launch._ServiceActor.remote("svc", "timeit", sleeper, str(tmp_path), {})
        handle = ray_launch.RayService("svc", actor, tmp_path / "svc.log")
        deadline = time.monotonic() + 60
        while handle.returncode is not None or not (tmp_path / "svc.log").exists():
            assert time.monotonic() < deadline, "the service actor never started"
        actor.read_state.remote(str(tmp_path / "never"), 30.0)  # holds the actor for 30 s
        time.sleep(0.5)
        started = time.monotonic()
        assert handle.returncode is None and handle.alive()  # busy, not dead: the run goes on
        assert handle.tail() == ""  # read from the log file instead
        handle.stop(timeout_s=1)  # the busy actor is killed, not waited for
        assert time.monotonic() - started < 15
    finally:
        ray.shutdown()
