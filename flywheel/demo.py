"""The hub demo: a private Redis, the hub, simulated generators, a reward worker and a consumer
standing in for the learner (it claims batches and bumps the version; it does not train).

It prints what flows: per step, the groups claimed, their tokens, rewards and staleness.
"""

from __future__ import annotations

import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flywheel.config import FlywheelConfig, load_config
from flywheel.hub_client import BatchClient
from flywheel.netsec import create_keys
from flywheel.procs import Service, wait_for_state_file
from flywheel.redis_server import RedisServer
from flywheel.staleness import StalenessPolicy
from flywheel.tiny import build_tokenizer, write_arithmetic_jsonl

console = Console()


def run_demo(overrides: list[str], steps: int = 12, generators: int = 3, train_s: float = 0.3) -> int:
    work = Path(tempfile.mkdtemp(prefix="flywheel-demo-"))
    console.print(f"[bold]Flywheel hub demo[/bold] — work dir {work}")
    tok = build_tokenizer(work / "tokenizer")
    data = write_arithmetic_jsonl(work / "prompts.jsonl", 512)
    redis_server = RedisServer(work / "redis")
    base = [
        "--redis.url",
        redis_server.url,
        "--data.path",
        str(data),
        "--data.tokenizer",
        str(tok),
        "--hub.generator_port",
        "0",
        "--hub.reward_port",
        "0",
        "--hub.metrics_port",
        "0",
        "--hub.state_file",
        str(work / "hub.json"),
        "--hub.stats_interval_s",
        "2",
        "--reward.functions",
        "length",
        "--rollout.max_tokens",
        "256",
        "--async.groups_per_step",
        "4",
        "--data.n_samples_per_prompt",
        "4",
    ]
    cfg = load_config(base + overrides)
    keys: list[str] = []  # the simulated generators' CURVE keys (security.curve)
    if cfg.security.curve:
        if cfg.security.keys_dir is None:
            overrides = [*overrides, "--security.keys_dir", str(create_keys(work / "keys"))]
            cfg = load_config(base + overrides)
        keys = ["--keys-dir", str(cfg.security.keys_dir)]
    services: list[Service] = []
    try:
        hub = Service("hub", "buffer", base + overrides, work)
        services.append(hub)
        ports = wait_for_state_file(work / "hub.json", hub)
        console.print(f"hub up: {ports}; Redis {redis_server.url} (AOF in {redis_server.dir})")
        for i in range(generators):
            services.append(
                Service(
                    f"simgen{i}",
                    "generators.simulated",
                    [
                        "--hub",
                        f"tcp://127.0.0.1:{ports['generator_port']}",
                        "--id",
                        f"sim{i}",
                        "--seed",
                        str(i),
                        "--capacity",
                        "4",
                        "--min-len",
                        "32",
                        "--max-len",
                        "256",
                        "--tokens-per-s",
                        "15000",
                        "--follow-redis",
                        redis_server.url,
                        "--run",
                        cfg.run.name,
                        *keys,
                    ],
                    work,
                )
            )
        services.append(
            Service(
                "reward",
                "reward_service",
                [*base, *overrides, "--reward.hub_address", f"tcp://127.0.0.1:{ports['reward_port']}"],
                work,
            )
        )
        _consume(cfg, redis_server, steps, train_s)
        _show_metrics(ports["metrics_port"])
    finally:
        for svc in reversed(services):
            svc.stop()
        redis_server.stop()
    console.print(f"logs: {work}/*.log")
    return 0


def _consume(cfg: FlywheelConfig, redis_server: RedisServer, steps: int, train_s: float) -> None:
    client = BatchClient(
        redis_server.client(), cfg.run.name, StalenessPolicy(cfg.async_.max_staleness, cfg.async_.groups_per_step)
    )
    table = Table(title=f"batches claimed (max_staleness η = {cfg.async_.max_staleness})")
    for col in (
        "learner v",
        "groups",
        "samples",
        "tokens",
        "mean reward",
        "staleness max/mean",
        "token versions",
        "dropped",
        "wait s",
    ):
        table.add_column(col, justify="right")
    start = time.monotonic()
    total_tokens = 0
    for version in range(steps):  # the learner's version is its step count
        batch = client.claim(cfg.async_.groups_per_step, version, timeout_s=60)
        samples = [s for g in batch.groups for s in g.samples]
        tokens = sum(len(s.tokens) for s in samples)
        total_tokens += tokens
        versions = sorted({int(v) for s in samples for v in set(s.versions.tolist())})
        table.add_row(
            str(version),
            str(len(batch.groups)),
            str(len(samples)),
            str(tokens),
            f"{sum(s.reward for s in samples) / len(samples):.3f}",
            f"{max(batch.staleness)} / {sum(batch.staleness) / len(batch.staleness):.1f}",
            ",".join(map(str, versions)),
            str(batch.dropped),
            f"{batch.wait_s:.2f}",
        )
        console.print(
            f"step {version}: v{version}, {len(batch.groups)} groups, {tokens} tokens, staleness {batch.staleness}"
        )
        time.sleep(train_s)  # stands in for an optimizer step
        client.set_version(version + 1)
        client.note_finished([g.group_id for g in batch.groups])
    console.print(table)
    elapsed = time.monotonic() - start
    console.print(
        f"{total_tokens} tokens in {elapsed:.1f}s; served staleness histogram {client.staleness_histogram()}; counters {client.counters()}"
    )


def _show_metrics(port: int | None) -> None:
    if port is None:
        return
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in body.splitlines() if ln.startswith("flywheel_hub_") and not ln.startswith("#")]
    console.print(f"[bold]/metrics[/bold] (port {port}), {len(lines)} series, e.g.:")
    for ln in lines[:12]:
        console.print("  " + ln)
