"""Hub statistics: counters kept in memory, a periodic log line, and a Prometheus endpoint."""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)


@dataclass
class HubStats:
    chunks_in: int = 0
    tokens_in: int = 0
    duplicates: int = 0
    samples_completed: int = 0
    groups_ready: int = 0
    scores_in: int = 0
    score_resends: int = 0
    leases_issued: int = 0
    leases_reissued: int = 0
    leases_released: int = 0  # given back by generators (draining, weights behind)
    leases_resent: int = 0  # Lease messages sent again: their generator's heartbeats never listed them
    generators_evicted: int = 0
    registrations: int = 0
    reward_registrations: int = 0
    generators_departed: int = 0  # drained and gone (scale-down): not an eviction
    rejected: Counter[str] = field(default_factory=Counter)
    reward_errors: Counter[str] = field(default_factory=Counter)  # failed scores by reason (timeout, ...)
    groups_dropped_reward: int = 0  # dropped for a failed score (reward.on_error drop_group)
    prompts_abandoned: int = 0  # dropped as too stale async.max_requeues + 1 times: not issued again
    groups_dropped_generating: int = 0  # already too stale while generating (async.revoke_stale)
    admission_blocked_s: float = 0.0  # generators had free slots the staleness bound kept empty
    # seconds from the start of a turn that took chunks to its Redis write returning (recent turns),
    # how long of that the write itself took, and how many chunks the turn acknowledged: a slow
    # turn's cause (Redis, or the pile-up of frames behind the turn before it) reads off these
    durable_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    write_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    chunks_per_turn: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))

    # the cyclic garbage collector's pauses (recent ones): a pause stalls every turn behind it
    gc_pauses_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    gc_collections: int = 0
    _gc_started: float = 0.0

    def note_durable(self, seconds: float, write_seconds: float, chunks: int) -> None:
        self.durable_s.append(seconds)
        self.write_s.append(write_seconds)
        self.chunks_per_turn.append(chunks)

    def watch_gc(self) -> None:
        """Time every collection of the cyclic GC (``gc.callbacks``)."""
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_collections += 1
            self.gc_pauses_s.append(time.perf_counter() - self._gc_started)

    def gc_pause_ms(self, q: float) -> float:
        return _percentile(self.gc_pauses_s, q) * 1000

    def durable_ms(self, q: float) -> float:
        return _percentile(self.durable_s, q) * 1000

    def write_ms(self, q: float) -> float:
        return _percentile(self.write_s, q) * 1000

    def turn_chunks(self, q: float) -> float:
        return _percentile(self.chunks_per_turn, q)


def _percentile(values: deque[float] | deque[int], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


class RejectLog:
    """Logs a rejected message at most once per reason per interval, with the count since."""

    def __init__(self, stats: HubStats, interval_s: float) -> None:
        self.stats = stats
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def reject(self, reason: str, detail: str, peer: bytes | str = b"") -> None:
        self.stats.rejected[reason] += 1
        now = time.monotonic()
        if now - self._last.get(reason, -1e18) >= self.interval_s:
            more = self._suppressed.pop(reason, 0)
            suffix = f" (+{more} more since last report)" if more else ""
            log.warning("rejected %s from %r: %s%s", reason, peer, detail, suffix)
            self._last[reason] = now
        else:
            self._suppressed[reason] += 1


class RateMeter:
    """Rates over the interval since the last call."""

    def __init__(self) -> None:
        self._t = time.monotonic()
        self._last: dict[str, int] = {}

    def rates(self, values: dict[str, int]) -> dict[str, float]:
        now = time.monotonic()
        dt = max(now - self._t, 1e-9)
        out = {k: (v - self._last.get(k, 0)) / dt for k, v in values.items()}
        self._t, self._last = now, dict(values)
        return out


def start_metrics_server(port: int, host: str, snapshots: SnapshotExchange) -> int:
    """Serve /metrics in Prometheus text format from the hub's snapshots; return the bound port.

    A snapshot is ``{"counters": {...}, "gauges": {...}, "rejected": {reason: n},
    "staleness": {k: n}}``, taken by the hub's loop at each scrape (``SnapshotExchange``). Each
    server has a registry of its own (the process, platform and GC collectors, and the hub's), so
    two hubs in one process do not collide in prometheus_client's global one.
    """
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

    http_rejected = HttpRejections()
    registry = CollectorRegistry()
    for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(standard)

    class HubCollector(Collector):
        def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
            snap = snapshots.request()
            for name, value in snap["counters"].items():  # type: ignore[attr-defined]
                yield CounterMetricFamily(f"flywheel_hub_{name}", f"hub counter {name}", value=value)
            for name, value in snap["gauges"].items():  # type: ignore[attr-defined]
                yield GaugeMetricFamily(f"flywheel_hub_{name}", f"hub gauge {name}", value=value)
            rej = CounterMetricFamily("flywheel_hub_rejected", "rejected messages by reason", labels=["reason"])
            for reason, n in snap["rejected"].items():  # type: ignore[attr-defined]
                rej.add_metric([reason], n)
            yield rej
            errs = CounterMetricFamily("flywheel_hub_reward_errors", "failed scores by reason", labels=["reason"])
            for reason, n in snap.get("reward_errors", {}).items():  # type: ignore[attr-defined]
                errs.add_metric([reason], n)
            yield errs
            st = GaugeMetricFamily(
                "flywheel_hub_served_staleness", "groups served to learners by staleness", labels=["staleness"]
            )
            for k, n in snap["staleness"].items():  # type: ignore[attr-defined]
                st.add_metric([str(k)], n)
            yield st
            http = CounterMetricFamily(
                "flywheel_hub_http_rejected", "requests the metrics endpoint refused, by reason", labels=["reason"]
            )
            for reason, n in http_rejected.snapshot().items():
                http.add_metric([reason], n)
            yield http
            yield CounterMetricFamily(
                "flywheel_hub_stale_scrapes",
                "scrapes answered with the previous snapshot: the hub's loop did not answer in time",
                value=snapshots.stale_scrapes,
            )

    registry.register(HubCollector())
    return serve_metrics(port, host, http_rejected, registry)


class SnapshotExchange:
    """Hands the hub's stats from its loop to the metrics server's threads.

    The stats are the loop's own dicts and deques: read on another thread, they can change size
    mid-read (a scrape then fails with ``RuntimeError``). So a scrape asks, and the loop takes the
    snapshot between two turns (``serve``, one attribute read when nobody asked). A loop that
    does not answer within ``timeout_s`` (busy on a long turn, or not started yet) gets the last
    snapshot served again, marked by ``stale_scrapes``; if there is none yet, the scrape fails.
    """

    def __init__(self, take: Callable[[], dict[str, object]], timeout_s: float = 2.0) -> None:
        self._take = take
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: Future[dict[str, object]] | None = None
        self._last: dict[str, object] | None = None
        self.stale_scrapes = 0

    def request(self) -> dict[str, object]:
        """On a metrics thread: the loop's next snapshot (or, past the timeout, its last)."""
        with self._lock:
            if self._pending is None:  # scrapes at the same moment share one snapshot
                self._pending = Future()
            pending = self._pending
        try:
            snap = pending.result(timeout=self.timeout_s)
        except TimeoutError:  # (concurrent.futures' is the builtin one)
            with self._lock:
                self.stale_scrapes += 1
                last = self._last
            if last is None:
                raise TimeoutError(f"the hub's loop gave no stats within {self.timeout_s}s") from None
            return last
        with self._lock:
            self._last = snap
        return snap

    def serve(self) -> None:
        """On the hub's loop, between turns: answer a scrape that is waiting."""
        if self._pending is None:
            return
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.set_result(self._take())
        except Exception as exc:  # the scrape reports it (HTTP 500); the loop goes on
            pending.set_exception(exc)


class HttpRejections:
    """Requests the metrics endpoint refused, by reason (counted on its request threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


METRICS_READ_TIMEOUT_S = 10.0


def serve_metrics(port: int, host: str, rejected: HttpRejections, registry: CollectorRegistry) -> int:
    """prometheus_client's WSGI server, with a read timeout and every refused request counted.

    Its stock handler waits for a request line forever (each silent connection holds a thread
    for good) and refuses garbage without a trace; this one gives up on a silent client after
    ``METRICS_READ_TIMEOUT_S`` and counts each refusal by reason (``http_<status>``,
    ``http_timeout``, ``http_blank`` for a blank request line).
    """
    from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    class Handler(WSGIRequestHandler):
        timeout = METRICS_READ_TIMEOUT_S
        default_request_version = "HTTP/1.0"  # not 0.9: every answer, refusals too, has a status line
        _error_sent = False

        def handle(self) -> None:
            try:
                self._handle()
            except TimeoutError:
                rejected.add("http_timeout")
            except ConnectionError:
                pass  # the client went away: nothing to answer

        def _handle(self) -> None:  # wsgiref's handle(), plus the counting
            self.raw_requestline = self.rfile.readline(65537)
            if not self.raw_requestline:
                return  # connected and closed without a byte: nothing was asked
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            self._error_sent = False
            if not self.parse_request():
                if not self._error_sent:
                    rejected.add("http_blank")
                return
            rfile, wfile = self.rfile, self.wfile
            handler = ServerHandler(rfile, wfile, self.get_stderr(), self.get_environ(), multithread=False)  # type: ignore[arg-type]
            handler.request_handler = self  # type: ignore[attr-defined]
            handler.run(self.server.get_app())  # type: ignore[attr-defined]

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            self._error_sent = True
            rejected.add(f"http_{code}")
            super().send_error(code, message, explain)

        def log_message(self, format: str, *args: object) -> None:
            pass  # no line per request (the counters say what matters)

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> object:
        def counting_start_response(status: str, headers: list[tuple[str, str]], *exc: object) -> object:
            if not status.startswith("2"):
                rejected.add(f"http_{status.split(' ', 1)[0]}")
            return start_response(status, headers, *exc)

        return metrics_app(environ, counting_start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    httpd = make_server(host, port, app, Server, handler_class=Handler)  # type: ignore[arg-type]
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return int(httpd.server_address[1])
