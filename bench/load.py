"""Load: 1000 simulated generators on one hub (``bench/results/load.json``).

Real redis-server (AOF on), the real hub and reward service as processes, 1000 simulated engines
(``generators/fleet.py``: each a real hub peer with its own socket, register, leases, chunk
batches, acks, heartbeats) spread over a few fleet processes, and a consumer that claims batches
on the learner's path (``BatchClient``) and publishes a new version after each. For a fixed time it
samples the hub's RSS and CPU and Redis's memory, then checks:

- memory stays bounded: the hub's and Redis's peaks stay under a bound computed from the run's
  marks (admission bound on groups in flight, the generators' unacknowledged-chunk window, the
  number of peers; ``memory_bounds``), and their slope over the second half is about 0;
- nothing acknowledged is lost: every chunk a fleet engine got acknowledged is in Redis or was
  consumed (each fleet writes what it got acked at exit; the consumer records what it read);
  no group is served twice;
- the hub keeps up: every generator registers, none is evicted for missed heartbeats; hub CPU,
  chunks/s, tokens/s and ack latency are reported.

The consumer claims with no staleness limit: a group dropped as too stale is a deliberate
discard, and would blur the count of what is lost. The hub's admission bound (η, groups_per_step)
still caps the groups in flight, which is what bounds memory.

    python bench/load.py            # 1000 generators, 3 minutes measured
    python bench/load.py --quick    # 1000 generators, about 40 s in all
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.simfleet import fleet_totals, hub_args, start_fleet, start_hub_and_reward, wait_registered  # noqa: E402
from flywheel.config import HubConfig  # noqa: E402
from flywheel.hub_client import BatchClient, BatchTimeout, hub_metrics  # noqa: E402
from flywheel.procs import Service, scratch_dir  # noqa: E402
from flywheel.redis_server import RedisServer  # noqa: E402
from flywheel.staleness import StalenessPolicy  # noqa: E402
from flywheel.store import LeaseRecord, RunKeys, SampleDone, chunks_by_sample, unpack  # noqa: E402
from flywheel.tiny import build_tokenizer, write_arithmetic_jsonl  # noqa: E402

MB = 1 << 20

# Upper estimates of one object's footprint (bytes), behind the memory bound. Not fitted to the
# run: each is about 1.5-2x what it measures in isolation (tracemalloc, len(encode(...))).
TOKEN_B = 12  # int32 token id + float32 log-probability + int32 version
CHUNK_OBJ_B = 512  # a decoded Chunk the hub holds until its sample completes (~340 B measured)
WIRE_CHUNK_B = 128  # msgpack framing of one chunk, beyond its token bytes (~105 B measured)
REDIS_CHUNK_B = 256  # one chunk in a group's hash: framing plus a hash field of its own (worst case)
GROUP_FIXED_B = 4096  # a group's meta, sample records, scores, lease record; in the hub or in Redis
# One connected generator at the hub: libzmq's per-connection batch buffers (8 KiB in, 8 KiB out),
# the message queues of its two pipes (a 256-message, 16 KiB chunk each, one spare), the session,
# and the hub's registry entry.
PEER_B = 96 << 10
QUEUED_MSG_B = (8 << 10) + 64  # a message in a ZMQ queue: its read buffer (at most 8 KiB) and its msg_t
ACK_B = 32  # one chunk's entry in a ChunkAck (16 B packed) and its share of the message
LEASE_B = 1 << 10  # a Lease message: the prompt's tokens (tens here) and the sampling parameters


@dataclass
class LoadConfig:
    generators: int = 1000
    fleet_procs: int = 4
    seconds: float = 180.0  # measured after every generator registered
    register_timeout_s: float = 120.0
    capacity: int = 1  # leases (groups) per generator
    samples_per_prompt: int = 4
    max_tokens: int = 160
    median_len: int = 16  # lognormal response lengths, sigma 1 (about 1% are 10x the median)
    t0: float = 0.25  # a decode step: each running sequence makes a token every t0 seconds
    flush_s: float = 1.0  # each running sequence sends its new tokens this often
    tick_s: float = 0.1  # each fleet process advances all its engines this often
    window: int = 64  # unacknowledged chunks per generator before it stalls (HubLink.max_unacked)
    hub_rcvhwm: int = 64  # the hub's receive high-water mark per peer (messages)
    max_staleness: int = 4  # η of the hub's admission bound
    groups_per_step: int = 256  # groups per consumer batch (and step of the admission bound)
    sample_s: float = 1.0
    stall_s: float = 5.0  # a third into the run the hub is frozen (SIGSTOP) this long; 0: never
    # The fleets are the load, not what is measured: at a lower priority, the CPU they need on a
    # small shared machine does not come out of the hub's share.
    fleet_nice: int = 10


class Consumer(threading.Thread):
    """The learner's claim loop without the training: claim a batch, publish version + 1."""

    def __init__(self, client: BatchClient, groups_per_step: int) -> None:
        super().__init__(name="consumer", daemon=True)
        self.client, self.groups_per_step = client, groups_per_step
        self.stop = threading.Event()
        self.tokens: dict[tuple[int, int], int] = {}  # (group, sample) -> tokens consumed
        self.groups: set[int] = set()
        self.served_twice = 0
        self.batches = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    batch = self.client.claim(self.groups_per_step, self.batches, timeout_s=0.5)
                except BatchTimeout:
                    continue
                for g in batch.groups:
                    self.served_twice += g.group_id in self.groups
                    self.groups.add(g.group_id)
                    for i, s in enumerate(g.samples):
                        self.tokens[(g.group_id, i)] = len(s.tokens)
                self.batches += 1
                self.client.set_version(self.batches)
                self.client.note_finished([g.group_id for g in batch.groups])  # as the learner: frees the prompts
        except BaseException as err:  # surfaces in the main loop
            self.error = err


def memory_bounds(
    cfg: LoadConfig, hub_base: float, redis_base: float, hub_turn_items: int, resent: int
) -> dict[str, Any]:
    """What the hub's RSS and Redis's used_memory can reach, term by term, from the run's marks.

    - Groups in flight: admission issues a group only while issued - dropped < (v + η + 1) · gps,
      and the consumer at version v has consumed v · gps, so at most (η + 1) · gps groups are open
      (in the hub's memory) or ready (in Redis) at once. Worst case per group: every sample at
      max_tokens, one token per chunk.
    - Receive queues: ZMQ queues at most hub.rcvhwm messages per peer (then TCP pushes back), and
      a queued message can hold its whole read buffer (8 KiB); their chunk payload is bounded by
      the generators' window (``window`` unacknowledged chunks each) plus the copies resent.
    - Send queues: the hub answers what a peer sent (one ack per chunk batch) and leases at most
      its capacity, so they hold at most window acks and capacity leases per peer.
    - Per peer: the connection's fixed buffers and the registry entry (hub.max_generators caps how
      many register).
    - One turn: the hub's MULTI/EXEC pipeline holds at most hub.max_turn_items encoded chunks.
    """
    g = (cfg.max_staleness + 1) * cfg.groups_per_step
    n, t, p = cfg.samples_per_prompt, cfg.max_tokens, cfg.generators
    peers = p + 1  # and the reward service
    wire_chunk = WIRE_CHUNK_B + t * TOKEN_B
    hub = {
        "base (idle hub, measured)": hub_base,
        f"peers: {peers} x {PEER_B >> 10} KiB": peers * PEER_B,
        f"open groups: {g} x {n} samples x {t} tokens (1 token/chunk)": g
        * (n * t * (TOKEN_B + CHUNK_OBJ_B + 4) + GROUP_FIXED_B),
        f"receive queues: {peers} peers x rcvhwm {cfg.hub_rcvhwm} x {QUEUED_MSG_B >> 10} KiB": peers
        * cfg.hub_rcvhwm
        * QUEUED_MSG_B,
        f"chunks queued: {p} x window {cfg.window} + {resent} resent": (p * cfg.window + resent) * wire_chunk,
        f"send queues: {p} x ({cfg.window} acks + {cfg.capacity} leases)": p
        * (cfg.window * ACK_B + cfg.capacity * LEASE_B),
        f"one turn: {hub_turn_items} chunks encoded": hub_turn_items * wire_chunk,
    }
    redis = {
        "base (empty, measured)": redis_base,
        f"groups open or ready: {g} x {n} samples x {t} tokens (1 token/chunk)": g * (n * t * (TOKEN_B + REDIS_CHUNK_B) + GROUP_FIXED_B),
        f"generator records: {p} x 256 B": p * 256,
        f"client buffers: one hub turn ({hub_turn_items} chunks) + one consumer read": hub_turn_items * wire_chunk
        + 4 * n * t * (TOKEN_B + REDIS_CHUNK_B),
    }  # fmt: skip
    # The consumed bitmap grows by one bit per group ever served (125 KB per million): the only
    # term that grows with the run's length rather than its marks; it is added at the end.
    return {"groups_in_flight_max": g, "hub_terms": hub, "redis_terms": redis}


def slope_per_min(rows: list[dict[str, float]], key: str) -> float:
    """Least-squares slope of ``key`` over the second half of ``rows``, in units per minute."""
    half = rows[len(rows) // 2 :]
    if len(half) < 3:
        return float("nan")
    t = np.array([r["t"] for r in half]) / 60
    y = np.array([r[key] for r in half])
    return float(np.polyfit(t, y, 1)[0])


def persisted_in_redis(
    client: Any, run: str
) -> tuple[dict[tuple[int, int], dict[int, tuple[int, int]]], dict[tuple[int, int], int]]:
    """Every chunk still in Redis, (group, sample) -> {seq: (lease, tokens)}; and the lease each
    sample is assigned to now (its lease record, or the one that completed it)."""
    keys = RunKeys(run)
    chunks_out: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    lease_of: dict[tuple[int, int], int] = {}
    for raw in client.hvals(keys.leases):
        rec = unpack(LeaseRecord, raw)
        for s in rec.samples:
            lease_of[(rec.group_id, s)] = max(lease_of.get((rec.group_id, s), -1), rec.lease_id)
    prefix = keys.group(0).removesuffix("0}")
    for key in client.scan_iter(match=prefix + "*", count=1000):
        gid = int(key.decode()[len(prefix) : -1])
        raw = client.hgetall(key)
        for s, chunks in chunks_by_sample(raw).items():
            chunks_out[(gid, s)] = {seq: (c.lease_id, len(c.tokens) >> 2) for seq, c in chunks.items()}
        for name, value in raw.items():
            if name.startswith(b"s:"):
                s = int(name[2:])
                lease_of[(gid, s)] = max(lease_of.get((gid, s), -1), unpack(SampleDone, value).lease_id)
    return chunks_out, lease_of


def audit(audit_files: list[Path], consumer: Consumer, client: Any, run: str) -> dict[str, Any]:
    """Every chunk acknowledged to a generator must be in Redis or consumed.

    Per (group, sample) only the latest lease's chunks count: a re-issued lease (its generator
    evicted) supersedes its earlier chunks (kept in Redis, ignored by readers); those are
    counted apart. A consumed
    sample is complete (the consumer assembled chunks 0..final), so its acknowledged tokens must
    not exceed what was consumed.
    """
    rows: list[list[Any]] = []
    latencies: list[float] = []
    for f in audit_files:
        data = json.loads(f.read_text())
        rows += data["acked"]
        latencies += data["ack_latency_s"]
    in_redis, lease_of = persisted_in_redis(client, run)
    latest: dict[tuple[int, int], int] = defaultdict(lambda: -1, lease_of)
    for gid, s, lease, _, _ in rows:
        latest[(gid, s)] = max(latest[(gid, s)], lease)
    for (gid, s), chunks in in_redis.items():
        for lease, _ in chunks.values():
            latest[(gid, s)] = max(latest[(gid, s)], lease)
    acked_chunks = lost_chunks = superseded = 0
    lost_examples: list[Any] = []
    by_sample: dict[tuple[int, int], int] = defaultdict(int)  # acked tokens of the latest lease
    for gid, s, lease, tokens, seqs in rows:
        acked_chunks += len(seqs)
        if lease < latest[(gid, s)]:
            superseded += len(seqs)
            continue
        by_sample[(gid, s)] += tokens
        if (gid, s) in consumer.tokens:
            continue  # checked on the sample's total below
        stored = in_redis.get((gid, s), {})
        missing = [q for q in seqs if stored.get(q, (None,))[0] != lease]
        lost_chunks += len(missing)
        if missing and len(lost_examples) < 5:
            lost_examples.append({"group": gid, "sample": s, "lease": lease, "missing_seqs": missing[:8]})
    for key, tokens in by_sample.items():
        consumed = consumer.tokens.get(key)
        if consumed is not None and tokens > consumed:
            lost_chunks += 1  # at least one
            if len(lost_examples) < 5:
                lost_examples.append({"group": key[0], "sample": key[1], "acked_tokens": tokens, "consumed": consumed})
    lat = np.asarray(latencies) * 1000
    return {
        "acked_chunks": acked_chunks,
        "acked_tokens": int(sum(r[3] for r in rows)),
        "acked_lost": lost_chunks,
        "superseded_by_reissue": superseded,
        "groups_consumed": len(consumer.groups),
        "groups_consumed_twice": consumer.served_twice,
        "tokens_consumed": int(sum(consumer.tokens.values())),
        "samples_in_redis": len(in_redis),
        "lost_examples": lost_examples,
        "ack_ms_p50": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "ack_ms_p99": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
    }


@dataclass
class Probes:
    """What the sampler reads: the hub and Redis processes, a Redis client, the hub's metrics."""

    hub: psutil.Process
    redis: psutil.Process
    client: Any
    metrics_port: int
    t0: float  # when the fleets started

    def sample(self) -> dict[str, float]:
        m = hub_metrics("127.0.0.1", self.metrics_port)
        keys = (
            *("generators", "chunks_in", "tokens_in", "open_groups", "ready_groups", "generators_evicted"),
            *("leases_reissued", "learner_version", "scores_pending", "active_leases", "duplicate_chunks"),
        )
        return {
            "t": time.monotonic() - self.t0,
            "hub_rss": self.hub.memory_info().rss,
            "hub_cpu_pct": self.hub.cpu_percent(None),
            "redis_used": self.client.info("memory")["used_memory"],
            "redis_rss": self.redis.memory_info().rss,
            **{k: m.get(k, float("nan")) for k in keys},
        }


def run_load(work: Path, cfg: LoadConfig, log: Any = print) -> dict[str, Any]:
    """One load run from a fresh Redis; every process it starts is stopped (by pid) before it returns."""
    run, t_start = "load", time.monotonic()
    tok = build_tokenizer(work / "tokenizer")
    data = write_arithmetic_jsonl(work / "prompts.jsonl", 2000)
    redis_server = RedisServer(work / "redis")
    services: list[Service] = []
    try:
        args = [
            *hub_args(run, redis_server.url, data, tok, work / "hub.json"),
            "--data.n_samples_per_prompt", str(cfg.samples_per_prompt),
            "--rollout.max_tokens", str(cfg.max_tokens),
            "--async.max_staleness", str(cfg.max_staleness),
            "--async.groups_per_step", str(cfg.groups_per_step),
            "--hub.stats_interval_s", "10",
            "--hub.rcvhwm", str(cfg.hub_rcvhwm),
        ]  # fmt: skip
        hub, ports = start_hub_and_reward(work, args, services)
        client = redis_server.client()
        time.sleep(2.0)  # the hub settles (imports done, metrics thread up)
        probes = Probes(
            psutil.Process(hub.pid), psutil.Process(redis_server.proc.pid), client, ports["metrics_port"], 0
        )
        base = {"hub": probes.hub.memory_info().rss, "redis": client.info("memory")["used_memory"]}
        log(f"hub and reward service up in {time.monotonic() - t_start:.1f} s")
        policy = StalenessPolicy(1 << 30, cfg.groups_per_step)  # no drops: see the module's doc
        consumer = Consumer(BatchClient(redis_server.client(), run, policy), cfg.groups_per_step)
        consumer.start()
        fleet = [
            "--hub", f"tcp://127.0.0.1:{ports['generator_port']}",
            "--redis", redis_server.url,
            "--run", run,
            "--capacity", str(cfg.capacity),
            "--t0", str(cfg.t0),
            "--median-len", str(cfg.median_len),
            "--flush-s", str(cfg.flush_s),
            "--tick-s", str(cfg.tick_s),
            "--window", str(cfg.window),
        ]  # fmt: skip
        probes.t0 = time.monotonic()
        stats_files, audit_files = start_fleet(
            work, "fleet", cfg.generators, cfg.fleet_procs, fleet, services, audit=True, nice=cfg.fleet_nice
        )
        register_s = wait_registered(ports["metrics_port"], cfg.generators, stats_files, cfg.register_timeout_s)
        log(f"{cfg.generators} generators registered in {register_s:.1f} s; measuring for {cfg.seconds:.0f} s")
        rows = measure(cfg, probes, services, consumer, log)
        fleet_live = fleet_totals(stats_files)
        final = stop_all_but_redis(services, consumer, ports["metrics_port"])
        counters = {k.decode(): int(v) for k, v in client.hgetall(RunKeys(run).counters).items()}
        checked = audit(audit_files, consumer, client, run)
    finally:
        for svc in reversed(services):
            svc.stop()
        redis_server.stop()
    fleet_end = fleet_totals(stats_files)
    bounds = memory_bounds(cfg, base["hub"], base["redis"], HubConfig().max_turn_items, int(fleet_end["resent"]))
    bounds["redis_terms"]["consumed bitmap: 1 bit per group issued"] = counters.get("groups_issued", 0) / 8
    return {
        "benchmark": "load",
        "headline": headline(cfg, rows, register_s, final, checked, bounds, fleet_end),
        "config": asdict(cfg),
        "audit": checked | {"fleet_acked_count": int(fleet_end["acked"]), "redis_counters": counters},
        "bounds": {k: ({n: v / MB for n, v in t.items()} if isinstance(t, dict) else t) for k, t in bounds.items()},
        "fleet": {"live": fleet_live, "end": fleet_end},
        "hub_final": final,
        "samples": [
            {k: (v / MB if k in ("hub_rss", "redis_used", "redis_rss") else v) for k, v in r.items()} for r in rows
        ],
    }


def measure(
    cfg: LoadConfig, probes: Probes, services: list[Service], consumer: Consumer, log: Any
) -> list[dict[str, float]]:
    """Sample every ``sample_s`` for ``seconds``, freezing the hub for ``stall_s`` a third of the way."""
    rows = [probes.sample()]
    measure0 = time.monotonic()
    stall_at = measure0 + cfg.seconds / 3 if cfg.stall_s > 0 else float("inf")
    while time.monotonic() - measure0 < cfg.seconds:
        time.sleep(cfg.sample_s)
        if time.monotonic() >= stall_at:
            stall_at = float("inf")
            log(f"freezing the hub for {cfg.stall_s:.0f} s (SIGSTOP), as a long GC pause or fsync would")
            probes.hub.suspend()
            try:
                time.sleep(cfg.stall_s)
            finally:
                probes.hub.resume()
        rows.append(probes.sample())
        if consumer.error is not None:
            raise consumer.error
        dead = [s.name for s in services if not s.alive()]
        if dead:
            raise RuntimeError(f"{dead} exited during the run")
    return rows


def stop_all_but_redis(services: list[Service], consumer: Consumer, metrics_port: int) -> dict[str, float]:
    """Stop the fleets (they write what they got acknowledged), then the consumer, then the hub and
    the reward service (before the hub would evict the now silent generators and re-issue their
    leases); return the hub's last metrics."""
    fleets = services[2:]
    for svc in fleets:
        svc.proc.send_signal(signal.SIGTERM)
    for svc in fleets:
        svc.stop(timeout_s=60)
    consumer.stop.set()
    consumer.join(timeout=60)
    if consumer.error is not None:
        raise consumer.error
    final = hub_metrics("127.0.0.1", metrics_port)
    for svc in reversed(services[:2]):
        svc.stop()
    return final


def headline(
    cfg: LoadConfig,
    rows: list[dict[str, float]],
    register_s: float,
    final: dict[str, float],
    checked: dict[str, Any],
    bounds: dict[str, Any],
    fleet_end: dict[str, float],
) -> dict[str, float]:
    first, last = rows[0], rows[-1]
    window = last["t"] - first["t"]
    cpu = np.array([r["hub_cpu_pct"] for r in rows[1:]])
    return {
        "generators": cfg.generators,
        "generators_registered": int(np.nanmax([r["generators"] for r in rows])),
        "register_s": register_s,
        "heartbeat_timeouts": int(final.get("generators_evicted", 0)),
        "leases_reissued": int(final.get("leases_reissued", 0)),
        "acked_chunks": checked["acked_chunks"],
        "acked_lost": checked["acked_lost"],
        "groups_consumed_twice": checked["groups_consumed_twice"],
        "hub_rss_peak_mb": max(r["hub_rss"] for r in rows) / MB,
        "hub_rss_bound_mb": sum(bounds["hub_terms"].values()) / MB,
        "hub_rss_slope_mb_per_min": slope_per_min(rows, "hub_rss") / MB,
        "redis_used_peak_mb": max(r["redis_used"] for r in rows) / MB,
        "redis_used_bound_mb": sum(bounds["redis_terms"].values()) / MB,
        "redis_used_slope_mb_per_min": slope_per_min(rows, "redis_used") / MB,
        "hub_cpu_mean_pct": float(cpu.mean()),
        "hub_cpu_p95_pct": float(np.percentile(cpu, 95)),
        "chunks_per_s": (last["chunks_in"] - first["chunks_in"]) / window,
        "tokens_per_s": (last["tokens_in"] - first["tokens_in"]) / window,
        "ack_ms_p50": checked["ack_ms_p50"],
        "ack_ms_p99": checked["ack_ms_p99"],
        "hub_turn_ms_p50": final.get("turn_durable_ms_p50", float("nan")),
        "hub_turn_ms_p99": final.get("turn_durable_ms_p99", float("nan")),
        "resent_chunks": int(fleet_end["resent"]),
        "hub_stall_s": cfg.stall_s,
    }


def print_report(result: dict[str, Any], console: Console) -> None:
    h = result["headline"]
    table = Table(title=f"Load: {h['generators']} simulated generators on one hub")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("check")

    def ok(good: bool) -> str:
        return "[green]ok[/green]" if good else "[red]FAIL[/red]"

    rows = [
        ("generators registered", f"{h['generators_registered']} (in {h['register_s']:.1f} s)", ok(h["generators_registered"] == h["generators"])),
        ("heartbeat timeouts (evictions)", f"{h['heartbeat_timeouts']}", ok(h["heartbeat_timeouts"] == 0)),
        ("hub RSS peak / bound", f"{h['hub_rss_peak_mb']:.0f} / {h['hub_rss_bound_mb']:.0f} MB", ok(h["hub_rss_peak_mb"] < h["hub_rss_bound_mb"])),
        ("hub RSS slope, 2nd half", f"{h['hub_rss_slope_mb_per_min']:+.2f} MB/min", ""),
        ("Redis used_memory peak / bound", f"{h['redis_used_peak_mb']:.0f} / {h['redis_used_bound_mb']:.0f} MB", ok(h["redis_used_peak_mb"] < h["redis_used_bound_mb"])),
        ("Redis used_memory slope, 2nd half", f"{h['redis_used_slope_mb_per_min']:+.2f} MB/min", ""),
        ("chunks acknowledged / lost", f"{h['acked_chunks']:,} / {h['acked_lost']}", ok(h["acked_lost"] == 0)),
        ("groups consumed / twice", f"{result['audit']['groups_consumed']:,} / {h['groups_consumed_twice']}", ok(h["groups_consumed_twice"] == 0)),
        ("hub CPU mean / p95 (% of a core)", f"{h['hub_cpu_mean_pct']:.0f} / {h['hub_cpu_p95_pct']:.0f}", ""),
        ("chunks/s, tokens/s into the hub", f"{h['chunks_per_s']:,.0f}, {h['tokens_per_s']:,.0f}", ""),
        ("ack latency p50 / p99 (at the generators)", f"{h['ack_ms_p50']:.0f} / {h['ack_ms_p99']:.0f} ms", ""),
        ("hub turn, receive to Redis write, p50 / p99", f"{h['hub_turn_ms_p50']:.1f} / {h['hub_turn_ms_p99']:.1f} ms", ""),
        ("chunks resent / leases re-issued", f"{h['resent_chunks']:,} / {h['leases_reissued']}", ""),
        ("hub frozen (SIGSTOP) mid-run", f"{h['hub_stall_s']:.0f} s", ""),
    ]  # fmt: skip
    for r in rows:
        table.add_row(*r)
    console.print(table)
    for side in ("hub_terms", "redis_terms"):
        bound = Table(title=f"{'hub RSS' if side == 'hub_terms' else 'Redis used_memory'} bound, term by term")
        bound.add_column("term")
        bound.add_column("MB", justify="right")
        for name, mb in result["bounds"][side].items():
            bound.add_row(name, f"{mb:.1f}")
        console.print(bound)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about 40 s in all (30 s measured)")
    p.add_argument("--generators", type=int, default=LoadConfig.generators)
    p.add_argument("--fleet-procs", type=int, default=LoadConfig.fleet_procs)
    p.add_argument("--seconds", type=float, default=LoadConfig.seconds, help="measured after registration")
    p.add_argument("--keep-work", action="store_true", help="keep the run's files (logs, Redis data)")
    p.add_argument("--out", default=None, help="(default bench/results/load.json; quick: load_quick.json)")
    args = p.parse_args()
    # a quick look never overwrites the recorded full run
    args.out = args.out or str(ROOT / "bench" / "results" / ("load_quick.json" if args.quick else "load.json"))
    cfg = LoadConfig(generators=args.generators, fleet_procs=args.fleet_procs, seconds=args.seconds)
    if args.quick:
        cfg.seconds = 30.0
    console = Console(width=120)
    with scratch_dir("flywheel-load-", args.keep_work) as work:
        result = run_load(work, cfg, console.print)
    result["machine"] = {"cpus": psutil.cpu_count(), "platform": platform.platform()}
    print_report(result, console)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
