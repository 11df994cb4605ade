"""Hub statistics: counters kept in memory, a periodic log line, and a Prometheus endpoint."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

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
    generators_evicted: int = 0
    generators_departed: int = 0  # drained and gone (scale-down): not an eviction
    rejected: Counter[str] = field(default_factory=Counter)
    reward_errors: Counter[str] = field(default_factory=Counter)  # failed scores by reason (timeout, ...)
    groups_dropped_reward: int = 0  # dropped for a failed score (reward.on_error drop_group)
    admission_blocked_s: float = 0.0  # generators had free slots the staleness bound kept empty
    # seconds from the start of a turn that took chunks to its Redis write returning (recent turns)
    durable_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def note_durable(self, seconds: float) -> None:
        self.durable_s.append(seconds)

    def durable_ms(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.durable_s), q) * 1000) if self.durable_s else 0.0


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


def start_metrics_server(port: int, host: str, snapshot: Callable[[], dict[str, object]]) -> int:
    """Serve /metrics in Prometheus text format from ``snapshot()``; return the bound port.

    ``snapshot`` returns ``{"counters": {...}, "gauges": {...}, "rejected": {reason: n},
    "staleness": {k: n}}``; it is called on the HTTP thread at each scrape.
    """
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import start_http_server
    from prometheus_client.registry import Collector

    class HubCollector(Collector):
        def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
            snap = snapshot()
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

    REGISTRY.register(HubCollector())
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_address[1])
