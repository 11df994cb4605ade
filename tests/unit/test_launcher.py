"""`flywheel run`: a new run starts in a clean run directory; on a GPU machine each GPU service
gets its own GPUs, and the report's loop figures (both sides' throughput and idle shares) come
from the training window alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from flywheel import launcher
from flywheel.config import ConfigError, load_config
from flywheel.launcher import LocalLaunch, Timeline, assign_gpus, set_aside, visible_gpus
from flywheel.report import loop_figures
from tests.conftest import ROOT, wait_until


def test_a_new_run_sets_the_previous_one_aside(tmp_path: Path) -> None:
    """A reused run directory once made the new run's Redis reload the old run's AOF (the learner
    started 200 versions behind the hub); now the old run moves to <dir>.1, .2, ..."""
    run_dir = tmp_path / "run"
    assert set_aside(run_dir) is None  # nothing there yet
    (run_dir / "redis").mkdir(parents=True)
    (run_dir / "redis" / "appendonly.aof").write_text("old")
    (run_dir / "services.json").write_text("{}")  # what every run writes first
    assert set_aside(run_dir) == tmp_path / "run.1"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "services.json").write_text("{}")
    assert set_aside(run_dir) == tmp_path / "run.2"
    assert (tmp_path / "run.1" / "redis" / "appendonly.aof").read_text() == "old"
    (run_dir / "logs").mkdir(parents=True)
    LocalLaunch(load_config(["--launch.run_dir", str(run_dir), "--train.resume", "true"]))  # resuming: kept
    assert (run_dir / "logs").is_dir() and not (tmp_path / "run.3").exists()
    LocalLaunch(load_config(["--launch.run_dir", str(run_dir)]))
    assert (tmp_path / "run.3" / "logs").is_dir() and not any((run_dir / "logs").iterdir())
    # a launcher claims its directory before it prepares anything: a second one sees it live at once
    assert json.loads((run_dir / "services.json").read_text())["launcher_pid"] == os.getpid()


def test_a_new_run_sets_aside_what_an_earlier_one_left_in_redis_dir(tmp_path: Path) -> None:
    """With redis.dir outside the run's directory, a fresh run's Redis reloaded the earlier run's
    AOF: the hub recovered that run's versions, leases and counters under the same run name while
    the learner started at v0. Now that data moves to <redis.dir>.1 (real redis-server)."""
    from flywheel.redis_server import RedisServer
    from flywheel.store import RunKeys

    data = tmp_path / "redis-data"
    old = RedisServer(data)
    old.client().set(RunKeys("flywheel").version, 41)
    old.stop()
    flags = ["--launch.run_dir", str(tmp_path / "run"), "--redis.dir", str(data)]
    LocalLaunch(load_config([*flags, "--train.resume", "true"]))  # resuming: the data is the run's
    assert not (tmp_path / "redis-data.1").exists()
    LocalLaunch(load_config(flags))
    assert (tmp_path / "redis-data.1").is_dir()
    fresh = RedisServer(data)
    try:
        assert fresh.client().get(RunKeys("flywheel").version) is None
    finally:
        fresh.stop()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="not Redis's"):  # a directory of other files is not moved
        LocalLaunch(load_config(["--launch.run_dir", str(tmp_path / "run2"), "--redis.dir", str(tmp_path / "notes")]))


def test_only_a_finished_run_is_set_aside(tmp_path: Path) -> None:
    """`--run.name ..` (or `--launch.run_dir .`) moved the directory the user ran from; a second
    `flywheel run` under a running one's name moved the live run away under it (its restarted
    learner then found no recipe)."""
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)  # a project's logs and config.yaml do not make it a run
    (project / "config.yaml").write_text("mine: 1")
    (project / "train.py").write_text("mine")
    with pytest.raises(ValueError, match="not a Flywheel run"):
        set_aside(project)
    assert (project / "train.py").read_text() == "mine"
    for name in (".", "..", ".hidden"):
        with pytest.raises(ConfigError, match="run.name must be"):
            load_config(["--run.name", name])

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    launcher_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        services = {"launcher_pid": launcher_process.pid, "pids": {"hub": None}, "redis_url": None}
        (run_dir / "services.json").write_text(json.dumps(services))
        with pytest.raises(ValueError, match=f"a run is still going in .* \\(pids \\[{launcher_process.pid}\\]\\)"):
            set_aside(run_dir)
        with pytest.raises(ValueError, match="a run is still going"):  # nor run beside it on its Redis
            LocalLaunch(load_config(["--launch.run_dir", str(run_dir), "--train.resume", "true"]))
    finally:
        launcher_process.kill()
        launcher_process.wait(timeout=10)
    assert set_aside(run_dir) == tmp_path / "run.1"  # the run is over: it moves


def test_learner_first_then_each_generator_its_tensor_parallel_share() -> None:
    assert assign_gpus(["0", "1"], 1, [1]) == {
        "learner": "0",
        "sft": "0",
        "eval_start": "0",
        "eval_end": "0",
        "generator0": "1",
    }
    plan = assign_gpus([str(i) for i in range(8)], 2, [2, 2, 1])
    assert (plan["learner"], plan["generator0"], plan["generator1"], plan["generator2"]) == ("0,1", "2,3", "4,5", "6")


def test_too_few_gpus_assign_none() -> None:
    assert assign_gpus(["0"], 1, [1]) == {}
    assert assign_gpus([], 1, [1]) == {}
    assert assign_gpus(["0", "1", "2"], 1, [2, 2]) == {}


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    assert visible_gpus() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


class FakeService:
    """Records what the launcher would start instead of starting it."""

    started: list[FakeService] = []

    def __init__(
        self, name: str, module: str, args: list[str], log_dir: Path, env: dict[str, str], cpus: set[int] | None
    ) -> None:
        self.name, self.module, self.args, self.env, self.cpus = name, module, args, env, cpus
        FakeService.started.append(self)


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[str], *flags: str) -> LocalLaunch:
    monkeypatch.setattr(launcher, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(launcher, "Service", FakeService)
    FakeService.started = []
    cfg = load_config(["--launch.run_dir", str(tmp_path), *flags])
    return LocalLaunch(cfg)


def test_services_start_on_their_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = _launch(tmp_path, monkeypatch, ["0", "1", "2"], "--launch.generators", "2")
    for name in ("sft", "hub", "reward", "generator0", "generator1", "learner"):
        launch._service(name, "module")
    env: dict[str, Any] = {s.name: s.env.get("CUDA_VISIBLE_DEVICES") for s in FakeService.started}
    assert env == {"sft": "0", "hub": None, "reward": None, "generator0": "1", "generator1": "2", "learner": "0"}


def test_without_enough_gpus_services_see_them_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = _launch(tmp_path, monkeypatch, ["0"])
    launch._service("learner", "learner")
    launch._service("generator0", "generators")
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in FakeService.started)


def test_loop_figures_count_only_the_training_window() -> None:
    tl = Timeline(start_wall=1000.0)
    # before training (t < 10) the generator idles with no lease out; inside, leases are out
    # except at one sample of five, and admission is blocked 1 s of every 2
    for t in range(0, 31, 2):
        tl.t.append(float(t))
        tl.tokens_in.append(100.0 * max(0, t - 10))
        tl.active_leases.append(0.0 if t < 10 or t == 14 else 4.0)
        tl.admission_blocked_s.append(0.5 * max(0, t - 10))
    rows = [{"time": 1000.0 + 10 + 2 * (i + 1), "perf/step_s": 2.0, "perf/tokens": 500.0} for i in range(10)]
    figures = loop_figures(rows, tl)
    assert figures["train_window_s"] == pytest.approx(20.0)
    assert figures["learner_tokens_per_s_wall"] == pytest.approx(250.0)
    assert figures["generator_tokens_per_s_wall"] == pytest.approx(100.0)
    assert figures["generator_no_work_frac"] == pytest.approx(1 / 11)
    assert figures["generator_blocked_frac"] == pytest.approx(0.5)


def test_loop_figures_count_on_across_a_hub_restart() -> None:
    """The hub's counters live in its memory: after a restart (its own, or Redis's) they count
    from zero again, and last - first read half the tokens (or fewer than none)."""
    tl = Timeline(start_wall=1000.0)
    for t in range(0, 21, 2):
        since_restart = t if t < 10 else t - 10  # the hub restarted at t = 10
        tl.t.append(float(t))
        tl.tokens_in.append(100.0 * since_restart)
        tl.active_leases.append(4.0)
        tl.admission_blocked_s.append(0.2 * since_restart)
    rows = [{"time": 1000.0 + 2 * (i + 1), "perf/step_s": 2.0, "perf/tokens": 500.0} for i in range(10)]
    figures = loop_figures(rows, tl)
    assert figures["generator_tokens_per_s_wall"] == pytest.approx(100.0, rel=0.11)  # one sample lost at the restart
    assert figures["generator_blocked_frac"] == pytest.approx(0.2, rel=0.11)


def test_the_report_weighs_steps_by_their_length_and_counts_a_repeated_step_once(tmp_path: Path) -> None:
    """A mean of per-step idle shares counted a 9 s wait in a 10 s step as much as none in a 1 s
    one (0.09 where 9 of 19 s were idle); a learner restarted from a checkpoint logs the steps
    after it again, which counted their tokens twice."""
    from flywheel.report import _learner_time_shares, load_metrics

    rows = [{"step": 1, "time": 10.0, "perf/step_s": 10.0, "perf/idle_frac": 0.9, "perf/tokens": 100.0}]
    rows += [
        {"step": k, "time": 10.0 + k, "perf/step_s": 1.0, "perf/idle_frac": 0.0, "perf/tokens": 100.0}
        for k in range(2, 11)
    ]
    shares = _learner_time_shares(rows)
    assert shares["learner_idle_frac"] == pytest.approx(9 / 19)
    assert shares["learner_tokens_per_s"] == pytest.approx(1000 / 10)  # 10 busy seconds
    again = [dict(r, time=r["time"] + 100, **{"perf/tokens": 50.0}) for r in rows[4:]]  # resumed at step 5
    (tmp_path / "learner_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + again))
    loaded = load_metrics(tmp_path)
    assert [r["step"] for r in loaded] == list(range(1, 11))
    assert sum(r["perf/tokens"] for r in loaded) == 4 * 100 + 6 * 50  # the runs the policy kept


def test_cpu_lists_parse_and_bad_ones_name_the_field() -> None:
    from flywheel.config import ConfigError
    from flywheel.procs import parse_cpu_list

    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("1") == {1}
    cfg = load_config(["--launch.cpus.learner", "1", "--launch.cpus.generator0", "0-1"])
    assert cfg.launch.cpus == {"learner": "1", "generator0": "0-1"}  # YAML's integer 1 taken as the list "1"
    for flags, why in [
        (["--launch.cpus.lerner", "1"], "unknown service 'lerner'"),
        (["--launch.cpus.learner", "1-x"], "not a CPU list"),
        (["--launch.cpus.learner", "3-1"], "runs backwards"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(flags)


def test_pinned_services_run_on_their_cpus_and_missing_cpus_stop_the_run(tmp_path: Path) -> None:
    import os

    from flywheel.procs import Service

    mine = sorted(os.sched_getaffinity(0))
    svc = Service("sleeper", "timeit", ["-n", "1", "-r", "1", "__import__('time').sleep(5)"], tmp_path, cpus={mine[-1]})
    try:
        assert os.sched_getaffinity(svc.pid) == {mine[-1]}
    finally:
        svc.stop()
    cfg = load_config(["--launch.run_dir", str(tmp_path / "run"), "--launch.cpus.learner", str(max(mine) + 1)])
    launch = LocalLaunch(cfg)
    with pytest.raises(ValueError, match=r"launch.cpus.learner: CPUs \[\d+\] are not available"):
        launch._cpus("learner")
    assert launch.run() == 2  # before anything starts
    assert launch._cpus("generator3") is None  # unlisted: anywhere
    cfg = load_config(["--launch.run_dir", str(tmp_path / "run2"), "--launch.cpus.generator", str(mine[0])])
    assert LocalLaunch(cfg)._cpus("generator3") == {mine[0]}  # generatorN falls back to generator
    cfg = load_config(["--launch.run_dir", str(tmp_path / "run3"), "--launch.cpus.learner", str(mine[0])])
    assert LocalLaunch(cfg)._cpus("learner_standby") == {mine[0]}  # it becomes the learner


def test_an_autoscaled_fleet_grows_to_what_the_gpus_hold_not_onto_shared_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned for autoscale.max_generators (4) on 3 GPUs, nothing was pinned: the learner and
    every vLLM (each taking 0.85 of its GPU's memory) shared every GPU, out of memory."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    flags = ["--autoscale.enabled", "true", "--autoscale.max_generators", "4", "--launch.generators", "1"]
    launch = _launch(tmp_path, monkeypatch, ["0", "1", "2"], *flags)
    plan = launch.gpu_plan
    assert (plan["learner"], plan["generator0"], plan["generator1"]) == ("0", "1", "2") and "generator2" not in plan
    assert launch._autoscaler().cfg.max_generators == 2
    one = _launch(tmp_path / "one", monkeypatch, ["0"], *flags)  # not even one generator of its own: shared
    assert one.gpu_plan == {} and one._autoscaler().cfg.max_generators == 4


def test_a_redis_that_will_not_start_ends_the_run_with_a_message_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_redis(*args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("redis-server did not answer within 600s")

    monkeypatch.setattr(launcher, "RedisServer", no_redis)
    launch = LocalLaunch(load_config(["--launch.run_dir", str(tmp_path), "--launch.services", "[redis, hub]"]))
    assert launch.run() == 1
    assert "redis-server did not start in" in capsys.readouterr().out


def test_a_multi_rank_learner_that_refused_its_configuration_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun exits 1 whatever its ranks did: ranks that exited 2 (a bad configuration) were
    restarted until launch.max_restarts, as a crash would be."""
    summary = """[ERROR] failed (exitcode: 2) local_rank: 0
Failures:
[1]:
  time      : 2026-12-02_20:40:00
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 4242)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 4241)
"""

    class Torchrun(FakeProcess):
        def tail(self, n: int = 30) -> str:
            return summary

    launch = _launch(tmp_path, monkeypatch, [])
    refused = Torchrun("learner", "torch.distributed.run", [], tmp_path, {}, None)
    refused.code, refused.log_path = 1, tmp_path / "learner.log"
    assert launcher.exit_code(refused) == 2
    with pytest.raises(launcher.ServiceFailed, match="exited with code 2"):
        launch._restart(refused)
    summary = summary.replace("exitcode  : 2 (pid: 4242)", "exitcode  : -9 (pid: 4242)")  # a rank killed
    assert launcher.exit_code(refused) == 1


def test_a_resumed_runs_recovered_generators_are_not_taken_for_the_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub of a resumed run counts the last run's generators (recovered from Redis) until they
    time out: the launcher went on while the new ones were still loading."""
    launch = _launch(tmp_path, monkeypatch, [])
    launch.hub_ports = {"metrics_port": 1}
    looks = iter(
        [{"generators": 2.0, "generator_registrations": 0.0}] * 3
        + [{"generators": 2.0, "generator_registrations": 2.0}]
    )
    seen: list[dict[str, float]] = []
    monkeypatch.setattr(launch, "_hub_metrics", lambda: seen.append(m := next(looks)) or m)
    monkeypatch.setattr(launch, "_check_alive", lambda: None)
    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    launch._wait_generators(2)
    assert len(seen) == 4  # it waited for the two new ones to register


def test_the_sync_address_is_the_launchers_only_when_it_starts_the_learner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the learner run elsewhere (torchrun on another node), the generators must find it where
    the recipe's sync.* says: the launcher overrode it with loopback and ports of its own, and
    the fleet waited for weights that never came, with no error."""
    monkeypatch.setattr(LocalLaunch, "_wait_generators", lambda self, n: None)
    for services, ours in (("[generator]", False), ("[generator, learner]", True)):
        launch = _launch(tmp_path / services, monkeypatch, [], "--launch.services", services)
        launch._start_services()
        gen = next(s for s in FakeService.started if s.name == "generator0")
        assert ("--sync.announce_port" in gen.args) == ours, services


class FakeProcess(FakeService):
    """A FakeService that can die."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.code: int | None = None
        self.stopped = False

    def alive(self) -> bool:
        return self.code is None

    @property
    def returncode(self) -> int | None:
        return self.code

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = True


def test_a_dead_generator_s_place_goes_to_a_loaded_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel import standby

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    launch = _launch(
        tmp_path, monkeypatch, ["0", "1", "2", "3"], "--launch.generators", "2", "--launch.spare_generators", "1"
    )
    monkeypatch.setattr(launcher, "Service", FakeProcess)
    gens = [launch._start_generator(i) for i in range(2)]
    launch.generators = list(gens)
    launch._start_spare()
    (spare,) = launch.spares
    assert (spare.name, spare.env["CUDA_VISIBLE_DEVICES"]) == ("spare0", "3")  # a GPU of its own
    assert spare.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # see _start_spare
    standby_file = tmp_path / "spares" / "spare0"

    gens[1].code = -9  # killed before the spare loaded: an ordinary restart
    launch._restart(gens[1])
    restarted = launch.services[-1]
    assert restarted.name == "generator1" and restarted is not spare and launch.generators[1] is restarted
    assert not standby_file.exists()

    standby.mark_ready(standby_file)
    restarted.code = -9  # now a loaded spare takes its id
    launch._restart(restarted)
    assert standby.Takeover.decode(standby_file.read_bytes(), "t") == standby.Takeover(
        "gen1", str(tmp_path / "acks" / "gen1.log")
    )
    assert spare.name == "generator1" and launch.generators[1] is spare and spare in launch.services
    assert restarted not in launch.services and restarted.stopped
    (successor,) = launch.spares
    assert successor.name == "spare1" and successor.env["CUDA_VISIBLE_DEVICES"] == "2"  # the GPU freed
    assert launch.gpu_plan["generator1"] == "3"  # the GPU the promoted spare holds
    assert sorted(s.name for s in launch.services) == ["generator0", "generator1", "spare1"]

    successor.code = -9  # a spare dies while loading: a new one (new name, no ready mark), same GPU
    launch._restart(successor)
    (third,) = launch.spares
    assert third.name == "spare2" and third.env["CUDA_VISIBLE_DEVICES"] == "2"
    assert launch.restarts["spares"] == 1 and launch.restarts["generator1"] == 2


def test_a_dead_learner_s_place_goes_to_the_standby_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flywheel import standby

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = _launch(tmp_path, monkeypatch, ["0", "1"], "--launch.standby_learner", "true")
    monkeypatch.setattr(launcher, "Service", FakeProcess)
    learner = launch._service("learner", "learner", "--train.run_dir", "r")
    launch._start_standby_learner()

    def standbys() -> list[Any]:
        return [s for s in launch.services if s.name == "learner_standby"]

    (first,) = standbys()
    first_file = tmp_path / "spares" / "learner1"
    assert first.module == "learner" and first.env["CUDA_VISIBLE_DEVICES"] == "0"  # the learner's GPU, for later
    assert first.args == ["--train.run_dir", "r", "--train.resume", "true", "--train.standby_file", str(first_file)]

    learner.code = -9  # dies before the standby's imports are done: an ordinary restart
    launch._restart(learner)
    restarted = launch.services[-1]
    assert restarted.name == "learner" and restarted is not first and "--train.resume" in restarted.args
    assert not first_file.exists()

    standby.mark_ready(first_file)
    restarted.code = -9  # now the standby takes its place
    launch._restart(restarted)
    assert standby.Takeover.decode(first_file.read_bytes(), "t") == standby.Takeover("learner")
    assert first.name == "learner" and first in launch.services
    assert restarted not in launch.services and restarted.stopped
    assert not standbys(), "the next standby waits: its imports would slow the new learner's first steps"
    assert launch.standby_learner_due is not None
    launch.standby_learner_due = time.monotonic()  # its time came
    launch._check_alive()
    (second,) = standbys()  # a fresh standby, with a takeover file of its own (the first one's is in use)
    assert second.args[-1] == str(tmp_path / "spares" / "learner2") and first_file.exists()

    second.code = -9  # a standby dies while importing: a new one takes its turn
    launch._restart(second)
    (third,) = standbys()
    assert third.args[-1] == str(tmp_path / "spares" / "learner3")
    assert launch.restarts["learner_standby"] == 1 and launch.restarts["learner"] == 2
    assert sorted(s.name for s in launch.services) == ["learner", "learner_standby"]


def draining_services(tmp_path: Path, **drain_s: float) -> tuple[LocalLaunch, Path]:
    """A launcher holding a stand-in service per name (``tests/integration/draining_child``),
    each draining that many seconds on SIGTERM; the file they write their term and exit to."""
    from flywheel.procs import Service

    events = tmp_path / "events"
    launch = LocalLaunch(load_config(["--launch.run_dir", str(tmp_path / "run"), "--generator.drain_timeout_s", "30"]))
    env = {"PYTHONPATH": str(ROOT)}
    for name, seconds in drain_s.items():
        args = [name, str(seconds), str(events)]
        launch.services.append(Service(name, "tests.integration.draining_child", args, tmp_path, env=env))
    time.sleep(1.0)  # their signal handlers installed
    return launch, events


def test_the_stop_drains_generators_together_and_the_hub_after_them(tmp_path: Path) -> None:
    """Generators stop together, each given its drain (generator.drain_timeout_s) to give its
    leases back, not one after another on a fixed 15 s; the hub stops once they are done."""
    launch, events = draining_services(tmp_path, hub=0, generator0=16, generator1=16)
    started = time.monotonic()
    launch._shutdown()
    took = time.monotonic() - started
    seen = {(name, what): float(t) for name, what, t in (line.split() for line in events.read_text().splitlines())}
    assert ("generator0", "exit") in seen and ("generator1", "exit") in seen, "a generator was killed mid-drain"
    assert seen["hub", "term"] >= max(seen["generator0", "exit"], seen["generator1", "exit"])
    assert took < 16 * 2, f"the generators drained one after the other ({took:.1f}s)"


def test_a_scale_down_does_not_hold_the_loop_and_a_stop_meanwhile_still_drains_it(tmp_path: Path) -> None:
    """A generator scaled down drains for up to generator.drain_timeout_s: the launcher waited
    for it there, restarting nothing meanwhile, and a Ctrl-C during the wait left it running
    after the hub had stopped (it was no longer among the services a stop stops)."""
    launch, events = draining_services(tmp_path, hub=0, generator0=3, generator1=0)
    retired, quick = launch.services[1], launch.services[2]
    started = time.monotonic()
    launch._retire_generator(retired)
    launch._retire_generator(quick)
    assert time.monotonic() - started < 1.0, "the scale-down waited for the drain"
    wait_until(lambda: not quick.alive(), 10, "the quick one drained")
    launch._reap_retired()
    assert [svc for svc, _ in launch.retiring] == [retired]
    launch._shutdown()  # (the Ctrl-C): the one still draining is stopped with the generators
    seen = {(name, what): float(t) for name, what, t in (line.split() for line in events.read_text().splitlines())}
    assert ("generator0", "exit") in seen, "killed mid-drain, or left running"
    assert seen["hub", "term"] >= seen["generator0", "exit"]
    assert not retired.alive() and launch.retiring == []


def test_a_scaled_down_generator_past_its_drain_is_killed_without_ending_the_run(tmp_path: Path) -> None:
    """Past its drain the retired generator is SIGKILLed and reaped with a wait of 0, which
    raised TimeoutExpired (the killed process not gone yet) out of the launcher's loop: a
    healthy run ended with a traceback."""
    launch, _ = draining_services(tmp_path, generator0=60)
    retired = launch.services[0]
    launch._retire_generator(retired)
    launch.retiring = [(svc, 0.0) for svc, _ in launch.retiring]  # its drain is over
    launch._reap_retired()
    assert not retired.alive() and launch.retiring == []


def test_a_dead_service_s_leftovers_go_with_it_and_its_group_is_never_signalled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service that exits leaving a child behind: the child is killed as soon as the exit is
    seen, and the group id, free for the system to reuse once empty, is never signalled again
    (a stop hours later would have sent SIGKILL to whoever holds the id by then)."""
    import os

    import psutil

    from flywheel.procs import Service

    signalled: list[int] = []
    real_killpg = os.killpg
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: (signalled.append(pgid), real_killpg(pgid, sig))[1])
    code = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"
    svc = Service("leaver", "timeit", ["-n", "1", "-r", "1", code], tmp_path)
    deadline = time.monotonic() + 30
    while svc.proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = psutil.Process(int(svc.log_path.read_text().split()[0]))
    assert child.is_running()
    assert not svc.alive()  # the exit seen: its leftovers killed
    child.wait(timeout=10)
    assert signalled == [svc.pid]
    svc.stop()
    assert not svc.alive() and signalled == [svc.pid]


def test_restarts_count_against_the_budget_only_within_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``launch.max_restarts`` crashes within ``launch.restart_window_s`` end the run; crashes
    further apart, over a run of days, do not add up to its end."""
    from flywheel.launcher import ServiceFailed

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = _launch(
        tmp_path,
        monkeypatch,
        [],
        *("--launch.max_restarts", "2", "--launch.restart_window_s", "3600", "--launch.restart_backoff_s", "0"),
    )
    monkeypatch.setattr(launcher, "Service", FakeProcess)
    gen = launch._start_generator(0)
    launch.generators = [gen]
    for _ in range(2):
        gen.code = -9
        launch._restart(gen)
        gen = launch.generators[0]
    launch.restart_times["generator0"] = deque(t - 3601 for t in launch.restart_times["generator0"])  # long ago
    gen.code = -9
    launch._restart(gen)  # the two earlier ones are out of the window
    gen = launch.generators[0]
    gen.code = -9
    launch._restart(gen)
    gen = launch.generators[0]
    gen.code = -9
    gen.log_path, gen.tail = tmp_path / "generator0.log", lambda n=30: ""  # what the failure quotes
    with pytest.raises(ServiceFailed, match="after 2 restarts within 3600s"):
        launch._restart(gen)  # the third within the hour
    assert launch.restarts["generator0"] == 4  # the run's total, as reported


def test_a_service_crashing_again_waits_a_doubling_back_off_before_its_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first restart is at once; a crash soon after a restart waits launch.restart_backoff_s,
    doubled for each in a row: a service failing at start-up no longer spends its restarts in
    seconds. A crash after a minute up restarts at once again."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = _launch(tmp_path, monkeypatch, [], "--launch.max_restarts", "5", "--launch.restart_backoff_s", "0.3")
    monkeypatch.setattr(launcher, "Service", FakeProcess)
    launch.generators = [launch._start_generator(0)]

    def crash_and_restart() -> float:
        """Seconds from the crash to the restart, _restart called as the watch loop calls it."""
        dead = launch.generators[0]
        dead.code = -9
        crashed = time.monotonic()
        while launch.generators[0] is dead:
            assert time.monotonic() - crashed < 10, "never restarted"
            launch._restart(dead)
            time.sleep(0.02)
        return time.monotonic() - crashed

    waits = [crash_and_restart() for _ in range(3)]
    assert waits[0] < 0.1 and 0.3 <= waits[1] < 0.55 and 0.6 <= waits[2] < 0.9, waits
    launch.restart_times["generator0"] = deque(t - 61 for t in launch.restart_times["generator0"])  # up a minute
    assert crash_and_restart() < 0.1
    assert launch.restarts["generator0"] == 4


def test_the_run_files_that_hold_the_redis_url_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis.url may carry the password (redis://user:pass@host): config.yaml and services.json
    were written 0644 into a directory others may read."""
    launch = _launch(tmp_path, monkeypatch, [], "--redis.url", "redis://fw:s3cret@10.0.0.5:6379/0")
    launch._write_config("model")
    launch._publish_pids()
    for name in ("config.yaml", "services.json"):
        path = tmp_path / name
        assert "s3cret" in path.read_text() and path.stat().st_mode & 0o777 == 0o600, name


def test_a_run_that_trained_nothing_or_was_refused_its_configuration_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reward failing (or every prompt dropped) ended `flywheel run` with exit code 0 and
    0 steps; a service refusing the configuration (its exit code 2) ended it with 1, where the
    README says 2."""
    launch = _launch(tmp_path, monkeypatch, [])
    for stage in ("_prepare", "_start_services", "_watch", "_final_eval", "_shutdown"):
        monkeypatch.setattr(launch, stage, lambda: None)
    assert launch.run() == 0  # no metrics file: written on another node (Ray), nothing to tell
    (tmp_path / "learner_metrics.jsonl").write_text("")  # the learner opened it and trained nothing
    assert launch.run() == 1
    (tmp_path / "learner_metrics.jsonl").write_text(json.dumps({"step": 3}) + "\n")
    assert launch.run() == 0

    class Refused:
        name, returncode, log_path = "learner", 2, tmp_path / "learner.log"

        def tail(self, n: int = 25) -> str:
            return "set --data.n_samples_per_prompt >= 2"

    def refuse() -> None:
        raise launcher.ServiceFailed(Refused(), "exited with code 2")  # type: ignore[arg-type]

    monkeypatch.setattr(launch, "_watch", refuse)
    assert launch.run() == 2


def test_the_timeline_of_a_long_run_stays_bounded_and_whole() -> None:
    """Seven series grew by a point each half second for the launcher's life (37 MiB a day)."""
    tl = Timeline(start_wall=1000.0, max_points=8)
    for i in range(100):
        tl.add(t=float(i), gen_tokens_per_s=5.0, ready_groups=1.0, learner_version=float(i), tokens_in=10.0 * i,
               active_leases=4.0, admission_blocked_s=0.0)  # fmt: skip
    assert len(tl.t) < 8 and len(tl.t) == len(tl.tokens_in) == len(tl.learner_version)
    assert tl.t == [float(i) for i in range(0, 100, tl.every)]  # alike over the whole run, start to end
    assert tl.t[-1] > 100 - 1 - tl.every and tl.tokens_in == [10.0 * t for t in tl.t]
