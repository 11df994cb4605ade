"""The hub's sockets under a flood of malformed messages (its generator and reward ROUTERs, its
Prometheus endpoint), one after the other on one hub: no crash, every rejection counted by
reason, and afterwards it still serves and has lost nothing it acknowledged."""

from __future__ import annotations

import random

from tests.conftest import Cluster
from tests.fuzz.conftest import HTTP_REQUESTS, MESSAGES
from tests.fuzz.drive import (
    FuzzResult,
    HubRun,
    fuzz_hub_generator_port,
    fuzz_hub_metrics,
    fuzz_hub_reward_port,
)


def check_zmq(result: FuzzResult) -> None:
    assert result.messages >= MESSAGES
    assert result.crashes == 0
    # every refused message counted, under the reason the receiver's own checks give
    assert result.counted == result.expected, (result.socket, result.counted, result.expected)
    assert result.transport_dropped == 3  # frames over ZMQ's own limit: the connection is dropped


def test_hub_sockets(cluster: Cluster, fuzz_seeds: list[bytes], fuzz_rng: random.Random) -> None:
    hub = HubRun(cluster)  # a generator with a lease, one chunk of it acknowledged
    check_zmq(fuzz_hub_generator_port(hub, fuzz_seeds, MESSAGES, fuzz_rng))
    check_zmq(fuzz_hub_reward_port(hub, fuzz_seeds, MESSAGES, fuzz_rng))
    metrics = fuzz_hub_metrics(hub, HTTP_REQUESTS, fuzz_rng)
    assert metrics.messages >= HTTP_REQUESTS and metrics.crashes == 0
    # every refusal the client saw counted under its reason (http_<status>, http_blank), and no
    # more but for answers lost to a connection reset
    assert not metrics.expected - metrics.counted, (metrics.counted, metrics.expected)
    assert metrics.counted.total() - metrics.expected.total() <= metrics.undelivered_bound, metrics.note
    assert metrics.expected.total() > HTTP_REQUESTS // 2, metrics.note  # most garbage is refused, not served
    # new generators get leases and acks, scores are taken, and the early chunk is intact
    hub.still_serves()
