"""Load: ~1000 simulated generators on one real hub (``bench/load.py`` at a small scale), and the
two bounds it relies on: generators back off their resends while the hub is slow, and the hub's
registry of generators is capped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from bench.load import LoadConfig, run_load
from flywheel.wire import Chunk, ChunkAck, encode, pack_i32, pack_i64
from generators import hub_link
from generators.hub_link import HubLink
from tests.conftest import Cluster, wait_until
from tests.integration.handgen import HandGenerator


@pytest.mark.slow
def test_1000_generators_bounded_memory_nothing_acked_lost(tmp_path: Path) -> None:
    # a smaller step (and a larger η, so that every generator still holds a group): the consumer
    # gets batches within the short run
    cfg = LoadConfig(generators=1000, seconds=10.0, stall_s=2.0, groups_per_step=128, max_staleness=7)
    result = run_load(tmp_path, cfg, log=lambda *_: None)
    h, audit = result["headline"], result["audit"]
    assert h["generators_registered"] == 1000
    assert h["heartbeat_timeouts"] == 0 and h["leases_reissued"] == 0, result["hub_final"]
    assert h["acked_chunks"] > 10_000 and audit["groups_consumed"] > 0
    assert h["acked_lost"] == 0, audit["lost_examples"]
    assert h["groups_consumed_twice"] == 0
    assert h["hub_rss_peak_mb"] < h["hub_rss_bound_mb"], result["bounds"]
    assert h["redis_used_peak_mb"] < h["redis_used_bound_mb"], result["bounds"]
    assert h["hub_cpu_mean_pct"] > 0 and h["tokens_per_s"] > 0


def _chunk(seq: int) -> Chunk:
    return Chunk(
        lease_id=1,
        group_id=7,
        sample=0,
        seq=seq,
        tokens=pack_i32([seq]),
        logprobs=b"\0\0\0\0",
        versions=pack_i32([0]),
        finish_reason=None,
    )


def test_resends_back_off_and_follow_the_ack_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed resend timeout floods a slow hub with duplicates (at 1000 generators, a few seconds
    of lag became a resend storm): resends must back off while unanswered, and the timeout must
    grow with the measured ack latency."""
    now = [1000.0]
    monkeypatch.setattr(hub_link, "time", SimpleNamespace(monotonic=lambda: now[0]))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    hub = ctx.socket(zmq.ROUTER)
    hub.setsockopt(zmq.LINGER, 0)
    port = hub.bind_to_random_port("tcp://127.0.0.1")
    link = HubLink(f"tcp://127.0.0.1:{port}", "g0", "m", 1, resend_after_s=1.0)
    try:
        link.send_chunks([_chunk(0)])
        resent_at = []
        for _ in range(320):  # 40 s of silence from the hub, checked every 0.125 s
            now[0] += 0.125
            if link.resend_due():
                resent_at.append(now[0] - 1000.0)
        gaps = np.diff([0.0, *resent_at])
        assert list(gaps[:4]) == [1.0, 2.0, 4.0, 8.0], resent_at  # doubling...
        assert max(gaps) == 1.0 * hub_link.MAX_BACKOFF  # ...up to a cap

        link.send_chunks([_chunk(1)])  # a fresh chunk, acknowledged 3 s later
        now[0] += 3.0
        assert hub.poll(5000), "the link never reached the test's hub"
        ident, _ = hub.recv_multipart()
        ack = ChunkAck(group_ids=pack_i64([7]), samples=pack_i32([0]), seqs=pack_i32([1]), rejected=[])
        hub.send_multipart([ident, encode(ack)])
        wait_until(lambda: link.poll(10).acked == 1, 5, "the ack")
        assert link.resend_timeout_s() >= 3.0  # the hub answers in 3 s: resending after 1 s would only add load
    finally:
        link.close()
        hub.close(linger=0)


def test_a_hub_away_gets_one_copy_of_the_window_not_one_a_resend_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeroMQ queues what a generator sends while the hub is away and delivers it all when the hub
    is back: each resend round queued the whole unacknowledged window again, copy after copy in
    the generator's memory, then one burst of duplicates into the restarted hub. While the hub
    says nothing, a round resends one chunk (a probe); the rest goes once the hub answers."""
    from flywheel.redis_server import free_port
    from flywheel.wire import Decoder, ToHub

    now = [1000.0]
    monkeypatch.setattr(hub_link, "time", SimpleNamespace(monotonic=lambda: now[0]))
    port = free_port()
    link = HubLink(f"tcp://127.0.0.1:{port}", "g0", "m", 1, resend_after_s=1.0)
    hub = zmq.Context.instance().socket(zmq.ROUTER)
    hub.setsockopt(zmq.LINGER, 0)
    try:
        link.send_chunks([_chunk(i) for i in range(600)])
        rounds = 0
        for _ in range(320):  # 40 s with the hub away, checked every 0.125 s
            now[0] += 0.125
            rounds += bool(link.resend_due())
        assert rounds >= 5
        hub.bind(f"tcp://127.0.0.1:{port}")  # the hub is back
        decoder, received = Decoder(ToHub), 0
        while hub.poll(2000):
            received += len(decoder.decode(hub.recv_multipart()[1]).chunks)  # type: ignore[attr-defined]
        # the first send, one whole round (before the silence was known), then a chunk a round
        assert received == 600 + 600 + (rounds - 1), (received, rounds)
        # the hub answers: what is still unacknowledged goes again at the next round, whole
        ack = ChunkAck(group_ids=pack_i64([7]), samples=pack_i32([0]), seqs=pack_i32([0]), rejected=[])
        hub.send_multipart([b"g0", encode(ack)])
        wait_until(lambda: link.poll(10).acked == 1, 5, "the ack")
        now[0] += 1000.0
        assert link.resend_due() == 599
    finally:
        link.close()
        hub.close(linger=0)


def test_hub_caps_registered_generators(cluster: Cluster) -> None:
    cluster.start_hub("--hub.max_generators", "2", "--hub.generator_timeout_s", "2")
    gens = [HandGenerator(cluster.gen_address, f"g{i}") for i in range(3)]

    def pumped(check: Callable[[], bool]) -> Callable[[], bool]:
        def predicate() -> bool:
            for g in gens:
                g.pump(0.05)
            return check()

        return predicate

    try:
        for g in gens:
            g.register()
            g.pump(0.2)
        refused = 'flywheel_hub_rejected_total{reason="too_many_generators"}'
        wait_until(pumped(lambda: cluster.metrics().get(refused, 0) >= 1), 20, "the third registration refused")
        assert cluster.metrics()["flywheel_hub_generators"] == 2
        assert len(_registered(cluster)) == 2
        gone = next(g for g in gens if g.link.generator_id in _registered(cluster))
        gens.remove(gone)
        gone.close()  # silent from now on: evicted, and the one refused gets its place
        wait_until(pumped(lambda: _registered(cluster) == {g.link.generator_id for g in gens}), 30, "the third in")
    finally:
        for g in gens:
            g.close()


def _registered(cluster: Cluster) -> set[str]:
    raw = cluster.redis.client().hkeys("fw:{flywheel}:generators")
    return {k.decode() for k in raw}
