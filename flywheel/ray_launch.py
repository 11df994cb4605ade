"""``flywheel run --launch.launcher ray``: the same services as Ray actors.

Each service is an actor that starts the service's process on the node Ray placed it on and
reports its state, so the launcher drives it exactly like a local process (``LocalLaunch``). One
placement group reserves every service's resources up front (GPUs for the generators and the
learner where the cluster has them, CPUs here), packed onto as few nodes as fit. On one node
everything binds 127.0.0.1; spread over several, services bind every interface and are reached
at their node's address. The run directory must then be on a filesystem every node shares (it
holds the model, the prompts and the logs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flywheel.config import FlywheelConfig
from flywheel.launcher import LocalLaunch, RedisFailed, ServiceFailed
from flywheel.netsec import redis_password
from flywheel.procs import Service, ServiceHandle, wait_for_state_file
from flywheel.redis_server import RedisServer

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
STATUS_WAIT_S = 0.5  # how long one look at a service's status waits for its actor


class ServiceRunner:
    """Runs one service process on this actor's node."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: str, env: dict[str, str]) -> None:
        self.svc = Service(name, module, args, Path(log_dir), env=env)

    def returncode(self) -> int | None:
        return self.svc.returncode

    def terminate(self) -> None:
        self.svc.terminate()

    def stop(self, timeout_s: float) -> int | None:
        self.svc.stop(timeout_s)
        return self.svc.returncode

    def tail(self, n: int) -> str:
        return self.svc.tail(n)

    def read_state(self, path: str, timeout_s: float) -> dict[str, int]:
        return wait_for_state_file(Path(path), self.svc, timeout_s)


_ServiceActor: Any = ray.remote(num_cpus=0)(ServiceRunner)


class RedisRunner:
    def __init__(
        self,
        data_dir: str,
        bind: str,
        appendfsync: str,
        aof_rewrite_min_mb: int,
        password: str | None,
        username: str | None,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self.server = RedisServer(
            data_dir,
            appendfsync=appendfsync,
            aof_rewrite_min_mb=aof_rewrite_min_mb,
            bind=bind,
            password=password,
            username=username,
            ready_timeout_s=ready_timeout_s,
        )

    def port(self) -> int:
        return self.server.port

    def returncode(self) -> int | None:
        return self.server.proc.poll()

    def restart(self, ready_timeout_s: float) -> None:
        self.server = self.server.restarted(ready_timeout_s)

    def stop(self) -> None:
        self.server.stop()


_RedisActor: Any = ray.remote(num_cpus=0)(RedisRunner)


class RayService:
    """The launcher's handle on a service actor (``procs.ServiceHandle``)."""

    def __init__(self, name: str, actor: Any, log_path: Path) -> None:
        self.name = name
        self.actor = actor
        self.log_path = log_path
        self._code: int | None = None
        self._gone = False
        # the last status call, while unanswered: an actor not placed yet (no free GPU for a
        # generator the autoscaler added) answers nothing, and a check that waited for it held
        # the launcher's loop (restarts, the display) CALL_TIMEOUT_S at every pass
        self._asked: tuple[Any, float] | None = None
        self._said_slow = False

    @property
    def returncode(self) -> int | None:
        if self._code is None and not self._gone:
            if self._asked is None:
                self._asked = (self.actor.returncode.remote(), time.monotonic())
            ref, since = self._asked
            ready, _ = ray.wait([ref], timeout=STATUS_WAIT_S)
            if not ready:  # busy or not placed yet: no sign of an exit
                if time.monotonic() - since > CALL_TIMEOUT_S and not self._said_slow:
                    self._said_slow = True
                    log.warning(
                        "the actor of %s has not answered for %.0fs: taken as running", self.name, CALL_TIMEOUT_S
                    )
                return None
            self._asked, self._said_slow = None, False
            try:
                self._code = ray.get(ref)
            except ray.exceptions.RayActorError:  # the actor (its node) died: so did the service
                self._code, self._gone = -9, True
        return self._code

    def alive(self) -> bool:
        return not self._gone and self.returncode is None  # (stopped: gone, whatever its code)

    def terminate(self) -> None:
        if not self._gone:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(self.actor.terminate.remote(), timeout=CALL_TIMEOUT_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._gone:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._code = ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + CALL_TIMEOUT_S)
            ray.kill(self.actor)  # (killing the actor kills its service: it dies with its parent)
            self._gone = True

    def tail(self, n: int = 30) -> str:
        if not self._gone:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                text: str = ray.get(self.actor.tail.remote(n), timeout=CALL_TIMEOUT_S)
                return text
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class RayLaunch(LocalLaunch):
    def __init__(self, cfg: FlywheelConfig) -> None:
        super().__init__(cfg)
        la = cfg.launch
        if la.spare_generators:
            self.console.print("[yellow]launch.spare_generators applies to the local launcher; no spares on Ray")
        if la.standby_learner:
            self.console.print("[yellow]launch.standby_learner applies to the local launcher; none on Ray")
        if la.cpus:  # services run on Ray's nodes, where this machine's CPU numbers mean nothing
            self.console.print(
                "[yellow]launch.cpus applies to the local launcher; Ray places by launch.cpus_per_service"
            )
        self._own_ray = not ray.is_initialized() and la.ray_address is None
        if not ray.is_initialized():
            env = {"env_vars": {**self._env(), "TOKENIZERS_PARALLELISM": "false"}}
            if la.ray_address is None:  # a local Ray with room for every service's reservation
                # and for the generators the autoscaler may add outside the placement group (with
                # no room they stayed pending, and each check of one waited out CALL_TIMEOUT_S)
                fleet = max(la.generators, cfg.autoscale.max_generators if cfg.autoscale.enabled else 0)
                need = la.cpus_per_service * (3 + fleet)
                ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False, runtime_env=env)
            else:
                ray.init(address=la.ray_address, runtime_env=env)
        cpu = {"CPU": la.cpus_per_service} if la.cpus_per_service else {}
        roles = {"hub": dict(cpu), "reward": dict(cpu), "learner": {**cpu, "GPU": la.gpus_per_learner}}
        for i in range(la.generators):
            roles[f"generator{i}"] = {**cpu, "GPU": la.gpus_per_generator}
        self.roles = list(roles)
        bundles = [{k: v for k, v in r.items() if v} or {"CPU": 0.001} for r in roles.values()]
        self.pg = placement_group(bundles, strategy="PACK", name=f"flywheel-{cfg.run.name}")
        ray.get(self.pg.ready(), timeout=la.ready_timeout_s)
        self.gpus = {role: roles[role].get("GPU", 0) for role in roles}
        node_of = placement_group_table(self.pg)["bundles_to_node_id"]
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.node_ip = {role: address[node_of[i]] for i, role in enumerate(self.roles)}
        # Loopback only when every service runs on this very node: on a remote cluster whose one
        # worker holds them all, this launcher (which reads the hub's metrics, and hands out the
        # Redis URL) is elsewhere; and the autoscaler's generators land wherever Ray puts them.
        here = ray.get_runtime_context().get_node_id()
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        self.spread = set(node_of.values()) != {here} or (cfg.autoscale.enabled and alive > 1)
        self._say_unpinned_gpus()
        self.console.print(
            f"ray: placement group of {len(bundles)} bundles on {len(set(self.node_ip.values()))} node(s)"
        )
        if self.spread:  # the services then bind every interface (0.0.0.0), Redis included
            if not cfg.security.curve:
                self.console.print(
                    "[yellow]ray: services spread over nodes listen on every interface, and --security.curve is "
                    "off: anyone who reaches these nodes can talk to the hub and the weight sync"
                )
            if cfg.redis.password_file is None and "@" not in (cfg.redis.url or ""):
                self.console.print(
                    "[yellow]ray: Redis listens on every interface with no password: set --redis.password_file"
                )

    def _say_unpinned_gpus(self) -> None:
        """Ray gives an actor that asks for no GPU no CUDA_VISIBLE_DEVICES: it sees every GPU of its
        node, so a learner and generators reserving none all land on cuda:0 together."""
        gpus = ray.cluster_resources().get("GPU", 0)
        la = self.cfg.launch
        unpinned = [
            key
            for key, n in (("gpus_per_learner", la.gpus_per_learner), ("gpus_per_generator", la.gpus_per_generator))
            if not n
        ]
        if gpus and unpinned:
            self.console.print(
                f"[yellow]ray: the cluster has {gpus:g} GPUs but launch.{' and launch.'.join(unpinned)} is 0: those "
                "services reserve none and see every GPU of their node (all on cuda:0); set them (1 each, or more)"
            )

    def _spare_generators(self) -> int:
        return 0  # a spare waits for a file the launcher writes on its own machine

    def _start_standby_learner(self) -> None:
        return  # the same: its takeover is a file on the launcher's machine

    def _bundle(self, name: str) -> int:
        role = name if name in self.roles else "learner" if name in ("sft", "eval_start", "eval_end") else "hub"
        return self.roles.index(role)

    def _strategy(self, name: str) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self._bundle(name))

    def _start_redis(self) -> str:
        bind = "0.0.0.0" if self.spread else "127.0.0.1"
        self._redis_actor = _RedisActor.options(scheduling_strategy=self._strategy("hub")).remote(
            str(self.cfg.redis.dir or self.run_dir / "redis"),
            bind,
            self.cfg.redis.appendfsync,
            self.cfg.redis.aof_rewrite_min_mb,
            redis_password(self.cfg.redis),
            self.cfg.redis.username,
            self.cfg.launch.ready_timeout_s,  # a resumed run's AOF loads first
        )
        try:
            port = ray.get(self._redis_actor.port.remote(), timeout=self.cfg.launch.ready_timeout_s + CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as err:  # (its constructor's error, or none in time)
            raise RedisFailed(f"redis-server did not start on Ray: {err}") from err
        return f"redis://{self._host('hub')}:{port}/0"

    def _redis_died(self) -> int | None:
        actor = getattr(self, "_redis_actor", None)
        if actor is None:
            return None
        try:
            code: int | None = ray.get(actor.returncode.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:  # its node is gone, and the AOF with it
            return -9
        except ray.exceptions.GetTimeoutError:  # a slow answer is no death: asked again at the next check
            return None
        return code

    def _restart_redis(self) -> None:
        try:
            ray.get(
                self._redis_actor.restart.remote(self.cfg.launch.ready_timeout_s),
                timeout=self.cfg.launch.ready_timeout_s + CALL_TIMEOUT_S,
            )
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"the Redis actor is gone (its node?): {err}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"the Redis actor did not restart Redis: {err}") from err

    def _stop_redis(self) -> None:
        actor = getattr(self, "_redis_actor", None)
        if actor is not None:
            try:
                ray.get(actor.stop.remote(), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                # its node gone, or hung: the stop goes on to the report, not out as a traceback
                self.console.print(f"[yellow]ray: the Redis actor did not stop cleanly: {err}")
            ray.kill(actor)

    def _service(self, name: str, module: str, *args: str, env: dict[str, str] | None = None) -> ServiceHandle:
        la = self.cfg.launch
        actor_name = f"{self.cfg.run.name}-{name}-{time.time_ns()}"
        if name.startswith("generator") and name not in self.roles:  # added by the autoscaler
            options: dict[str, Any] = {"num_cpus": la.cpus_per_service, "num_gpus": la.gpus_per_generator}
            where = "a node Ray picks"
        else:  # a service reserves its bundle's share; the warm start and evaluations take the learner's
            # (they run while it does not): with none they saw every GPU of the node, a generator's too
            role = self.roles[self._bundle(name)]
            options = {"scheduling_strategy": self._strategy(name), "num_gpus": self.gpus[role]}
            where = self.node_ip[role]
        actor = _ServiceActor.options(name=actor_name, **options).remote(
            name, module, list(args), str(self.logs), {**self._env(), **(env or {})}
        )
        svc = RayService(name, actor, self.logs / f"{name}.log")
        self.services.append(svc)
        self._started(name, module, list(args), env)
        self.console.print(f"ray: {name} on {where}")
        return svc

    def _read_state(self, svc: ServiceHandle, path: Path) -> dict[str, int]:
        assert isinstance(svc, RayService)
        timeout = self.cfg.launch.ready_timeout_s
        try:
            state: dict[str, int] = ray.get(
                svc.actor.read_state.remote(str(path), timeout), timeout=timeout + CALL_TIMEOUT_S
            )
        except ray.exceptions.RayTaskError as err:  # it died before listening: said as the local launcher says it
            why = getattr(err, "cause", None) or err
            raise ServiceFailed(svc, f"exited with code {svc.returncode} before listening ({why})") from None
        return state

    def _host(self, role: str) -> str:
        return self.node_ip[role] if self.spread else "127.0.0.1"

    def _bind_host(self) -> str:
        return "0.0.0.0" if self.spread else "127.0.0.1"

    def _sync_ports(self) -> tuple[int, int]:
        if self.spread:  # the learner's node picks no port for us: use the configured ones
            return self.cfg.sync.announce_port, self.cfg.sync.join_port
        return super()._sync_ports()

    def _shutdown(self) -> None:
        try:
            super()._shutdown()
        finally:
            remove_placement_group(self.pg)
            if self._own_ray:
                ray.shutdown()
