"""The autoscaling rules (a pure function) and the controller's interval and cooldown."""

from __future__ import annotations

from flywheel.autoscale import Autoscaler, ServiceBackend, Signals, decide
from flywheel.config import load_config

CFG = load_config(["--autoscale.min_generators", "1", "--autoscale.max_generators", "3"]).autoscale


def look(t: float, ready: float = 0, active: float = 8, capacity: float = 8, blocked_s: float = 0) -> Signals:
    return Signals(
        t=t, ready_groups=ready, active_leases=active, generator_capacity=capacity, admission_blocked_s=blocked_s
    )


def test_blocked_generators_shrink_the_fleet_down_to_the_minimum() -> None:
    before, now = look(0, ready=10, active=2, blocked_s=0), look(10, ready=10, active=2, blocked_s=8)
    assert decide(CFG, 3, before, now, groups_per_step=4).target == 2
    assert decide(CFG, 1, before, now, groups_per_step=4).target == 1  # the minimum holds
    assert decide(CFG, 2, before, look(10, ready=10, active=2, blocked_s=2), 4).target == 2  # 20% blocked: steady


def test_a_learner_that_took_no_step_shrinks_nothing() -> None:
    """While the learner loads, checkpoints, evaluates or restarts, the generators fill the bound
    and wait: that is its pause, not a surplus (the fleet lost one a cooldown down to the minimum,
    then grew back one vLLM start at a time)."""
    from dataclasses import replace

    from flywheel.autoscale import LearnerPace

    before, now = look(0, ready=10, active=2, blocked_s=0), look(10, ready=10, active=2, blocked_s=8)
    paused = decide(CFG, 3, before, now, 4, learner_paused=True)
    assert paused.target == 3 and "takes no step" in paused.why
    assert decide(CFG, 3, before, now, 4, learner_paused=False).target == 2
    # a step of 12 s seen through looks 5 s apart: stepping, though most pairs of looks see no move
    pace = LearnerPace(interval_s=5.0)
    seen = [pace.paused(replace(look(t), learner_version=float(t // 12))) for t in range(0, 120, 5)]
    assert not any(seen[5:]), seen
    assert pace.paused(replace(look(200.0), learner_version=9.0))  # then none for 80 s: a pause
    # none yet since it was first seen: loading, from the first look on (the autoscaler decides at
    # its second: the fleet lost a generator at every run's start)
    loading = LearnerPace(interval_s=5.0)
    assert [loading.paused(replace(look(t), learner_version=0.0)) for t in (0.0, 5.0, 11.0)] == [True, True, True]
    assert not loading.paused(replace(look(14.0), learner_version=1.0))  # its first step


def test_a_stale_answer_from_a_busy_hub_is_not_taken_for_a_look() -> None:
    m = {"ready_groups": 0.0, "active_leases": 8.0, "generator_capacity": 8.0, "admission_blocked_seconds": 0.0}
    backend = ServiceBackend(lambda i: i, lambda svc: None, [0])
    scaler = Autoscaler(CFG.model_copy(update={"interval_s": 1.0, "cooldown_s": 0.0}), backend, lambda: m, 4)
    scaler.tick(now=0.0)
    m["stale_scrapes"] = 1.0  # the loop did not answer: the last snapshot again
    assert scaler.tick(now=1.0) is None and backend.replicas() == 1
    assert scaler.tick(now=2.0).target == 2  # type: ignore[union-attr]  # a fresh look decides


def test_a_starving_learner_with_busy_generators_grows_the_fleet_up_to_the_maximum() -> None:
    before, now = look(0), look(10, ready=1, active=7, capacity=8)
    assert decide(CFG, 1, before, now, groups_per_step=4).target == 2
    assert decide(CFG, 3, before, now, groups_per_step=4).target == 3  # the maximum holds
    idle = look(10, ready=1, active=2, capacity=8)  # generators not busy: more would not help
    assert decide(CFG, 1, before, idle, groups_per_step=4).target == 1
    fed = look(10, ready=8, active=8, capacity=8)  # two steps ready: the learner is fed
    assert decide(CFG, 1, before, fed, groups_per_step=4).target == 1


def test_a_hub_restarted_between_two_looks_changes_nothing() -> None:
    """The hub's blocked time counts from zero again after a restart: a negative share is no
    sign of a starving learner (it read as "never blocked" and grew the fleet)."""
    before, now = look(0, blocked_s=500), look(10, ready=1, active=7, capacity=8, blocked_s=1)
    assert decide(CFG, 2, before, now, groups_per_step=4).target == 2


def test_out_of_bounds_counts_are_brought_back() -> None:
    assert decide(CFG, 0, look(0), look(1), 4).target == 1
    assert decide(CFG, 5, look(0), look(1), 4).target == 3


def test_the_controller_waits_its_interval_and_cooldown() -> None:
    cfg = CFG.model_copy(update={"interval_s": 1.0, "cooldown_s": 5.0})
    started: list[int] = []
    backend = ServiceBackend(lambda i: started.append(i) or i, lambda svc: None, [0])
    m = {"ready_groups": 0.0, "active_leases": 8.0, "generator_capacity": 8.0, "admission_blocked_seconds": 0.0}
    scaler = Autoscaler(cfg, backend, lambda: m, groups_per_step=4)
    assert scaler.tick(now=0.0) is None  # the first look only sets the baseline
    assert scaler.tick(now=0.5) is None  # within the interval
    assert scaler.tick(now=1.0).target == 2 and backend.replicas() == 2  # type: ignore[union-attr]
    scaler.tick(now=2.0)  # still starving, but in the cooldown
    assert backend.replicas() == 2
    scaler.tick(now=6.5)
    assert backend.replicas() == 3 and started == [1, 2]
    assert [h[1] for h in scaler.history] == [2, 3]
    assert scaler.tick(now=20.0).target == 3  # type: ignore[union-attr]  # the maximum


def test_a_generator_started_after_a_scale_down_takes_the_lowest_index_free() -> None:
    """Generator i runs on the devices the launcher planned for generator i: after a scale-down,
    the next start reuses a freed index instead of running past the plan."""
    started: list[int] = []
    backend = ServiceBackend(lambda i: started.append(i) or i, lambda svc: None, [0])
    backend.scale_to(3)
    backend.scale_to(1)
    backend.scale_to(4)
    assert started == [1, 2, 1, 2, 3] and backend.running == [0, 1, 2, 3]


def test_no_decision_is_taken_while_a_retired_generator_drains() -> None:
    """The cooldown (30 s) is shorter than a drain (up to 75 s): a scale-up right after a
    scale-down started a new generator under the index, hub id and GPUs of one still draining."""

    class Handle:
        def __init__(self, i: int) -> None:
            self.i, self.draining = i, False

        def alive(self) -> bool:
            return self.draining

    started: list[int] = []
    handles = [Handle(0), Handle(1)]
    backend = ServiceBackend(lambda i: started.append(i) or Handle(i), lambda h: setattr(h, "draining", True), handles)
    cfg = CFG.model_copy(update={"interval_s": 1.0, "cooldown_s": 0.0})
    starving = {"ready_groups": 0.0, "active_leases": 8.0, "generator_capacity": 8.0, "admission_blocked_seconds": 0.0}
    scaler = Autoscaler(cfg, backend, lambda: starving, groups_per_step=4)
    retired = handles[1]
    backend.scale_to(1)
    assert backend.busy and retired.draining
    for t in range(5):
        assert scaler.tick(now=float(t)) is None  # starving, but the last change is not done
    assert started == []
    retired.draining = False  # gone
    scaler.tick(now=10.0)
    assert scaler.tick(now=11.0).target == 2 and started == [1]  # type: ignore[union-attr]


def test_the_command_backend_takes_the_fleet_the_hub_counts_and_does_not_cut_one_still_loading(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """compose started 4 generators, still loading when the launcher's autoscaler began (0
    registered): it took 0 for the fleet, and its first "below the minimum" scaled it to 1,
    stopping three. It starts from launch.generators at least, changes nothing while started
    generators load, and takes a larger count the hub reports."""
    import sys

    from flywheel.autoscale import CommandBackend

    out = tmp_path / "replicas"
    backend = CommandBackend(f"{sys.executable} -c \"open('{out}', 'w').write('{{replicas}}')\"", start=1)
    m = {"ready_groups": 0.0, "active_leases": 0.0, "generator_capacity": 0.0, "generators": 0.0}
    scaler = Autoscaler(CFG.model_copy(update={"interval_s": 1.0, "cooldown_s": 0.0}), backend, lambda: m, 4)
    for t in range(4):  # loading: nothing registered, nothing busy
        scaler.tick(now=float(t))
    assert not out.exists() and backend.replicas() == 1
    m.update(generators=4.0, active_leases=32.0, generator_capacity=32.0)  # all four up, busy, starving
    decision = scaler.tick(now=10.0)
    assert decision is not None and decision.target == 3  # the maximum (3): down by one, not to 1
    assert backend.wait(10) and out.read_text() == "3" and backend.replicas() == 3


def test_the_command_backend_runs_the_deployment_hook(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys

    from flywheel.autoscale import CommandBackend

    out = tmp_path / "replicas"
    hook = CommandBackend(f"{sys.executable} -c \"open('{out}', 'w').write('{{replicas}}')\"", start=1)
    hook.scale_to(3)
    assert hook.wait(30) and out.read_text() == "3" and hook.replicas() == 3
    failing = CommandBackend(f"{sys.executable} -c 'raise SystemExit(1)'", start=2)
    failing.scale_to(4)  # logged, and the count stays what the deployment has
    assert failing.wait(30) and failing.replicas() == 2
    for broken in (
        CommandBackend("/no/such/kubectl scale --replicas={replicas}", start=2),  # not installed
        CommandBackend(f"{sys.executable} -c 'import time; time.sleep(30)'", start=2, timeout_s=0.5),  # hangs
    ):
        broken.scale_to(4)  # logged as the failing one is: the run goes on
        assert broken.wait(30) and broken.replicas() == 2


def test_a_slow_hook_does_not_hold_the_launchers_loop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The hook ran inside the launcher's loop: one that took minutes (an image pull) left dead
    services unrestarted that long. It now runs on its own, and no change is made while it does."""
    import sys
    import time

    from flywheel.autoscale import CommandBackend

    release = tmp_path / "release"
    slow = f"{sys.executable} -c \"import os, time\nwhile not os.path.exists('{release}'): time.sleep(0.02)\""
    backend = CommandBackend(slow, start=1)
    m = {"ready_groups": 0.0, "active_leases": 8.0, "generator_capacity": 8.0, "admission_blocked_seconds": 0.0}
    scaler = Autoscaler(CFG.model_copy(update={"interval_s": 1.0, "cooldown_s": 0.0}), backend, lambda: m, 4)
    try:
        scaler.tick(now=0.0)
        t0 = time.monotonic()
        assert scaler.tick(now=1.0).target == 2  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 5.0 and backend.busy  # returned while the hook runs
        assert scaler.tick(now=2.0) is None and backend.replicas() == 1  # no second change on top of it
    finally:
        release.touch()  # the hook ends whatever happened (no process left polling)
    assert backend.wait(30) and backend.replicas() == 2
    # the window before and during the hook is the old fleet's: a fresh look first, then a decision
    assert scaler.tick(now=3.0) is None
    assert scaler.tick(now=4.0) is not None


def test_a_hub_whose_metrics_never_answer_is_said(caplog) -> None:  # type: ignore[no-untyped-def]
    """A compose hub's metrics read at `buffer:9400` from the Docker host: nothing answered and
    the fleet was never scaled, in silence."""
    backend = ServiceBackend(lambda i: i, lambda svc: None, [0])
    scaler = Autoscaler(CFG.model_copy(update={"interval_s": 1.0}), backend, lambda: {}, groups_per_step=4)
    with caplog.at_level("WARNING", logger="flywheel.autoscale"):
        for t in range(6):
            assert scaler.tick(now=float(t)) is None
    said = [r.getMessage() for r in caplog.records if "have not answered" in r.getMessage()]
    assert len(said) == 1 and "generator.hub_address" in said[0], said


def test_a_hook_with_braces_of_its_own_or_a_bad_quote_does_not_end_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys

    from flywheel.autoscale import CommandBackend

    out = tmp_path / "patch"
    write_arg = f"{sys.executable} -c \"import sys; open('{out}', 'w').write(sys.argv[1])\""
    kubectl_patch = CommandBackend(write_arg + ' \'{"spec": {"replicas": {replicas}}}\'', start=1)
    kubectl_patch.scale_to(5)  # str.format took the JSON's braces for fields: KeyError, the run ended
    assert kubectl_patch.wait(30)
    assert out.read_text() == '{"spec": {"replicas": 5}}' and kubectl_patch.replicas() == 5
    unbalanced = CommandBackend("kubectl 'scale --replicas={replicas}", start=2)
    unbalanced.scale_to(3)  # shlex's ValueError: logged, as a failing hook is
    assert unbalanced.wait(30) and unbalanced.replicas() == 2


def test_a_fleet_scaled_to_zero_grows_back_when_the_learner_starves() -> None:
    """autoscale.min_generators 0: with no generator, no slot can be busy; the fleet stayed at 0."""
    cfg = load_config(["--autoscale.min_generators", "0", "--autoscale.max_generators", "3"]).autoscale
    empty = look(10, ready=0, active=0, capacity=0)
    assert decide(cfg, 0, look(0, active=0, capacity=0), empty, groups_per_step=4).target == 1


def test_no_growth_while_started_generators_have_not_registered() -> None:
    """The hub's signals count registered generators only: growing again before the last one
    started has registered (a vLLM start outlasts the cooldown) ran the fleet to its maximum."""
    before = look(0)
    loading = Signals(t=10, ready_groups=1, active_leases=7, generator_capacity=8, admission_blocked_s=0, registered=1)
    decision = decide(CFG, 2, before, loading, groups_per_step=4)
    assert decision.target == 2 and "not registered yet" in decision.why
    registered = Signals(
        t=10, ready_groups=1, active_leases=7, generator_capacity=8, admission_blocked_s=0, registered=2
    )
    assert decide(CFG, 2, before, registered, groups_per_step=4).target == 3
    assert Signals.from_metrics({"generators": 3, "generators_draining": 1}, 0).registered == 2
