"""Generator autoscaling: the fleet follows what the learner can consume.

Every ``autoscale.interval_s`` the controller reads the hub's metrics and compares two windows:

- *too many generators*: for ``blocked_frac`` of the interval the generators had lease slots the
  staleness bound kept empty (``admission_blocked_seconds``): the learner cannot use more data
  than they make. Shrink by one.
- *too few*: fewer ready groups wait than ``starving_ready_steps`` learner steps need, and the
  generators use at least ``busy_utilisation`` of their slots: the learner waits for data the
  fleet cannot make faster. Grow by one.

Changes are one replica at a time, within [min, max], at most once per ``cooldown_s`` (a new
generator needs time to load its model). A backend applies them: the launcher's own processes or
Ray actors, or a shell command (the hook for compose and Kubernetes). New generators register,
get the current weights at the next sync, then leases; removed ones drain first (they finish or
give back what they hold), so no lease is lost.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from flywheel.config import AutoscaleConfig

log = logging.getLogger(__name__)

SILENCE_INTERVALS = 3  # intervals without the hub's metrics before the autoscaler says it cannot see them


class Backend(Protocol):
    def replicas(self) -> int: ...

    def scale_to(self, n: int) -> None: ...


@dataclass
class Signals:
    """What one look at the hub shows (metric names as the hub exports them)."""

    t: float
    ready_groups: float
    active_leases: float
    generator_capacity: float
    admission_blocked_s: float
    registered: float | None = None  # generators registered and not draining (None: not known)
    learner_version: float | None = None  # (None: not known)
    stale_scrapes: float = 0.0  # answers the hub gave from its last snapshot, its loop too busy

    @classmethod
    def from_metrics(cls, m: dict[str, float], t: float) -> Signals:
        registered = m["generators"] - m.get("generators_draining", 0.0) if "generators" in m else None
        return cls(
            t=t,
            ready_groups=m.get("ready_groups", 0.0),
            active_leases=m.get("active_leases", 0.0),
            generator_capacity=m.get("generator_capacity", 0.0),
            admission_blocked_s=m.get("admission_blocked_seconds", 0.0),
            registered=registered,
            learner_version=m.get("learner_version"),
            stale_scrapes=m.get("stale_scrapes", 0.0),
        )


@dataclass
class Decision:
    target: int
    why: str


def decide(
    cfg: AutoscaleConfig,
    current: int,
    before: Signals,
    now: Signals,
    groups_per_step: int,
    learner_paused: bool = False,
) -> Decision:
    """The next replica count from two looks at the hub; a pure function (unit-tested).
    ``learner_paused``: the learner has taken no step for a while (``LearnerPace``)."""
    dt = max(now.t - before.t, 1e-9)
    blocked = (now.admission_blocked_s - before.admission_blocked_s) / dt
    utilisation = now.active_leases / now.generator_capacity if now.generator_capacity else 0.0
    ready_steps = now.ready_groups / max(groups_per_step, 1)
    if current < cfg.min_generators:
        return Decision(cfg.min_generators, f"below the minimum {cfg.min_generators}")
    if current > cfg.max_generators:
        return Decision(cfg.max_generators, f"above the maximum {cfg.max_generators}")
    if blocked < 0:  # a counter that went back: the hub restarted between the two looks
        return Decision(current, "the hub restarted: its blocked time counts again from zero")
    if blocked >= cfg.blocked_frac and current > cfg.min_generators:
        if learner_paused:  # loading, checkpointing, evaluating, restarting: its pause, not a surplus
            return Decision(current, "generators held by the staleness bound, but the learner takes no step")
        return Decision(current - 1, f"generators idle under the staleness bound {blocked:.0%} of the time")
    # (no generator at all, with autoscale.min_generators 0: none can be busy, and none to wait for)
    busy = utilisation >= cfg.busy_utilisation or current == 0
    starving = ready_steps < cfg.starving_ready_steps and busy
    if starving and blocked < cfg.blocked_frac / 2 and current < cfg.max_generators:
        loading = 0 if now.registered is None else current - int(now.registered)
        if loading > 0:  # the hub's signals do not count them yet: another now would overshoot
            return Decision(current, f"{loading} started generators not registered yet")
        return Decision(
            current + 1, f"learner starving ({ready_steps:.1f} steps ready) with generators busy ({utilisation:.0%})"
        )
    return Decision(current, "steady")


class LearnerPace:
    """Whether the learner is pausing: no step for twice as long as its steps take (and two of
    the autoscaler's intervals at least), or none since it was first seen. Two looks an interval
    apart would not say: a learner step can take longer than an interval."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.version: float | None = None
        self.moved_at = 0.0  # when the version last moved (or was first seen)
        self.step_s: float | None = None  # the time a step took, over the last move

    def paused(self, s: Signals) -> bool:
        if s.learner_version is None:
            return False  # (a hub that does not say: no guess)
        if self.version is None or s.learner_version < self.version:  # first seen, or a new run
            self.version, self.moved_at, self.step_s = s.learner_version, s.t, None
        elif s.learner_version > self.version:
            self.step_s = (s.t - self.moved_at) / (s.learner_version - self.version)
            self.version, self.moved_at = s.learner_version, s.t
            return False
        if self.step_s is None:
            # No step since it was first seen: loading, or restarted. (It waited for two of the
            # autoscaler's intervals first, and the autoscaler decides after one: at a run's
            # start, the fleet filling the staleness bound before the learner's first step
            # lost a generator, grown back one vLLM start later.)
            return True
        return s.t - self.moved_at > max(2 * self.step_s, 2 * self.interval_s)


class Autoscaler:
    def __init__(
        self,
        cfg: AutoscaleConfig,
        backend: Backend,
        metrics: Callable[[], dict[str, float]],
        groups_per_step: int,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.metrics = metrics
        self.groups_per_step = groups_per_step
        self.history: list[tuple[float, int, str]] = []  # (time, replicas, why) of every change
        self._last: Signals | None = None
        self._last_change = -1e18
        self._silent_since: float | None = None
        self._said_silent = False
        self._pace = LearnerPace(cfg.interval_s)

    def tick(self, now: float | None = None) -> Decision | None:
        """Look at the hub if an interval has passed; scale if the rules say so."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last.t < self.cfg.interval_s:
            return None
        if getattr(self.backend, "busy", False):
            self._last = None  # the last change is still being applied: a fresh look once it is
            return None
        m = self.metrics()
        if not m:  # the hub is not answering: change nothing on no information, and say so
            self._note_silence(now)
            return None
        self._silent_since = None
        signals = Signals.from_metrics(m, now)
        if self._last is not None and signals.stale_scrapes > self._last.stale_scrapes:
            # the hub's loop was too busy to answer: this may be an old snapshot, stamped now
            self._last = replace(self._last, stale_scrapes=signals.stale_scrapes)
            return None
        before, self._last = self._last, signals
        observe = getattr(self.backend, "observe", None)
        if observe is not None:
            observe(signals.registered)
        paused = self._pace.paused(signals)
        if before is None:
            return None
        current = self.backend.replicas()
        decision = decide(self.cfg, current, before, signals, self.groups_per_step, paused)
        if decision.target != current and now - self._last_change >= self.cfg.cooldown_s:
            log.info("autoscale: %d -> %d generators (%s)", current, decision.target, decision.why)
            self.backend.scale_to(decision.target)
            self._last_change = now
            self.history.append((now, decision.target, decision.why))
        return decision

    def _note_silence(self, now: float) -> None:
        if self._silent_since is None:
            self._silent_since, self._said_silent = now, False
        elif not self._said_silent and now - self._silent_since >= SILENCE_INTERVALS * self.cfg.interval_s:
            log.warning(
                "autoscale: the hub's metrics have not answered for %.0fs, so the fleet is not scaled; where the "
                "hub runs elsewhere (compose, Kubernetes), give generator.hub_address an address this host reaches "
                "and open hub.metrics_port",
                now - self._silent_since,
            )
            self._said_silent = True


class CommandBackend:
    """The hook for deployments the launcher does not own: ``docker compose ... --scale
    generator={replicas}``, ``kubectl scale deployment/generator --replicas={replicas}``.

    The hook runs in a thread of its own: a slow one (an image pull, ``timeout_s`` at most) must
    not hold the launcher's loop, which restarts dead services. While it runs, ``busy`` is true
    and no other change is made; the count moves only when the hook succeeds."""

    def __init__(self, command: str, start: int, timeout_s: float = 600.0) -> None:
        self.command = command
        self.n = start
        self.timeout_s = timeout_s
        self._hook: threading.Thread | None = None

    def replicas(self) -> int:
        return self.n

    def observe(self, registered: float | None) -> None:
        """The hub counts more generators than this backend thinks it runs (a deployment started
        with more, or grown by hand): take its count, or the next change would stop them."""
        if registered is not None and registered > self.n and not self.busy:
            self.n = int(registered)

    @property
    def busy(self) -> bool:
        return self._hook is not None and self._hook.is_alive()

    def scale_to(self, n: int) -> None:
        if self.busy:
            return
        self._hook = threading.Thread(target=self._run, args=(n,), name="autoscale-hook", daemon=True)
        self._hook.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait for a running hook; whether none runs any more."""
        if self._hook is not None:
            self._hook.join(timeout_s)
        return not self.busy

    def _run(self, n: int) -> None:
        # a plain replace, not str.format: a hook may hold braces of its own (JSON, ${VAR})
        command = self.command.replace("{replicas}", str(n))
        try:
            argv = shlex.split(command)
            result = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, ValueError, subprocess.TimeoutExpired) as err:  # a hook that fails must not end the run
            log.warning("autoscale command failed: %s", err)
            return
        if result.returncode != 0:
            log.warning("autoscale command failed (%d): %s", result.returncode, result.stderr[-500:])
            return
        self.n = n


class ServiceBackend:
    """Generators the launcher (or a test) starts and stops itself: ``start(i)`` returns a
    handle with ``stop()``; the newest go first on scale-down (SIGTERM: they drain).

    A scale-down is done once the generator it stopped is gone (``busy`` until then, so no
    decision is taken meanwhile): it drains for up to ``generator.drain_timeout_s``, longer than a
    cooldown, and a scale-up meanwhile would start a generator under its index, its id at the
    hub and its GPUs while it still holds them."""

    def __init__(self, start: Callable[[int], Any], stop: Callable[[Any], None], running: list[Any]) -> None:
        self._start = start
        self._stop = stop
        self.running = running
        self._indices = list(range(len(running)))  # each running handle's index, in the same order
        self._retiring: list[Any] = []  # stopped handles (with ``alive()``) not yet gone

    @property
    def busy(self) -> bool:
        self._retiring = [h for h in self._retiring if callable(getattr(h, "alive", None)) and h.alive()]
        return bool(self._retiring)

    def replicas(self) -> int:
        return len(self.running)

    def scale_to(self, n: int) -> None:
        while len(self.running) < n:
            # the lowest index free: generator i is started on the devices planned for generator i,
            # and a growing index would run past the plan (onto a spare's or the learner's GPU)
            index = min(set(range(len(self._indices) + 1)) - set(self._indices))
            self.running.append(self._start(index))
            self._indices.append(index)
        while len(self.running) > n:
            self._indices.pop()
            handle = self.running.pop()
            self._stop(handle)
            self._retiring.append(handle)
