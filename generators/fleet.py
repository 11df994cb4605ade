"""A simulated generator fleet: many engines in one process, each a real hub peer (its own
``HubLink``: register, leases, chunks, acks, heartbeats), decoding on a clock instead of a model.
``bench/async_vs_sync.py`` runs 8 to 512 of them against the real hub to measure the async loop at a
fleet size this machine could never hold as vLLM engines.

The engine model (what the clock stands for):
- a decode step gives every running sequence one token and lasts ``t0 + t1 * b`` seconds with
  ``b`` sequences running: a real engine's memory-bound regime, where a fuller batch is slower
  per step but faster in tokens per second;
- response lengths are long-tailed, reasoning-style: lognormal with median ``median_len`` and
  shape ``sigma`` (at sigma 1, about 1% of responses are 10x the median), capped by the lease's
  ``max_tokens``;
- a new learner version pauses the engine for ``update_s`` (the weight update); its running
  sequences then go on under the new version (partial rollouts are kept, as ``keep`` does).

    python -m generators.fleet --hub tcp://127.0.0.1:5555 --redis redis://... --run NAME \
        --engines 64 --first 0 --capacity 4 --stats-file fleet0.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flywheel.files import write_atomically
from flywheel.wire import Chunk, Lease
from generators.hub_link import HubLink
from generators.simulated import POOL, random_pools


@dataclass(frozen=True)
class EngineModel:
    t0: float = 0.010  # seconds of a decode step with nothing running...
    t1: float = 0.0  # ...plus this much per running sequence
    median_len: int = 16
    sigma: float = 1.0
    update_s: float = 0.02  # a weight update's pause
    flush_s: float = 0.25  # every running sequence sends its new tokens this often

    def step_s(self, running: int) -> float:
        return self.t0 + self.t1 * running


@dataclass
class Running:
    lease: Lease
    sample: int
    length: int
    start: float  # the engine's step clock when it started
    sent: int = 0  # tokens already sent
    seq: int = 0


@dataclass
class EngineStats:
    tokens: int = 0
    busy_seq_s: float = 0.0  # sequence-seconds decoding
    paused_s: float = 0.0
    updates: int = 0
    acked: int = 0  # chunks the hub acknowledged (durable in Redis)
    acked_tokens: int = 0


@dataclass
class SimEngine:
    link: HubLink
    model: EngineModel
    rng: np.random.Generator
    pools: tuple[bytes, bytes]
    clock: float = 0.0  # decode steps taken
    running: dict[tuple[int, int], Running] = field(default_factory=dict)
    ends: list[tuple[float, int, int]] = field(default_factory=list)  # heap of (clock at end, lease, sample)
    left: dict[int, int] = field(default_factory=dict)  # lease id -> samples not finished
    paused_until: float = 0.0
    pending_version: int | None = None
    next_flush: float = 0.0
    stats: EngineStats = field(default_factory=EngineStats)
    # when auditing (bench/load.py): (group, sample, lease) -> [tokens, seq, seq, ...] acknowledged,
    # shared by the engines of a process
    audit: dict[tuple[int, int, int], list[int]] | None = None

    def tick(self, now: float, dt: float, version: int) -> None:
        inbox = self.link.poll(0)
        self._note_acks(inbox.acked_chunks)
        for lease in inbox.leases:
            self._start(lease)
        for lease_id in inbox.revoked:
            self._drop(lease_id)
        self._follow(now, version)
        paused = now < self.paused_until
        if paused:
            self.stats.paused_s += dt
        elif self.running and not self.link.window_full():
            self.stats.busy_seq_s += dt * len(self.running)
            self.clock += dt / self.model.step_s(len(self.running))
            self._finish_due()
            if now >= self.next_flush:
                self.next_flush = now + self.model.flush_s
                self._flush()
        self.link.resend_due()
        self.link.heartbeat()

    def take_acks(self) -> None:
        """Count the acks already delivered, and nothing else (the fleet is stopping)."""
        self._note_acks(self.link.poll(0).acked_chunks)

    def _note_acks(self, chunks: list[Chunk]) -> None:
        self.stats.acked += len(chunks)
        for c in chunks:
            n = len(c.tokens) >> 2
            self.stats.acked_tokens += n
            if self.audit is not None:
                entry = self.audit.setdefault((c.group_id, c.sample, c.lease_id), [0])
                entry[0] += n
                entry.append(c.seq)

    def _follow(self, now: float, version: int) -> None:
        """A new learner version: send what the old weights made, pause for the update, then
        label what follows with the new version."""
        if self.pending_version is None and version > self.link.weight_version:
            self._flush()
            self.pending_version, self.paused_until = version, now + self.model.update_s
            self.stats.updates += 1
        if self.pending_version is not None and now >= self.paused_until:
            self.link.set_weight_version(self.pending_version)
            self.pending_version = None

    def _start(self, lease: Lease) -> None:
        m = self.model
        lengths = np.exp(math.log(m.median_len) + m.sigma * self.rng.standard_normal(len(lease.samples)))
        for s, raw in zip(lease.samples, lengths.tolist(), strict=True):
            length = max(1, min(int(raw), lease.sampling.max_tokens))
            self.running[(lease.lease_id, s)] = Running(lease, s, length, self.clock)
            heapq.heappush(self.ends, (self.clock + length, lease.lease_id, s))
        self.left[lease.lease_id] = len(lease.samples)

    def _drop(self, lease_id: int) -> None:
        for key in [k for k in self.running if k[0] == lease_id]:
            del self.running[key]
        self.left.pop(lease_id, None)  # its heap entries are skipped when they come up

    def _finish_due(self) -> None:
        finished: list[Chunk] = []
        while self.ends and self.ends[0][0] <= self.clock:
            _, lease_id, sample = heapq.heappop(self.ends)
            r = self.running.pop((lease_id, sample), None)
            if r is None:
                continue  # revoked
            finished.append(self._chunk(r, r.length, "length" if r.length >= r.lease.sampling.max_tokens else "stop"))
            self.left[lease_id] -= 1
        self.link.send_chunks(finished)
        for c in finished:
            if self.left.get(c.lease_id) == 0:
                del self.left[c.lease_id]
                self.link.lease_done(c.lease_id)

    def _flush(self) -> None:
        chunks = []
        for r in self.running.values():
            upto = min(int(self.clock - r.start), r.length - 1)  # the last token goes with the finish
            if upto > r.sent:
                chunks.append(self._chunk(r, upto, None))
        self.link.send_chunks(chunks)

    def _chunk(self, r: Running, upto: int, finish: str | None) -> Chunk:
        n = upto - r.sent
        off = int(self.rng.integers(0, POOL - n)) * 4 if n < POOL else 0
        tokens, logprobs = self.pools
        chunk = Chunk(
            lease_id=r.lease.lease_id,
            group_id=r.lease.group_id,
            sample=r.sample,
            seq=r.seq,
            tokens=tokens[off : off + 4 * n],
            logprobs=logprobs[off : off + 4 * n],
            versions=np.full(n, self.link.weight_version, dtype="<i4").tobytes(),
            finish_reason=finish,
        )
        r.sent, r.seq = upto, r.seq + 1
        self.stats.tokens += n
        return chunk


def run_fleet(
    engines: list[SimEngine],
    read_version: Callable[[], int],
    tick_s: float,
    should_stop: Callable[[], bool],
    on_second: Callable[[], None] | None = None,
) -> None:
    """One loop drives every engine of this process: each tick reads the learner's version once
    and advances each engine by the time that passed."""
    version = read_version()
    for e in engines:
        e.link.register(version)
    last = time.monotonic()
    next_second = last + 1.0
    while not should_stop():
        now = time.monotonic()
        dt, last = now - last, now
        version = read_version()
        for e in engines:
            e.tick(now, dt, version)
        if on_second is not None and now >= next_second:
            next_second = now + 1.0
            on_second()
        time.sleep(max(0.0, tick_s - (time.monotonic() - now)))


def fleet_stats(engines: list[SimEngine]) -> dict[str, float]:
    return {
        "time": time.time(),
        "engines": len(engines),
        "tokens": sum(e.stats.tokens for e in engines),
        "busy_seq_s": sum(e.stats.busy_seq_s for e in engines),
        "paused_s": sum(e.stats.paused_s for e in engines),
        "updates": sum(e.stats.updates for e in engines),
        "resent": sum(e.link.resent for e in engines),
        "acked": sum(e.stats.acked for e in engines),
        "acked_tokens": sum(e.stats.acked_tokens for e in engines),
        "unacked": sum(len(e.link.unacked) for e in engines),
    }


def write_audit(path: str, engines: list[SimEngine], latency_samples: int = 20_000) -> None:
    """Every chunk acknowledged, as rows [group, sample, lease, tokens, [seqs]], and an evenly
    strided sample of the engines' ack latencies (send -> ack, seconds)."""
    audit = engines[0].audit if engines else None
    rows = [[g, s, lease, e[0], e[1:]] for (g, s, lease), e in (audit or {}).items()]
    lat = np.concatenate([np.asarray(e.link.ack_latency.values) for e in engines]) if engines else np.zeros(0)
    lat = lat[:: max(1, len(lat) // latency_samples)]
    write_atomically(path, json.dumps({"acked": rows, "ack_latency_s": lat.tolist()}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="generators.fleet", description=__doc__)
    p.add_argument("--hub", required=True, help="hub generator address")
    p.add_argument("--redis", required=True, help="redis URL (the learner's version; redis://user:pass@... with AUTH)")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--first", type=int, default=0, help="index of this process's first engine (its id)")
    p.add_argument("--capacity", type=int, default=4, help="leases per engine")
    p.add_argument("--t0", type=float, default=EngineModel.t0)
    p.add_argument("--t1", type=float, default=EngineModel.t1)
    p.add_argument("--median-len", type=int, default=EngineModel.median_len)
    p.add_argument("--sigma", type=float, default=EngineModel.sigma)
    p.add_argument("--update-s", type=float, default=EngineModel.update_s)
    p.add_argument("--flush-s", type=float, default=EngineModel.flush_s)
    p.add_argument("--tick-s", type=float, default=0.01)
    p.add_argument("--window", type=int, default=8192, help="unacknowledged chunks per engine before it stalls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats-file", default=None, help="cumulative figures, rewritten every second")
    p.add_argument("--audit-file", default=None, help="at exit: every chunk acknowledged, and ack latencies")
    p.add_argument("--keys-dir", default=None, help="CURVE keys (`flywheel keys DIR`) of a hub with security.curve")
    args = p.parse_args(argv)
    import redis

    from flywheel.config import SecurityConfig
    from flywheel.logs import setup_logging
    from flywheel.store import RunKeys

    setup_logging(f"fleet{args.first}")
    model = EngineModel(args.t0, args.t1, args.median_len, args.sigma, args.update_s, args.flush_s)
    rng = np.random.default_rng(args.seed)
    pools = random_pools(rng)
    audit: dict[tuple[int, int, int], list[int]] | None = {} if args.audit_file else None
    security = SecurityConfig(curve=True, keys_dir=args.keys_dir) if args.keys_dir else None
    engines = [
        SimEngine(
            HubLink(
                args.hub, f"sim{args.first + i}", "simulated", args.capacity, max_unacked=args.window, security=security
            ),
            model,
            np.random.default_rng([args.seed, args.first + i]),
            pools,
            next_flush=time.monotonic() + model.flush_s * i / args.engines,  # staggered flushes
            audit=audit,
        )
        for i in range(args.engines)
    ]
    client = redis.Redis.from_url(args.redis, socket_timeout=5.0)
    key = RunKeys(args.run).version
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def write_stats() -> None:
        if args.stats_file:
            write_atomically(args.stats_file, json.dumps(fleet_stats(engines)))

    run_fleet(engines, lambda: int(client.get(key) or 0), args.tick_s, lambda: stop, write_stats)
    drain_until = time.monotonic() + 0.5  # stopped producing: take the acks already on their way
    while time.monotonic() < drain_until:
        for e in engines:
            e.take_acks()
        time.sleep(0.05)
    write_stats()
    if args.audit_file:
        write_audit(args.audit_file, engines)
    for e in engines:
        e.link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
