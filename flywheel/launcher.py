"""``flywheel run RECIPE``: the whole loop on one machine, one process per service.

Order: a private Redis (AOF, in the run directory) -> the task's prompts and model -> the
supervised warm start -> the hub -> the reward service -> the generators (waited for until they
register) -> the learner. Then one live display for the whole system until the learner reaches
``train.total_steps``; then the final evaluation and the run report.

A service that dies (kill -9, out of memory, a crash) is started again with the same flags
(``launch.restart``, at most ``launch.max_restarts`` times each within ``launch.restart_window_s``):
Redis from its AOF on the same port, the hub on the same ports (so its peers reconnect by
themselves), the learner from its latest checkpoint. A bad configuration (exit code 2), or one
restart too many, stops the run: everything is shut down (generators drain, Redis last) and the launcher names the service, its
exit code and the end of its log. Ctrl-C does the same. Each service runs in its own process
group and gets SIGTERM if the launcher itself dies. ``<run_dir>/services.json`` names every
running service's pid (chaos tests read it).

GPUs: on a machine with CUDA GPUs each GPU service gets its own (``assign_gpus``): the learner's
ranks the first ones, then each generator as many as its tensor-parallel size; the warm start and
the evaluations run on the learner's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
import yaml
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table

from flywheel import standby
from flywheel.autoscale import Autoscaler, CommandBackend, ServiceBackend
from flywheel.config import FlywheelConfig
from flywheel.files import write_atomically
from flywheel.hub_client import hub_metrics
from flywheel.netsec import check_keys, create_keys, redis_password
from flywheel.procs import Service, ServiceHandle, parse_cpu_list, wait_for_state_file
from flywheel.redis_server import RedisServer, free_port
from flywheel.tasks import arithmetic_rows, write_jsonl

log = logging.getLogger("flywheel.run")
ROOT = Path(__file__).resolve().parents[1]
SERVICES_FILE = "services.json"  # in the run directory: pids, restarts, the run's Redis
STANDBY_LEARNER = "learner_standby"  # the service name of the standby learner (launch.standby_learner)
# After a standby learner took over, its successor starts this much later: its imports take seconds
# of CPU that the new learner's first steps need more (measured: a 1 s step took 3.5 s beside them).
STANDBY_LEARNER_DELAY_S = 30.0
MAX_RESTART_BACKOFF_S = 300.0  # the longest wait launch.restart_backoff_s doubles up to
STABLE_UPTIME_S = 60.0  # a service up this long after its restart was not failing at start-up


# torchrun's summary of a failed rank (torch.distributed.elastic): "  exitcode  : 2 (pid: 123)"
_TORCHRUN_RANK_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid", re.MULTILINE)


def exit_code(svc: ServiceHandle) -> int | None:
    """The service's exit code, or its ranks' under torchrun, which exits 1 whatever they did: a
    rank that refused the configuration (2) must stop the run, not restart it until
    launch.max_restarts."""
    code = svc.returncode
    if code == 1:
        ranks = {int(c) for c in _TORCHRUN_RANK_EXIT.findall(svc.tail(80))}
        if ranks == {2}:
            return 2
    return code


class RedisFailed(RuntimeError):
    """The run's Redis would not start, or stopped for good: the run cannot go on."""


class ServiceFailed(RuntimeError):
    def __init__(self, service: ServiceHandle, why: str) -> None:
        self.service = service
        super().__init__(f"{service.name} {why}; the end of {service.log_path}:\n{service.tail(25)}")


def read_services(run_dir: Path) -> dict[str, Any]:
    """What ``<run_dir>/services.json`` says of a running ``flywheel run``: every service's pid,
    the restarts so far and the run's Redis (``redis_url``). Raises OSError or ValueError when
    the directory holds no running run."""
    return json.loads((Path(run_dir) / SERVICES_FILE).read_text())


def run_redis_url(run_dir: Path) -> str:
    """The address of the run's Redis, whoever started it (the launcher or Ray)."""
    url = read_services(run_dir).get("redis_url")
    if not url:
        raise ValueError(f"{run_dir}/{SERVICES_FILE} names no Redis yet: the run is still starting")
    return str(url)


@dataclass
class Timeline:
    """What the launcher saw over time: the report's throughput plot."""

    start_wall: float = field(default_factory=time.time)
    t: list[float] = field(default_factory=list)  # seconds since the launcher started
    gen_tokens_per_s: list[float] = field(default_factory=list)
    ready_groups: list[float] = field(default_factory=list)
    learner_version: list[float] = field(default_factory=list)
    # the hub's own counters at each sample: what the report's generator figures are made of
    tokens_in: list[float] = field(default_factory=list)
    active_leases: list[float] = field(default_factory=list)
    admission_blocked_s: list[float] = field(default_factory=list)
    max_points: int = 20_000  # about 3 h at the launcher's 2 samples a second
    every: int = 1  # one sample of this many is kept (doubles each time the lists reach max_points)
    _offered: int = 0

    def add(self, **values: float) -> None:
        """One sample: ``t`` and every series. Past ``max_points`` every other point goes and
        from then on one sample in two (four, ...) is kept: a run of days holds its whole curve in
        bounded memory (it grew by 37 MiB a day), and the counters it keeps still difference right."""
        self._offered += 1
        if (self._offered - 1) % self.every:
            return
        self.t.append(values.pop("t"))
        for name, value in values.items():
            getattr(self, name).append(value)
        if len(self.t) >= self.max_points:
            for name in ("t", *values):
                del getattr(self, name)[1::2]
            self.every *= 2


def visible_gpus() -> list[str]:
    """The GPUs this machine's services may use: CUDA_VISIBLE_DEVICES when set, else the ones
    nvidia-smi lists (none without NVIDIA's driver). Asks no CUDA library."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def assign_gpus(gpus: list[str], learner_ranks: int, generator_gpus: list[int]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES of each GPU service: the learner's ranks take the first GPUs, generator
    ``i`` the next ``generator_gpus[i]``; the warm start and the evaluations use the learner's.
    Empty when there are fewer GPUs than that needs (then no service gets its own)."""
    if len(gpus) < learner_ranks + sum(generator_gpus):
        return {}
    learner = ",".join(gpus[:learner_ranks])
    plan = {"learner": learner, "sft": learner, "eval_start": learner, "eval_end": learner}
    at = learner_ranks
    for i, n in enumerate(generator_gpus):
        plan[f"generator{i}"] = ",".join(gpus[at : at + n])
        at += n
    return plan


def live_run_pids(run_dir: Path) -> list[int]:
    """The processes of a ``flywheel run`` still going in ``run_dir`` (its launcher and services,
    as its ``services.json`` names them; a pid reused since by a younger process does not count)."""
    path = run_dir / SERVICES_FILE
    try:
        data = json.loads(path.read_text())
        written = path.stat().st_mtime
    except (OSError, ValueError):
        return []
    named = [data.get("launcher_pid"), *dict(data.get("pids") or {}).values()]
    live = []
    for pid in named:
        if not isinstance(pid, int) or pid == os.getpid():
            continue
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= written + 1:
                live.append(pid)
        except psutil.Error:
            continue
    return live


def refuse_live_run(run_dir: Path) -> None:
    """A second ``flywheel run`` in the directory of one still going would move it away under it
    (or, resuming, run beside it on its Redis): refused (ValueError, exit 2)."""
    live = live_run_pids(run_dir)
    if live:
        raise ValueError(
            f"a run is still going in {run_dir} (pids {live}): stop it (Ctrl-C, or kill the launcher) or pick "
            "another --run.name / --launch.run_dir"
        )


def set_aside(run_dir: Path) -> Path | None:
    """Move a previous run out of ``run_dir`` (to ``run_dir.1``, ``.2``, ...) so a new run starts
    clean: its Redis would otherwise reload the old run's AOF (versions, queues, leases) and the
    learner would start behind the hub. Returns where it went; None when there was nothing.

    Only a run's directory is moved: a directory of other files (``launch.run_dir`` pointed at a
    project, or ``.``) is refused, as is one whose run is still going."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    if not (run_dir / SERVICES_FILE).exists():  # every run writes it first thing (LocalLaunch.__init__)
        raise ValueError(
            f"{run_dir} holds files that are not a Flywheel run, and a new run would move it aside: pick another "
            "--run.name / --launch.run_dir, or an empty directory"
        )
    refuse_live_run(run_dir)
    n = 1
    while run_dir.with_name(f"{run_dir.name}.{n}").exists():
        n += 1
    return run_dir.rename(run_dir.with_name(f"{run_dir.name}.{n}"))


REDIS_FILES = ("appendonlydir", "appendonly.aof", "dump.rdb")  # what a redis-server leaves in its --dir


def set_aside_redis_dir(where: Path) -> Path | None:
    """A fresh run's private Redis in ``redis.dir`` (outside the run's directory, which
    ``set_aside`` moves): what an earlier run left there goes to ``where.1``, ``.2``, ... Kept, its
    AOF would be reloaded, and the hub recovers that run's state (versions, leases, counters)
    under the same run name while the learner starts at v0. A directory of other files is refused."""
    if not where.is_dir() or not any(where.iterdir()):
        return None
    if not any((where / name).exists() for name in REDIS_FILES):
        raise ValueError(
            f"redis.dir {where} holds files that are not Redis's, and a new run would move them aside: pick "
            "another redis.dir, or an empty directory"
        )
    n = 1
    while where.with_name(f"{where.name}.{n}").exists():
        n += 1
    return where.rename(where.with_name(f"{where.name}.{n}"))


class LocalLaunch:
    def __init__(self, cfg: FlywheelConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = Path(cfg.launch.run_dir or Path("runs") / cfg.run.name).resolve()
        if cfg.train.resume:
            refuse_live_run(self.run_dir)
        moved = set_aside(self.run_dir) if not cfg.train.resume else None
        if moved is not None:
            self.console.print(f"the previous run in {self.run_dir} was moved to {moved}")
        if cfg.redis.dir and not cfg.redis.url and not cfg.train.resume:
            moved = set_aside_redis_dir(Path(cfg.redis.dir).resolve())
            if moved is not None:
                self.console.print(f"the previous run's Redis data in {cfg.redis.dir} was moved to {moved}")
        self.logs = self.run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.services: list[ServiceHandle] = []
        self.redis: RedisServer | None = None
        self.redis_url = cfg.redis.url  # the run's Redis, whoever started it (services.json says)
        self.overrides: list[str] = []  # what the launcher decided: every service gets these flags
        self.hub_ports: dict[str, int] = {}
        self.timeline = Timeline()
        self.started = time.monotonic()
        self.eval_start: dict[str, Any] | None = None
        self.base_model = ""  # the model before the warm start (set by _prepare)
        self.eval_end: dict[str, Any] | None = None
        self.generators: list[ServiceHandle] = []
        self.retiring: list[tuple[ServiceHandle, float]] = []  # scaled down, draining: (service, kill at)
        self.spares: list[ServiceHandle] = []  # generators loaded and idle (launch.spare_generators)
        self.spares_started = 0  # spare names are never reused: each has a log file of its own
        self.standbys_started = 0  # standby learners, each with a takeover file of its own
        self.learner_standby_file: Path | None = None
        self.standby_learner_due: float | None = None  # when the next standby learner starts
        self.autoscaler: Autoscaler | None = None
        # the autoscaler's most, when the GPUs hold fewer generators than autoscale.max_generators
        self.generator_cap: int | None = None
        self.recipes: dict[str, tuple[str, list[str], dict[str, str] | None]] = {}  # how to start it again
        self.restarts: Counter[str] = Counter()
        self.restart_times: defaultdict[str, deque[float]] = defaultdict(deque)  # within the restart window
        self.restart_due: dict[str, float] = {}  # a dead service's next restart, once its back-off is over
        self.quick_crashes: Counter[str] = Counter()  # crashes in a row soon after a restart (_backed_off)
        # First thing: the directory is now a run's, and a second launcher sees this one live
        # (its pid) while it prepares, before any service has started.
        self._publish_pids()

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the run as Ctrl-C does
        # and Ctrl-C (SIGINT) always does: a launcher started in the background by a non-interactive
        # shell (`cmd &`, nohup'd CI) inherits SIGINT as ignored, and Python leaves it so
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            for key in self.cfg.launch.cpus:
                self._cpus(key)
        except ValueError as err:
            self.console.print(f"[bold red]flywheel run: {err}")
            return 2
        try:
            self._prepare()
            self._start_services()
            self._watch()
            self._final_eval()
            # (the learner opens its metrics file as it starts: none here means it wrote it on a
            # node of its own, a Ray cluster's, and this machine cannot tell)
            metrics = self.run_dir / "learner_metrics.jsonl"
            trained = self._read_last(metrics) or {}
            if "learner" in self.cfg.launch.services and metrics.exists() and not trained.get("step"):
                self.console.print(
                    "[bold red]flywheel run: the learner ended without training a step: see the hub's and the "
                    f"learner's logs in {self.logs} (failed rewards, spent prompts)"
                )
                return 1
            return 0
        except ServiceFailed as err:
            self.console.print(f"[bold red]flywheel run: {err}")
            return 2 if exit_code(err.service) == 2 else 1  # 2: a service refused the configuration
        except RedisFailed as err:
            self.console.print(f"[bold red]flywheel run: {err}")
            return 1
        except KeyboardInterrupt:
            self.console.print("[yellow]interrupted: shutting everything down")
            return 130
        finally:
            self._shutdown()
            if self.timeline.t or self.eval_end is not None:
                try:
                    self._report()
                except Exception as err:  # a report failing must not hide why the run ended
                    self.console.print(f"[red]report failed: {type(err).__name__}: {err}")
            self.console.print(f"run directory: {self.run_dir}")

    def _flags(self, *extra: str) -> list[str]:
        return ["--config", str(self.run_dir / "config.yaml"), *self.overrides, *extra]

    # The hooks a launcher on other machinery (Ray) overrides: where services run and are reached.

    def _start_redis(self) -> str:
        password, user = redis_password(self.cfg.redis), self.cfg.redis.username
        where = Path(self.cfg.redis.dir) if self.cfg.redis.dir else self.run_dir / "redis"
        try:
            self.redis = RedisServer(
                where,
                appendfsync=self.cfg.redis.appendfsync,
                aof_rewrite_min_mb=self.cfg.redis.aof_rewrite_min_mb,
                password=password,
                username=user,
                ready_timeout_s=self.cfg.launch.ready_timeout_s,  # a resumed run's AOF loads first
            )
        except (RuntimeError, TimeoutError, OSError) as err:
            raise RedisFailed(f"redis-server did not start in {where}: {err}") from err
        self._pin_redis()
        return self.redis.url

    def _cpus(self, name: str) -> set[int] | None:
        """The CPUs ``launch.cpus`` pins service ``name`` to (generatorN falls back to generator; the
        warm start and the evaluations run on the learner's, as they do on its GPU)."""
        table = self.cfg.launch.cpus
        key = name if name in table else "generator" if name.startswith(("generator", "spare")) else None
        if key is None and name in ("sft", "eval_start", "eval_end", "learner_standby"):
            key = "learner"
        if key not in table:
            return None
        cpus, usable = parse_cpu_list(table[key]), os.sched_getaffinity(0)
        if not cpus <= usable:
            raise ValueError(
                f"launch.cpus.{key}: CPUs {sorted(cpus - usable)} are not available here "
                f"(this launcher may use {sorted(usable)})"
            )
        return cpus

    def _pin_redis(self) -> None:
        cpus = self._cpus("redis")
        if cpus is not None and self.redis is not None:
            os.sched_setaffinity(self.redis.proc.pid, cpus)

    def _redis_died(self) -> int | None:
        """Redis's exit code once it died (None while it runs, or when this launcher has none)."""
        return None if self.redis is None else self.redis.proc.poll()

    def _restart_redis(self) -> None:
        """The same port and directory: it reloads its AOF, and every client reconnects."""
        assert self.redis is not None
        # (a long AOF loads before Redis answers)
        self.redis = self.redis.restarted(ready_timeout_s=self.cfg.launch.ready_timeout_s)
        self._pin_redis()

    def _service(self, name: str, module: str, *args: str, env: dict[str, str] | None = None) -> ServiceHandle:
        """Start ``python -m module args`` as the service ``name``; returns a handle with name,
        alive(), returncode, stop(), tail() and log_path (``procs.Service``)."""
        gpu = {"CUDA_VISIBLE_DEVICES": self.gpu_plan[name]} if name in self.gpu_plan else {}
        svc = Service(
            name, module, list(args), self.logs, env={**self._env(), **gpu, **(env or {})}, cpus=self._cpus(name)
        )
        self.services.append(svc)
        self._started(name, module, list(args), env)
        return svc

    def _started(self, name: str, module: str, args: list[str], env: dict[str, str] | None) -> None:
        """Remember how ``name`` was started (to restart it) and publish every pid."""
        self.recipes[name] = (module, args, env)
        self._publish_pids()

    def _publish_pids(self) -> None:
        pids = {svc.name: getattr(svc, "pid", None) for svc in self.services}
        if self.redis is not None:
            pids["redis"] = self.redis.proc.pid
        # Private: the run's Redis URL (``redis.url``) may hold the password, and a run directory
        # is shared as often as not.
        services = {
            "launcher_pid": os.getpid(),
            "pids": pids,
            "restarts": dict(self.restarts),
            "redis_url": self.redis_url,
        }
        write_atomically(self.run_dir / SERVICES_FILE, json.dumps(services), private=True)

    @cached_property
    def gpu_plan(self) -> dict[str, str]:
        """Service name -> its CUDA_VISIBLE_DEVICES (``assign_gpus``); empty on a machine without GPUs."""
        cfg = self.cfg
        gpus = visible_gpus()
        if not gpus:
            return {}
        spares, ranks = self._spare_generators(), cfg.launch.learner_procs
        generators = self._planned_generators() + spares
        tp = cfg.generator.tensor_parallel_size
        plan = assign_gpus(gpus, ranks, [tp] * generators)
        fit = (len(gpus) - ranks) // tp - spares  # generators with GPUs of their own
        if not plan and cfg.autoscale.enabled and fit >= max(cfg.launch.generators, cfg.autoscale.min_generators, 1):
            # planned for autoscale.max_generators, nothing was pinned and every service shared
            # every GPU (the learner and vLLM's 0.85 on one of them: out of memory): the fleet
            # grows to what the GPUs hold instead
            self.generator_cap = fit
            plan = assign_gpus(gpus, ranks, [tp] * (fit + spares))
            self.console.print(
                f"[bold yellow]GPUs: {len(gpus)} hold {ranks} learner rank(s) and {fit} generator(s) x {tp} "
                f"(+{spares} spare): the autoscaler grows to {fit}, not autoscale.max_generators "
                f"{cfg.autoscale.max_generators}"
            )
        if plan:
            shown = {k: v for k, v in plan.items() if k == "learner" or k.startswith("generator")}
            self.console.print(f"GPUs: {shown}")
        else:
            self.console.print(
                f"[bold yellow]GPUs: {len(gpus)} for {cfg.launch.learner_procs} learner rank(s) + {generators} "
                f"generator(s) x {tp}: not enough for one each, so every service sees all of them"
            )
        return plan

    @staticmethod
    def _env() -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def _read_state(self, svc: ServiceHandle, path: Path) -> dict[str, int]:
        try:
            return wait_for_state_file(path, svc, timeout_s=self.cfg.launch.ready_timeout_s)
        except RuntimeError:  # it died before listening: why, as for any service that failed
            raise ServiceFailed(svc, f"exited with code {svc.returncode} before listening") from None

    def _host(self, role: str) -> str:
        """The address others reach ``role`` at."""
        return "127.0.0.1"

    def _bind_host(self) -> str:
        return "127.0.0.1"  # one machine: nothing listens beyond it

    def _sync_ports(self) -> tuple[int, int]:
        return free_port(), free_port()

    def _wait_exit(self, svc: ServiceHandle, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while svc.alive():
            if time.monotonic() > deadline:
                raise ServiceFailed(svc, f"did not finish within {timeout_s:g}s")
            time.sleep(0.2)
        if svc.returncode != 0:
            raise ServiceFailed(svc, f"failed (exit code {svc.returncode})")
        # done: what it holds goes back now (on Ray, its actor's GPU reservation, which the learner's
        # own actor, asking for the same bundle's GPU next, would otherwise wait on)
        svc.stop()

    # ------------------------------------------------------------------ preparation

    def _check_local_paths(self) -> None:
        """The local paths the services will read, checked before anything starts: a model path
        that did not exist restarted the generator five times over three minutes, ending in a vLLM
        traceback about repo ids. (Anything not written as a path may be an HF hub id.)"""
        cfg = self.cfg
        if cfg.launch.launcher == "ray" and cfg.launch.ray_address is not None:
            return  # the services run on the cluster's nodes: the paths are theirs, not this machine's
        paths = {"train.model": cfg.train.model, "data.tokenizer": cfg.data.tokenizer}
        if cfg.task.name == "none":
            paths["data.path"] = cfg.data.path
        for key, value in paths.items():
            if value is None:
                continue
            local = key == "data.path" or value.startswith(("/", "./", "../", "~")) or Path(value).exists()
            if local and not Path(value).expanduser().exists():
                raise ValueError(f"{key} {value!r} does not exist (a local path; an HF hub id reads org/name)")
        if "reward" in cfg.launch.services:  # the built-ins' arguments, as the reward service checks them
            from reward_service.registry import check_kwargs, resolve

            for spec in cfg.reward.functions:
                if ":" not in spec.name:
                    check_kwargs(resolve(spec.name), spec.kwargs)

    def _prepare(self) -> None:
        cfg, start = self.cfg, self.cfg.launch.services
        self._check_local_paths()
        if cfg.security.curve:
            if cfg.security.keys_dir is None:  # a fresh set for this run (kept when it resumes)
                keys = create_keys(self.run_dir / "keys", reuse=True)
                self.overrides += ["--security.keys_dir", str(keys)]
                self.console.print(f"CURVE keys: {keys}")
            else:
                check_keys(cfg.security, server=True)
                check_keys(cfg.security, server=False)
        if "redis" in start:
            url = self.redis_url = self._start_redis()
            self.overrides += ["--redis.url", url]
            self.console.print(f"redis: {url} (AOF in {self.run_dir / 'redis'})")
        elif cfg.redis.url is None:
            raise ValueError("launch.services leaves out redis: set redis.url to the running server")
        model = cfg.train.model
        if model is None:
            if cfg.launch.tiny_model is None:
                raise ValueError("set train.model (an HF path) or launch.tiny_model (build one from code)")
            from flywheel.tiny import build_checkpoint

            model = str(build_checkpoint(self.run_dir / "base_model", size=cfg.launch.tiny_model, seed=cfg.run.seed))
            self.console.print(f"model: a {cfg.launch.tiny_model} Llama built from code in {model}")
        if cfg.task.name == "arithmetic":
            prompts = write_jsonl(
                arithmetic_rows(cfg.task.prompts, cfg.task.seed, cfg.task.max_operand), self.run_dir / "prompts.jsonl"
            )
            self.overrides += ["--data.path", str(prompts), "--data.tokenizer", cfg.data.tokenizer or model]
        self._write_config(model)
        self.base_model = model
        if cfg.task.name != "none" and not self._warm_starts():
            self.eval_start = self._evaluate(model, "eval_start")

    def _warm_starts(self) -> bool:
        return bool(self.cfg.sft.steps) and self.cfg.task.name != "none"

    def _loads_while_warm_starting(self) -> bool:
        """Generators start on the base model while the warm start trains (vLLM's start is the
        longest part of a run's start) and take the warm-started weights from the learner's first
        sync: only when this launcher starts the learner, which sends them."""
        start = self.cfg.launch.services
        return self._warm_starts() and "generator" in start and "learner" in start

    def _write_config(self, model: str) -> None:
        """The recipe as resolved (everything but what the launcher passes as flags)."""
        data = self.cfg.model_dump(mode="json", by_alias=True)
        data["train"]["model"] = model
        write_atomically(self.run_dir / "config.yaml", yaml.safe_dump(data, sort_keys=False), private=True)

    def _warm_start(self, model: str) -> str:
        out = self.run_dir / "sft_model"
        done = out / "warm_start.json"
        if self.cfg.train.resume and done.exists():
            # A resumed run keeps its warm start: it is the KL reference and the start the
            # report's accuracy is measured from, and a second one (not bit-identical on a GPU)
            # would change both under the run's feet.
            self.eval_start = json.loads(done.read_text())["eval"]
            self.console.print(f"warm start: kept from the run being resumed ({out})")
            return str(out)
        what = "random answers: the format only" if self.cfg.sft.format_only else "reference answers"
        self.console.print(f"warm start: {self.cfg.sft.steps} supervised steps ({what}) ...")
        svc = self._service("sft", "learner.sft", "--out", str(out), *self._flags("--train.model", model))
        self._wait_exit(svc, self.cfg.launch.job_timeout_s)
        result = json.loads((out / "warm_start.json").read_text())
        self.eval_start = result["eval"]
        self.console.print(
            f"warm start done in {result['sft']['seconds']:.0f}s: accuracy {self.eval_start['accuracy']:.0%}, "
            f"format {self.eval_start['format']:.0%}"
        )
        return str(out)

    def _evaluate(
        self, model: str, name: str, meanwhile: Callable[[ServiceHandle], None] | None = None
    ) -> dict[str, Any]:
        """Greedy accuracy of ``model`` (the service ``name``); ``meanwhile`` runs while it evaluates."""
        out = self.run_dir / f"{name}.json"
        svc = self._service(name, "learner.evaluate", "--model", model, "--out", str(out), *self._flags())
        if meanwhile is not None:
            meanwhile(svc)
        self._wait_exit(svc, self.cfg.launch.job_timeout_s)
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    # ------------------------------------------------------------------ services

    def _start_services(self) -> None:
        cfg, start = self.cfg, self.cfg.launch.services
        if "hub" in start:
            state = self.run_dir / "hub.json"
            state.unlink(missing_ok=True)
            hub = self._service(
                "hub",
                "buffer",
                *self._flags(
                    "--hub.host", self._bind_host(), "--hub.generator_port", "0", "--hub.reward_port", "0",
                    "--hub.metrics_port", "0", "--hub.state_file", str(state),
                ),
            )  # fmt: skip
            self.hub_ports = self._read_state(hub, state)
            # a restarted hub takes the same ports, so every peer reconnects to it by itself
            module, args, env = self.recipes["hub"]
            for key in ("generator_port", "reward_port", "metrics_port"):
                args[args.index(f"--hub.{key}") + 1] = str(self.hub_ports[key])
            hub_host = self._host("hub")
            self.overrides += [
                "--reward.hub_address",
                f"tcp://{hub_host}:{self.hub_ports['reward_port']}",
                "--generator.hub_address",
                f"tcp://{hub_host}:{self.hub_ports['generator_port']}",
            ]
            self.console.print(f"hub: {self.hub_ports}")
        if "reward" in start:
            self._service("reward", "reward_service", *self._flags())
        if "learner" in start:  # a learner run elsewhere is where the recipe's sync.* says it is
            announce, join = self._sync_ports()
            self.overrides += ["--sync.host", self._host("learner"), "--sync.announce_port", str(announce)]
            self.overrides += ["--sync.join_port", str(join)]
            if cfg.sync.transport == "auto" and visible_gpus() and not self.gpu_plan:
                # every service shares the GPUs: rank 0 and a vLLM worker on one device, where
                # NCCL refuses the pair; the weights go as CUDA IPC handles instead
                self.overrides += ["--sync.transport", "ipc"]
                self.console.print("weight sync: ipc (the learner and the generators share a GPU)")
        early = self._loads_while_warm_starting()
        if early:
            self._start_generators("--generator.model", self.base_model, "--generator.await_weights", "true")
        model = self._warm_start(self.base_model) if self._warm_starts() else self.base_model
        self.overrides += ["--train.model", model, "--generator.model", model]
        if "generator" in start and not early:
            self._start_generators()
            self._wait_generators(cfg.launch.generators)
        if cfg.autoscale.enabled:
            self.autoscaler = self._autoscaler()
        if "learner" in start:
            run_dir, export = str(self.run_dir), str(self.run_dir / "final_model")
            flags = self._flags("--train.run_dir", run_dir, "--train.export_dir", export)
            wants_checkpoints = cfg.launch.restart or cfg.train.checkpoint_every > 0
            if wants_checkpoints and not cfg.train.checkpoint_dir:  # a restarted learner resumes from here
                flags += ["--train.checkpoint_dir", str(self.run_dir / "checkpoints")]
            if cfg.launch.restart and not cfg.train.checkpoint_every:
                log.warning(
                    "train.checkpoint_every is 0: a learner that crashes cannot be restarted (it would start over "
                    "from the initial weights, which it refuses); set --train.checkpoint_every N to make it resumable"
                )
            procs = cfg.launch.learner_procs
            env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(cfg.launch.learner_threads))}
            if procs == 1:
                self._service("learner", "learner", *flags, env=env)
            else:  # data parallel: one rank per GPU (or per process on CPUs)
                launcher = ["--nproc_per_node", str(procs), "--master_port", str(free_port()), "-m", "learner"]
                self._service("learner", "torch.distributed.run", *launcher, *flags, env=env)
        if early:
            self._wait_generators(cfg.launch.generators)  # they finish loading while the learner starts
        if "generator" in start:  # once the fleet is up, so they do not slow its start
            for _ in range(self._spare_generators()):
                self._start_spare()
        if "learner" in start and cfg.launch.standby_learner:
            self._start_standby_learner()

    def _start_generators(self, *extra: str) -> None:
        self.generators += [self._start_generator(i, *extra) for i in range(self.cfg.launch.generators)]

    def _generator_identity(self, i: int | str) -> standby.Takeover:
        """Generator ``i``'s id at the hub and its ack log (audits), whichever process serves it."""
        acks = self.run_dir / "acks"
        acks.mkdir(exist_ok=True)
        return standby.Takeover(f"gen{i}", str(acks / f"gen{i}.log"))

    def _start_generator(self, i: int, *extra: str) -> ServiceHandle:
        who = self._generator_identity(i)
        flags = self._flags("--generator.id", who.generator_id, "--generator.ack_log", str(who.ack_log), *extra)
        return self._service(f"generator{i}", "generators", *flags)

    @property
    def _spares_dir(self) -> Path:
        return self.run_dir / "spares"

    def _start_spare(self, devices: str | None = None) -> None:
        """A generator that loads its engine and waits to take a dead generator's place."""
        name = f"spare{self.spares_started}"
        self.spares_started += 1
        self._spares_dir.mkdir(exist_ok=True)
        standby.clear(self._spares_dir / name)
        # the GPUs of the generator (or spare) it replaces, or its own
        devices = devices or self.gpu_plan.get(f"generator{self._planned_generators() + len(self.spares)}")
        if devices:
            self.gpu_plan[name] = devices
        # A spare starts next to running engines. vLLM-CPU's automatic thread binding would pin its
        # worker to the first core, where a running engine's worker spins: measured at 1.6% of a
        # core, still importing after minutes. Unpinned (unless set), it loads on what is free.
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        flags = self._flags("--generator.standby_file", str(self._spares_dir / name))
        self.spares.append(self._service(name, "generators", *flags, env=env))

    def _promote_spare(self, dead: ServiceHandle) -> bool:
        """Hand a dead generator's id to a loaded spare (and start a spare in its stead)."""
        spare = next((s for s in self.spares if s.alive() and standby.is_ready(self._spares_dir / s.name)), None)
        if spare is None:
            return False
        standby.hand_over(self._spares_dir / spare.name, self._generator_identity(dead.name[len("generator") :]))
        self.console.print(f"[yellow]{spare.name} takes the place of {dead.name}")
        self.spares.remove(spare)
        freed = self.gpu_plan.get(dead.name)
        if spare.name in self.gpu_plan:
            self.gpu_plan[dead.name] = self.gpu_plan[spare.name]
        spare.name = dead.name  # what the report, the chaos tests and a later restart know it by
        self.services.remove(spare)
        self.services[self.services.index(dead)] = spare
        if dead in self.generators:
            self.generators[self.generators.index(dead)] = spare
        self._start_spare(freed)  # (which publishes the pids, the promoted spare's new name included)
        return True

    def _start_standby_learner(self) -> None:
        """A second learner process, its imports done, that waits to take the learner's place."""
        module, args, env = self.recipes["learner"]
        if module != "learner":  # several ranks under torchrun: a standby would need as many
            self.console.print("[yellow]launch.standby_learner needs launch.learner_procs 1: no standby learner")
            return
        # a file of its own: the one a promoted standby waits on must outlive the next standby's start
        self.standbys_started += 1
        self.learner_standby_file = self._spares_dir / f"learner{self.standbys_started}"
        self._spares_dir.mkdir(exist_ok=True)
        standby.clear(self.learner_standby_file)
        if "learner" in self.gpu_plan:  # its devices, used only once it is the learner
            self.gpu_plan[STANDBY_LEARNER] = self.gpu_plan["learner"]
        flags = [*args, "--train.resume", "true", "--train.standby_file", str(self.learner_standby_file)]
        self._service(STANDBY_LEARNER, module, *flags, env=env)

    def _promote_standby_learner(self, dead: ServiceHandle) -> bool:
        """Hand a dead learner's place to the standby learner; the next standby starts later."""
        ready = next((s for s in self.services if s.name == STANDBY_LEARNER and s.alive()), None)
        path = self.learner_standby_file
        if ready is None or path is None or not standby.is_ready(path):
            return False
        standby.hand_over(path, standby.Takeover("learner"))
        self.console.print(f"[yellow]{STANDBY_LEARNER} takes the place of the learner")
        ready.name = "learner"  # what the report, the chaos tests and a later restart know it by
        self.services.remove(ready)
        self.services[self.services.index(dead)] = ready
        self.standby_learner_due = time.monotonic() + STANDBY_LEARNER_DELAY_S
        self._publish_pids()  # the promoted one's new name
        return True

    def _spare_generators(self) -> int:
        return self.cfg.launch.spare_generators

    def _planned_generators(self) -> int:
        cfg = self.cfg
        if not cfg.autoscale.enabled:
            return cfg.launch.generators
        return min(cfg.autoscale.max_generators, self.generator_cap or cfg.autoscale.max_generators)

    def _retire_generator(self, svc: ServiceHandle) -> None:
        """Scale-down: SIGTERM, so it drains (finishes or gives back its leases) before it exits.
        Not waited for here: the loop goes on restarting what dies meanwhile, and reaps it (or
        kills it past its drain, ``_reap_retired``); a stop meanwhile stops it with the rest."""
        self.services.remove(svc)  # leaving on purpose is not a failure
        svc.terminate()
        self.retiring.append((svc, time.monotonic() + self.cfg.generator.drain_timeout_s + 15))

    def _reap_retired(self) -> None:
        now = time.monotonic()
        for svc, due in list(self.retiring):
            if not svc.alive() or now > due:
                svc.stop(timeout_s=0)  # (gone: nothing; past its drain: SIGKILL to its group)
                self.retiring.remove((svc, due))

    def _autoscaler(self) -> Autoscaler:
        a = self.cfg.autoscale
        if self.gpu_plan and self.generator_cap is not None:  # (the plan sets the cap)
            a = a.model_copy(update={"max_generators": min(a.max_generators, self.generator_cap)})
        backend: CommandBackend | ServiceBackend
        if a.backend == "command":
            assert a.command is not None
            # the deployment's own count, as far as the hub knows it: starting from
            # launch.generators, the first "grow" to 2 stopped generators of a fleet of 4
            # (those still loading are not registered yet: launch.generators says how many it has;
            # more registered later are taken as they come, CommandBackend.observe)
            running = self._hub_metrics().get("generators")
            start = max(int(running or 0), self.cfg.launch.generators)
            backend = CommandBackend(a.command, start=start)
        else:
            backend = ServiceBackend(self._start_generator, self._retire_generator, self.generators)
        self.console.print(f"autoscale: {a.min_generators}..{a.max_generators} generators ({a.backend})")
        return Autoscaler(a, backend, self._hub_metrics, self.cfg.async_.groups_per_step)

    def _wait_generators(self, n: int) -> None:
        if not self.hub_ports.get("metrics_port") or n == 0:
            return
        self.console.print(f"waiting for {n} generator(s) to load the model and register ...")
        deadline = time.monotonic() + self.cfg.launch.ready_timeout_s
        # registered with this hub: a resumed run's hub recovers the last run's generators from
        # Redis, and counts them until they time out, while the new ones still load
        while min((m := self._hub_metrics()).get("generators", 0), m.get("generator_registrations", 0)) < n:
            self._check_alive()
            if time.monotonic() > deadline:
                gen = next(s for s in self.services if s.name.startswith("generator"))
                raise ServiceFailed(gen, f"did not register within {self.cfg.launch.ready_timeout_s:g}s")
            time.sleep(0.5)
        self.console.print(f"{n} generator(s) registered ({time.monotonic() - self.started:.0f}s since start)")

    def _check_alive(self) -> ServiceHandle | None:
        """Restart (or raise for) a service that died; return the learner once it finished cleanly."""
        self._reap_retired()
        code = self._redis_died()
        if code is not None and self._backed_off("redis", "redis-server", code):  # first: everything needs it
            if not self.cfg.launch.restart or not self._may_restart("redis"):
                raise RedisFailed(f"redis-server exited with code {code}; see {self.run_dir / 'redis'}")
            self._note_restart("redis")
            self.console.print(f"[yellow]redis exited with code {code}: restart {self.restarts['redis']}")
            try:
                self._restart_redis()
            except (RuntimeError, TimeoutError) as err:  # tried again at the next check, while restarts last
                self.console.print(f"[yellow]redis did not come back: {err}")
                return None
            self._publish_pids()
        if self.standby_learner_due is not None and time.monotonic() >= self.standby_learner_due:
            self.standby_learner_due = None
            self._start_standby_learner()
        for svc in list(self.services):
            if svc.alive() or svc.name in ("sft", "eval_start", "eval_end"):
                continue
            if svc.name == "learner" and svc.returncode == 0:
                return svc
            self._restart(svc)
        return None

    def _may_restart(self, key: str) -> bool:
        """Fewer than ``launch.max_restarts`` restarts of ``key`` within ``launch.restart_window_s``."""
        la = self.cfg.launch
        recent = self.restart_times[key]
        while recent and time.monotonic() - recent[0] > la.restart_window_s:
            recent.popleft()
        return len(recent) < la.max_restarts

    def _backed_off(self, key: str, name: str, code: int | None) -> bool:
        """Whether ``key``'s back-off is over. A service that crashes within ``STABLE_UPTIME_S`` of
        its last restart waits ``launch.restart_backoff_s`` first, doubled for each such crash in a
        row (one failing at start-up spent its restarts within seconds, before whatever it needed
        had a chance to come back); one that ran longer, or its first crash, restarts at once."""
        now = time.monotonic()
        due = self.restart_due.get(key)
        if due is None:
            recent = self.restart_times[key]
            backoff = self.cfg.launch.restart_backoff_s
            if not recent or now - recent[-1] >= STABLE_UPTIME_S or backoff == 0:
                self.quick_crashes[key] = 0
                return True
            self.quick_crashes[key] += 1
            delay = min(backoff * 2 ** (self.quick_crashes[key] - 1), MAX_RESTART_BACKOFF_S)
            self.restart_due[key] = due = now + delay
            self.console.print(
                f"[yellow]{name} exited with code {code} again, soon after its restart: restart in {delay:g}s"
            )
        if now < due:
            return False
        del self.restart_due[key]
        return True

    def _note_restart(self, key: str) -> None:
        self.restarts[key] += 1  # all of the run's (reported); restart_times holds the recent ones
        self.restart_times[key].append(time.monotonic())

    def _restart(self, svc: ServiceHandle) -> None:
        code, la = exit_code(svc), self.cfg.launch
        if not la.restart or code == 2:  # 2: a bad configuration, which a restart cannot fix
            raise ServiceFailed(svc, f"exited with code {code}")
        key = "spares" if svc in self.spares else svc.name  # a dead spare's successor has a new name
        if not self._may_restart(key):
            raise ServiceFailed(
                svc, f"exited with code {code} after {la.max_restarts} restarts within {la.restart_window_s:g}s"
            )
        svc.stop(timeout_s=5)  # whatever of its process group is left (vLLM's engine core) goes too
        # a loaded spare or standby takes the place at once; a restart in place backs off
        taken_over = (svc.name.startswith("generator") and self._promote_spare(svc)) or (
            svc.name == "learner" and self._promote_standby_learner(svc)
        )
        if not taken_over and not self._backed_off(key, svc.name, code):
            return  # looked at again at the next check
        self._note_restart(key)
        self.console.print(f"[yellow]{svc.name} exited with code {code}: restart {self.restarts[key]}")
        if taken_over:
            return
        if svc.name == STANDBY_LEARNER:
            self.services.remove(svc)
            self._start_standby_learner()
            return
        self.services.remove(svc)
        if svc in self.spares:  # a fresh spare (new name, no ready mark) on the GPUs the dead one held
            self.spares.remove(svc)
            self._start_spare(self.gpu_plan.get(svc.name))
            return
        module, args, env = self.recipes[svc.name]
        if svc.name == "learner" and "--train.resume" not in args:
            args = [*args, "--train.resume", "true"]
        new = self._service(svc.name, module, *args, env=env)
        if svc in self.generators:  # the autoscaler's list
            self.generators[self.generators.index(svc)] = new

    # ------------------------------------------------------------------ watching

    def _watch(self) -> None:
        if "learner" not in self.cfg.launch.services:
            self.console.print("no learner started: watching until Ctrl-C")
        metrics_file = self.run_dir / "learner_metrics.jsonl"
        last: dict[str, Any] = {}
        live = Live(self._table(last), console=self.console, refresh_per_second=2, transient=False)
        if self.cfg.launch.display and self.console.is_terminal:
            live.start()
        last_line = 0.0
        try:
            while True:
                if self._check_alive() is not None:
                    break
                last = self._read_last(metrics_file) or last
                self._sample()
                if self.autoscaler is not None:
                    self.autoscaler.tick()
                if live.is_started:
                    live.update(self._table(last))
                elif time.monotonic() - last_line > 5:
                    last_line = time.monotonic()
                    self.console.print(self._line(last))
                time.sleep(0.5)
        finally:
            if live.is_started:
                live.update(self._table(last))
                live.stop()

    @staticmethod
    def _read_last(path: Path) -> dict[str, Any] | None:
        if not path.exists():
            return None
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 65536))
            lines = f.read().decode(errors="replace").strip().splitlines()
        for line in reversed(lines):
            try:
                record: dict[str, Any] = json.loads(line)
                return record
            except ValueError:
                continue
        return None

    def _hub_metrics(self) -> dict[str, float]:
        port = self.hub_ports.get("metrics_port")
        if port:
            return hub_metrics(self._host("hub"), port)
        if "hub" not in self.cfg.launch.services and self.cfg.hub.metrics_port:
            # a hub this launcher did not start (compose, Kubernetes): where its generators find it
            host = urlparse(self.cfg.generator.hub_address).hostname or "127.0.0.1"
            return hub_metrics(host, self.cfg.hub.metrics_port)
        return {}

    def _sample(self) -> None:
        m = self._hub_metrics()
        if not m:
            return
        self._last_hub = m
        self.timeline.add(
            t=time.monotonic() - self.started,
            gen_tokens_per_s=m.get("ingest_tokens_per_s", 0.0),
            ready_groups=m.get("ready_groups", 0.0),
            learner_version=m.get("learner_version", 0.0),
            tokens_in=m.get("tokens_in", 0.0),
            active_leases=m.get("active_leases", 0.0),
            admission_blocked_s=m.get("admission_blocked_seconds", 0.0),
        )

    def _line(self, last: dict[str, Any]) -> str:
        hub = getattr(self, "_last_hub", {})
        return (
            f"step {last.get('step', 0)}/{self.cfg.train.total_steps} reward {last.get('reward/mean', 0):.3f} "
            f"staleness {last.get('batch/staleness_mean', 0):.2f} learner {last.get('perf/tokens_per_s', 0):.0f} tok/s "
            f"idle {last.get('perf/idle_frac', 0):.0%} | generators {hub.get('ingest_tokens_per_s', 0):.0f} tok/s, "
            f"ready {hub.get('ready_groups', 0):.0f} open {hub.get('open_groups', 0):.0f} "
            f"scoring {hub.get('scores_pending', 0):.0f}"
        )

    def _table(self, last: dict[str, Any]) -> Table:
        hub = getattr(self, "_last_hub", {})
        t = Table(title=f"flywheel run {self.cfg.run.name} — {time.monotonic() - self.started:.0f}s", show_header=False)
        t.add_column("what", style="bold")
        t.add_column("value")
        t.add_row("learner", f"step {last.get('step', 0)}/{self.cfg.train.total_steps} (version {last.get('step', 0)})")
        t.add_row("reward", f"{last.get('reward/mean', 0):.3f} ± {last.get('reward/std', 0):.3f}")
        t.add_row("staleness", f"mean {last.get('batch/staleness_mean', 0):.2f} (η = {self.cfg.async_.max_staleness})")
        t.add_row(
            "learner speed", f"{last.get('perf/tokens_per_s', 0):.0f} tok/s, idle {last.get('perf/idle_frac', 0):.0%}"
        )
        t.add_row(
            "generators",
            f"{hub.get('generators', 0):.0f} up, {hub.get('ingest_tokens_per_s', 0):.0f} tok/s into the hub",
        )
        t.add_row(
            "queues",
            f"ready {hub.get('ready_groups', 0):.0f} | open {hub.get('open_groups', 0):.0f} | "
            f"scoring {hub.get('scores_pending', 0):.0f} | dropped {hub.get('groups_dropped', 0):.0f}",
        )
        t.add_row("services", " ".join(f"{s.name}:{'up' if s.alive() else s.returncode}" for s in self.services))
        return t

    # ------------------------------------------------------------------ the end

    def _final_eval(self) -> None:
        """Evaluate the exported policy while the services stop (nothing needs them any more)."""
        final = self.run_dir / "final_model"
        if self.cfg.task.name != "none" and final.exists():
            self.eval_end = self._evaluate(str(final), "eval_end", meanwhile=lambda svc: self._stop_services(keep=svc))

    def _shutdown(self) -> None:
        # A second Ctrl-C (or SIGTERM) while stopping is answered, not raised: raised, it would cut
        # the stop short and leave the services not yet stopped, and Redis, running.
        def answer(*_: object) -> None:
            self.console.print("[yellow]already stopping: every service drains first")

        held = {}
        if threading.current_thread() is threading.main_thread():  # (only there can handlers change)
            held = {sig: signal.signal(sig, answer) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._stop_services()
            self._stop_redis()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)

    def _stop_services(self, keep: ServiceHandle | None = None) -> None:
        """In stages: the learner, then generators (they drain), then the reward service, the hub
        last: nothing is written to a stopped hub. The services of a stage stop together, each
        draining at once, so a stage takes as long as its slowest service, not their sum."""
        order = {"learner": 0, "spare": 1, "generator": 1, "reward": 2, "hub": 3}
        drain_s = {1: self.cfg.generator.drain_timeout_s + 15}  # a generator gives its leases back
        stages: dict[int, list[ServiceHandle]] = defaultdict(list)
        for svc in self.services:
            if svc is not keep:
                stages[order.get(svc.name.rstrip("0123456789"), 0)].append(svc)
        stages[order["generator"]] += [svc for svc, _ in self.retiring]  # scaled down, still draining
        self.retiring = []
        for stage in sorted(stages):
            for svc in stages[stage]:
                self._quietly(svc, svc.terminate)
            for svc in stages[stage]:
                self._quietly(svc, partial(svc.stop, timeout_s=drain_s.get(stage, 15)))
        self.services = [s for s in self.services if s is keep]

    def _quietly(self, svc: ServiceHandle, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception as err:  # one stuck service must not keep the others running
            self.console.print(f"[red]stopping {svc.name}: {err}")

    def _stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()

    def _report(self) -> None:
        from flywheel.report import write_report

        summary = write_report(
            self.run_dir,
            self.cfg,
            wall_s=time.monotonic() - self.started,
            timeline=self.timeline,
            eval_start=self.eval_start,
            eval_end=self.eval_end,
        )
        self.console.print(f"report: {self.run_dir / 'report'}")
        shown = {k: summary[k] for k in ("wall_s", "steps", "accuracy_start", "accuracy_end") if k in summary}
        self.console.print(json.dumps(shown))


def run(cfg: FlywheelConfig) -> int:
    launch: LocalLaunch
    if cfg.launch.launcher == "ray":
        from flywheel.ray_launch import RayLaunch

        launch = RayLaunch(cfg)
    else:
        launch = LocalLaunch(cfg)
    # The launcher's own decisions (the autoscaler's above all) are logged at INFO, which Python
    # leaves unshown unconfigured; through the launcher's console, so they print above its live
    # display instead of through it
    handler = RichHandler(console=launch.console, show_path=False, show_time=True)
    logging.basicConfig(
        level=getattr(logging, cfg.run.log_level), format="%(name)s: %(message)s", handlers=[handler], force=True
    )
    return launch.run()
