"""A simulated generator: speaks the real hub protocol, emits random tokens instead of running a
model. Used by the hub demo, the hub tests and ``bench/hub_throughput.py``.

Weight syncs are simulated by following the learner's version key in Redis (``--follow-redis``):
the real weight broadcast belongs to the learner and generator services.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from flywheel.wire import Chunk, Lease
from generators.hub_link import HubLink

log = logging.getLogger(__name__)

POOL = 1 << 16


def random_pools(rng: np.random.Generator, vocab: int = 512) -> tuple[bytes, bytes]:
    """POOL random token ids and log-probabilities, packed: chunks are slices of these."""
    tokens = rng.integers(0, vocab, size=POOL, dtype=np.int32).tobytes()
    return tokens, (-rng.exponential(1.0, size=POOL)).astype(np.float32).tobytes()


@dataclass
class SimSample:
    lease: Lease
    sample: int
    length: int  # tokens this sample will have
    emitted: int = 0
    seq: int = 0


class SimulatedGenerator:
    def __init__(
        self,
        link: HubLink,
        seed: int,
        min_len: int,
        max_len: int,
        chunk_min: int,
        chunk_max: int,
        tokens_per_s: float | None = None,
        vocab: int = 512,
        version_key: tuple[str, str] | None = None,
    ) -> None:
        self.link = link
        self.rng = np.random.default_rng(seed)
        self.min_len, self.max_len = min_len, max_len
        self.chunk_min, self.chunk_max = chunk_min, chunk_max
        self.tokens_per_s = tokens_per_s
        self.token_pool, self.logprob_pool = random_pools(self.rng, vocab)
        self._versions: dict[tuple[int, int], bytes] = {}
        self.active: dict[tuple[int, int], SimSample] = {}
        self.remaining: dict[int, int] = {}  # lease id -> unfinished samples
        self.tokens_sent = 0
        self._stop = False
        self._redis = None
        self._version_key = None
        if version_key is not None:
            import redis

            self._redis = redis.Redis.from_url(version_key[0], socket_timeout=5.0)
            self._version_key = version_key[1]
        self._last_version_check = 0.0
        self.stats_after_s = 0.0

    def stop(self) -> None:
        self._stop = True

    def run(self, max_seconds: float | None = None) -> None:
        self.link.register(self._read_version())
        start = time.monotonic()
        warm = False
        while not self._stop and (max_seconds is None or time.monotonic() - start < max_seconds):
            if not warm and time.monotonic() - start >= self.stats_after_s:
                warm = True
                self.link.ack_latency.reset()  # what the warm-up saw is not measured
            # Wait on the socket, never in a sleep: acks and leases are read the moment they land.
            wait_s = self._pace_delay(start) if self.active and not self.link.window_full() else 0.005
            inbox = self.link.poll(int(wait_s * 1000))
            for lease in inbox.leases:
                self._start(lease)
            for lease_id in inbox.revoked:
                self._drop(lease_id)
            if self.active and not self.link.window_full() and self._pace_delay(start) == 0:
                self._step()
            self.link.resend_due()
            self._follow_version()
            self.link.heartbeat()
        if self._stop:
            self.drain()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Stopping, as the real generator does: take no more leases, finish what is held (and
        get it acknowledged) within ``timeout_s``, give the rest back. No lease is lost."""
        self.link.drain()
        deadline = time.monotonic() + timeout_s
        while (self.active or self.link.unacked) and time.monotonic() < deadline:
            inbox = self.link.poll(5)
            for lease in inbox.leases:  # sent before the hub saw the drain: finish those too
                self._start(lease)
            for lease_id in inbox.revoked:
                self._drop(lease_id)
            if self.active and not self.link.window_full():
                self._step()
            self.link.resend_due()
            self.link.heartbeat()
        self.link.release(sorted(self.link.lease_ids))

    def write_stats(self, path: str) -> None:
        import json

        lat = np.asarray(self.link.ack_latency.values) * 1000

        def pct(q: float) -> float | None:
            return float(np.percentile(lat, q)) if len(lat) else None

        stats = {
            "tokens_sent": self.tokens_sent,
            "chunks_acked": self.link.ack_latency.count,
            "resent": self.link.resent,
            "ack_ms_p50": pct(50),
            "ack_ms_p99": pct(99),
            "ack_ms_max": float(lat.max()) if len(lat) else None,
        }
        with open(path, "w") as f:
            json.dump(stats, f)

    def _start(self, lease: Lease) -> None:
        cap = lease.sampling.max_tokens
        for s in lease.samples:
            length = min(int(self.rng.integers(self.min_len, self.max_len + 1)), cap)
            self.active[(lease.lease_id, s)] = SimSample(lease, s, length)
        self.remaining[lease.lease_id] = len(lease.samples)

    def _drop(self, lease_id: int) -> None:
        for key in [k for k in self.active if k[0] == lease_id]:
            del self.active[key]
        self.remaining.pop(lease_id, None)

    def _step(self) -> None:
        """Every active sample emits its next chunk; all go out in one batch."""
        chunks = []
        finished = []
        version = self.link.weight_version
        sizes = self.rng.integers(self.chunk_min, self.chunk_max + 1, size=len(self.active))
        offsets = self.rng.integers(0, POOL - self.chunk_max, size=len(self.active)) * 4
        for (key, s), size, off in zip(self.active.items(), sizes.tolist(), offsets.tolist(), strict=True):
            n = min(size, s.length - s.emitted)
            done = s.emitted + n >= s.length
            finish = None
            if done:
                finish = "length" if s.length >= s.lease.sampling.max_tokens else "stop"
            chunks.append(
                Chunk(
                    lease_id=s.lease.lease_id,
                    group_id=s.lease.group_id,
                    sample=s.sample,
                    seq=s.seq,
                    tokens=self.token_pool[off : off + 4 * n],
                    logprobs=self.logprob_pool[off : off + 4 * n],
                    versions=self._version_bytes(n, version),
                    finish_reason=finish,
                )
            )
            s.emitted += n
            s.seq += 1
            self.tokens_sent += n
            if done:
                finished.append(key)
        self.link.send_chunks(chunks)
        for key in finished:
            del self.active[key]
            self.remaining[key[0]] -= 1
            if self.remaining[key[0]] == 0:
                del self.remaining[key[0]]
                self.link.lease_done(key[0])

    def _version_bytes(self, n: int, version: int) -> bytes:
        b = self._versions.get((n, version))
        if b is None:
            if len(self._versions) > 4 * (self.chunk_max + 1):
                self._versions.clear()  # old versions are never asked for again
            b = self._versions[(n, version)] = np.full(n, version, dtype="<i4").tobytes()
        return b

    def _read_version(self) -> int:
        if self._redis is None:
            return self.link.weight_version
        assert self._version_key is not None
        return int(self._redis.get(self._version_key) or 0)

    def _follow_version(self) -> None:
        now = time.monotonic()
        if self._redis is not None and now - self._last_version_check >= 0.02:
            self._last_version_check = now
            self.link.set_weight_version(self._read_version())

    def _pace_delay(self, start: float) -> float:
        """Seconds until the next step is due at ``tokens_per_s`` (0: now, or unpaced)."""
        if not self.tokens_per_s:
            return 0.0
        return max(0.0, min(self.tokens_sent / self.tokens_per_s - (time.monotonic() - start), 0.05))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flywheel-simgen", description=__doc__)
    p.add_argument("--hub", required=True, help="hub generator address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--id", required=True, help="generator id")
    p.add_argument("--capacity", type=int, default=8, help="leases run at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--chunk-min", type=int, default=16)
    p.add_argument("--chunk-max", type=int, default=64)
    p.add_argument("--tokens-per-s", type=float, default=None, help="pace the output (default: as fast as possible)")
    p.add_argument(
        "--follow-redis",
        default=None,
        help="redis URL (redis://user:pass@... with AUTH): follow the learner version (simulated weight sync)",
    )
    p.add_argument("--run", default="flywheel", help="run name (for --follow-redis)")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--keys-dir", default=None, help="CURVE keys (`flywheel keys DIR`) of a hub with security.curve")
    p.add_argument("--stats-file", default=None, help="write tokens sent and chunk-to-durable latencies here at exit")
    p.add_argument(
        "--stats-after", type=float, default=0.0, help="only count latencies after this many seconds (warm-up)"
    )
    args = p.parse_args(argv)
    from flywheel.config import SecurityConfig
    from flywheel.logs import setup_logging
    from flywheel.store import RunKeys

    setup_logging(f"simgen-{args.id}")
    security = SecurityConfig(curve=True, keys_dir=args.keys_dir) if args.keys_dir else None
    link = HubLink(args.hub, args.id, "simulated", args.capacity, security=security)
    version_key = (args.follow_redis, RunKeys(args.run).version) if args.follow_redis else None
    gen = SimulatedGenerator(
        link,
        args.seed,
        args.min_len,
        args.max_len,
        args.chunk_min,
        args.chunk_max,
        args.tokens_per_s,
        version_key=version_key,
    )
    gen.stats_after_s = args.stats_after
    signal.signal(signal.SIGTERM, lambda *_: gen.stop())
    signal.signal(signal.SIGINT, lambda *_: gen.stop())
    gen.run(args.seconds)
    link.close()
    if args.stats_file:
        gen.write_stats(args.stats_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
