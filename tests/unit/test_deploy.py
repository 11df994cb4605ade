"""deploy/: the compose file validates, and every Flywheel command in it parses (with --help)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
COMPOSE_GPU = ROOT / "deploy" / "docker-compose.gpu.yml"
ENV = ROOT / "deploy" / "flywheel.env"


def compose_command() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("neither `docker compose` nor `docker-compose` found: scripts/setup.sh installs it")


def compose_config(*more: Path) -> dict:
    cmd = compose_command()
    files = [arg for path in (COMPOSE, *more) for arg in ("-f", str(path))]
    out = subprocess.run([*cmd, "--env-file", str(ENV), *files, "config"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config: dict = yaml.safe_load(out.stdout)
    return config


def test_compose_file_validates_and_every_service_command_parses() -> None:
    services = compose_config()["services"]
    assert {"redis", "buffer", "reward", "generator", "learner"} <= set(services)
    assert services["redis"]["command"][:3] == ["redis-server", "--appendonly", "yes"]
    bin_dir = Path(sys.executable).parent
    checked = []
    for name, svc in services.items():
        if svc.get("image") != "flywheel:latest":
            continue
        argv = shlex.split(svc["command"]) if isinstance(svc["command"], str) else list(svc["command"])
        if argv[0] == "torchrun":  # torchrun ... -m MODULE args: the module's own parser
            i = argv.index("-m")
            argv = [sys.executable, "-m", argv[i + 1], *argv[i + 2 :]]
        else:
            argv = [str(bin_dir / argv[0]), *argv[1:]]
        out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "usage:" in out.stdout, (name, out.stdout[-500:], out.stderr[-2000:])
        for flag in (a for a in argv if a.startswith("--") and a != "--config"):
            assert flag[2:] in out.stdout, f"{name}: {flag} is not a config key"  # a typo would fail at run time
        checked.append(name)
    assert sorted(checked) == ["buffer", "generator", "learner", "reward"]
    # no GPU reservation here: Docker refuses to start a service whose device driver is missing
    assert not any("deploy" in svc for svc in services.values())


def test_the_gpu_override_gives_the_learner_and_the_generators_their_own_gpus() -> None:
    services = compose_config(COMPOSE_GPU)["services"]
    devices = {
        name: services[name]["deploy"]["resources"]["reservations"]["devices"][0] for name in ("learner", "generator")
    }
    assert devices["learner"]["device_ids"] == ["0"] and devices["generator"]["device_ids"] == ["1"]
    assert all(d["capabilities"] == ["gpu"] and d["driver"] == "nvidia" for d in devices.values())
    assert "flywheel-generator" in services["generator"]["command"]  # the base file's services, merged
    # `up --build` with the override built the CPU image: GPUs reserved, torch on the CPU
    flywheel = [name for name, svc in services.items() if svc.get("image") == "flywheel:latest"]
    assert {name: services[name]["build"]["args"]["TARGET"] for name in flywheel} == dict.fromkeys(flywheel, "gpu")
    # NCCL's shared memory needs more than Docker's 64 MB /dev/shm; replicas sharing a GPU need a share of it
    assert all(services[name]["shm_size"] for name in flywheel)
    assert "--generator.gpu_memory_utilization 0.85" in services["generator"]["command"]


def test_generators_get_the_time_to_drain_on_a_stop_or_scale_down() -> None:
    """Docker's default 10 s grace killed a draining generator mid-drain; and the autoscale hook
    the docs give must read the env file, or every replica it adds gets blank arguments."""
    from flywheel.config import AutoscaleConfig, GeneratorConfig

    grace = yaml.safe_load(COMPOSE.read_text())["services"]["generator"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > GeneratorConfig().drain_timeout_s
    hook = AutoscaleConfig.model_fields["command"].description
    readme = (ROOT / "README.md").read_text()
    for text in (hook or "", readme):
        for line in (ln for ln in text.splitlines() if "--scale generator={replicas}" in ln):
            assert "--env-file deploy/flywheel.env" in line, line
