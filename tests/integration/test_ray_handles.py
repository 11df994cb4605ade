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


def test_a_service_actor_not_placed_yet_reads_as_running_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generator the autoscaler added on a cluster with no free GPU waits for its placement:
    every look at it waited out CALL_TIMEOUT_S (60 s), holding the launcher's loop (restarts,
    the display) that long at every pass."""
    import ray

    from flywheel import ray_launch

    monkeypatch.setattr(ray_launch, "CALL_TIMEOUT_S", 20.0)
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        unplaceable = ray_launch._ServiceActor.options(resources={"no_such_device": 1})
        actor = unplaceable.remote("svc", "timeit", ["-n", "1", "-r", "1", "pass"], str(tmp_path), {})
        handle = ray_launch.RayService("svc", actor, tmp_path / "svc.log")
        for _ in range(3):
            started = time.monotonic()
            assert handle.alive()
            assert time.monotonic() - started < 5
    finally:
        ray.shutdown()


def test_a_redis_actor_lost_with_its_node_does_not_end_the_stop_in_a_traceback(tmp_path: Path) -> None:
    """The launcher's stop asked the Redis actor to stop with a bare ray.get: an actor gone with
    its node raised RayActorError out of the stop, and the run's report was never written."""
    import ray
    from rich.console import Console

    from flywheel import ray_launch

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        actor = ray_launch._RedisActor.remote(str(tmp_path / "redis"), "127.0.0.1", "everysec", 64, None, None)
        ray.get(actor.port.remote(), timeout=60)
        ray.kill(actor)  # as its node's loss would
        launch = object.__new__(ray_launch.RayLaunch)  # only what _stop_redis reads
        launch.console = Console(file=(tmp_path / "console.txt").open("w"))
        launch._redis_actor = actor
        launch._stop_redis()
        launch.console.file.close()
        assert "the Redis actor did not stop cleanly" in (tmp_path / "console.txt").read_text()
    finally:
        ray.shutdown()


def test_a_redis_that_will_not_start_on_ray_fails_the_run_with_a_message(tmp_path: Path) -> None:
    """Its actor's error came out of `flywheel run` as a RayActorError traceback."""
    import ray

    from flywheel import ray_launch
    from flywheel.config import load_config
    from flywheel.launcher import RedisFailed

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the Redis directory should be")
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        launch = object.__new__(ray_launch.RayLaunch)  # only what _start_redis reads
        launch.cfg = load_config(["--redis.dir", str(blocked / "redis"), "--launch.ready_timeout_s", "20"])
        launch.run_dir, launch.spread = tmp_path, False
        launch._strategy = lambda role: "DEFAULT"  # type: ignore[method-assign]
        with pytest.raises(RedisFailed, match="redis-server did not start on Ray"):
            launch._start_redis()
    finally:
        ray.shutdown()


def test_a_service_that_dies_before_listening_fails_the_run_with_its_reason(tmp_path: Path) -> None:
    """On Ray, a hub that exited before it wrote its ports (an empty dataset, say) came out of
    `flywheel run` as a RayTaskError traceback; the local launcher names the service, its exit
    code and its log's tail (ServiceFailed), and so does this one now."""
    import ray

    from flywheel import ray_launch
    from flywheel.config import load_config
    from flywheel.launcher import ServiceFailed

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        actor = ray_launch._ServiceActor.remote("hub", "json.tool", [str(tmp_path / "missing.json")], str(tmp_path), {})
        handle = ray_launch.RayService("hub", actor, tmp_path / "hub.log")
        launch = object.__new__(ray_launch.RayLaunch)  # only what _read_state reads
        launch.cfg = load_config(["--launch.ready_timeout_s", "60"])
        with pytest.raises(ServiceFailed, match="before listening"):
            launch._read_state(handle, tmp_path / "hub.state.json")
    finally:
        ray.shutdown()
