"""Floods for every socket the services open, shared by tests/fuzz and bench/fuzz.py.

Each ``fuzz_*`` function drives one socket with ``n`` messages the receiver must refuse, checks
that it survived and still serves a well-formed exchange, and returns a ``FuzzResult`` with the
rejections it was expected to count (by reason, from the corpus oracle) and those it counted.
Servers run as real processes (the hub, the reward-model server); clients (a generator's hub and
sync links, the reward service) run here, against a hostile peer: a real ROUTER or PUB socket
that sends the garbage.
"""

from __future__ import annotations

import contextlib
import random
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from flywheel.config import RewardConfig, SyncConfig
from flywheel.hub_client import BatchClient
from flywheel.redis_server import free_port
from flywheel.staleness import StalenessPolicy
from flywheel.wire import (
    Decoder,
    Lease,
    RewardRegister,
    Score,
    ScoreBatch,
    ScoreRequest,
    SyncJoin,
    ToHub,
    ToLearner,
    WeightsAck,
    WeightsReady,
    encode,
    pack_i32,
)
from tests.conftest import Cluster
from tests.fuzz import corpus
from tests.fuzz.corpus import Frames, Mutator, Oracle
from tests.integration.handgen import HandGenerator, expected_sample, make_chunk

MAX_BYTES = 65536  # the receivers' checked limit in these floods; ZMQ's own is 4x this
SLICE = 5000  # messages built and queued at a time: the receiver works while the next slice is built


@dataclass
class FuzzResult:
    socket: str
    messages: int = 0  # messages (or HTTP requests) sent
    expected: Counter[str] = field(default_factory=Counter)  # rejections the receiver must count
    counted: Counter[str] = field(default_factory=Counter)  # rejections it counted
    transport_dropped: int = 0  # frames over ZMQ's MAXMSGSIZE: the connection is dropped, unseen
    # HTTP: connections the client gave up on (the server still waited for bytes) or that the
    # server reset: a refusal it answered on them is counted but may never be seen, so counted
    # may exceed expected (what the client saw) by at most this
    undelivered_bound: int = 0
    skipped_valid: int = 0  # mutants that were valid messages, so not sent
    crashes: int = 0
    seconds: float = 0.0
    note: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "socket": self.socket,
            "messages": self.messages,
            "rejected_expected": dict(self.expected),
            "rejected_counted": dict(self.counted),
            "transport_dropped": self.transport_dropped,
            "undelivered_bound": self.undelivered_bound,
            "skipped_valid": self.skipped_valid,
            "crashes": self.crashes,
            "seconds": round(self.seconds, 3),
            "messages_per_s": round(self.rate, 1),
            "note": self.note,
        }


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def zsocket(kind: int, identity: bytes | None = None) -> zmq.Socket[bytes]:
    """A fuzzing socket: unbounded queues (a send never blocks, nothing is dropped), linger 0."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def drain(sock: zmq.Socket[bytes]) -> int:
    """Read and drop whatever the peer answered (so that its send queue to us never fills)."""
    n = 0
    with contextlib.suppress(zmq.Again):
        while True:
            sock.recv_multipart(zmq.NOBLOCK)
            n += 1
    return n


def flood_slices(
    n: int, mutator: Mutator, oracle: Oracle, oversized: int = 0, limit: int = MAX_BYTES
) -> Iterator[tuple[list[Frames], Counter[str], int]]:
    """The flood in slices of ``SLICE`` (the oversized frames spread over them)."""
    done = 0
    while done < n:
        k = min(SLICE, n - done)
        over = oversized * (done + k) // n - oversized * done // n
        yield corpus.build_flood(k, mutator, oracle, oversized=over, limit=limit)
        done += k


def send_flood(
    sock: zmq.Socket[bytes],
    result: FuzzResult,
    slices: Iterator[tuple[list[Frames], Counter[str], int]],
    prefix: Frames = [],  # noqa: B006 (read only)
    between: Callable[[], object] | None = None,
) -> None:
    for flood, expected, skipped in slices:
        for frames in flood:
            sock.send_multipart(prefix + frames, zmq.NOBLOCK)
        result.messages += len(flood)
        result.expected += expected
        result.skipped_valid += skipped
        if between is not None:
            between()


def transport_oversize(address: str, size: int, count: int) -> int:
    """Send ``count`` frames of ``size`` bytes (over the receiver's ZMQ MAXMSGSIZE), each on a
    connection of its own; return how many of those connections the receiver dropped."""
    dropped = 0
    for _ in range(count):
        sock = zsocket(zmq.DEALER)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(address)
            if _monitor_event(monitor, zmq.EVENT_CONNECTED, 10):
                sock.send(bytes(size))
                dropped += _monitor_event(monitor, zmq.EVENT_DISCONNECTED, 10)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
    return dropped


def _monitor_event(monitor: zmq.Socket[bytes], event: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100) and recv_monitor_message(monitor)["event"] == event:
            return True
    return False


# ------------------------------------------------------------------------------ the hub

HUB_ARGS = (
    "--hub.max_message_bytes",
    str(MAX_BYTES),
    "--data.n_samples_per_prompt",
    "2",
    "--async.groups_per_step",
    "2",
    "--hub.generator_timeout_s",
    "300",
    "--hub.lease_timeout_s",
    "300",
    "--hub.reject_log_interval_s",
    "60",
)
EVIL = b"\xfffuzz"  # not valid UTF-8: no generator id can be this identity


class HubRun:
    """A hub (started by the caller's ``Cluster``) with one well-behaved generator holding one
    lease, one chunk of which is durable before the flood. ``still_serves`` checks afterwards
    that the hub serves new generators, acks, scores, and lost nothing it had acknowledged."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cluster.start_hub(*HUB_ARGS)
        self.good = HandGenerator(cluster.gen_address, "good")
        self.good.register()
        self.lease: Lease = self.good.wait_lease()
        self.good.send(make_chunk(self.lease, 0, 0, 0, final=True))
        self._pump(lambda: self.good.acked == 1, "the good chunk's ack")

    def _pump(self, done: Callable[[], bool], what: str, gen: HandGenerator | None = None) -> None:
        g = gen or self.good

        def step() -> bool:
            g.pump(0.05)
            return done()

        wait_for(step, 60, what, poll_s=0)

    def alive(self) -> bool:
        return self.cluster.hub is not None and self.cluster.hub.alive()

    def rejected(self, family: str = "flywheel_hub_rejected_total") -> Counter[str]:
        out: Counter[str] = Counter()
        for key, value in self.cluster.metrics().items():
            if key.startswith(family + "{"):
                reason = key.split('reason="', 1)[1].split('"', 1)[0]
                if not reason.startswith("send_failed"):  # our own sends that failed, not input
                    out[reason] = int(value)
        return out

    def wait_counted(
        self, result: FuzzResult, before: Counter[str], family: str = "flywheel_hub_rejected_total"
    ) -> None:
        want = result.expected.total()

        def caught_up() -> bool:
            self.good.pump(0.01)
            result.counted = self.rejected(family) - before
            return result.counted.total() >= want or not self.alive()

        wait_for(caught_up, 300, f"the hub to count {want} rejections", poll_s=0.2)

    def still_serves(self) -> None:
        assert self.alive(), self.cluster.hub.tail(40) if self.cluster.hub else "no hub"
        lease, good = self.lease, self.good
        good.send(make_chunk(lease, 1, 0, 0, final=True))  # the group's other sample
        self._pump(lambda: good.acked == 2, "the ack of a chunk sent after the flood")
        late = HandGenerator(self.cluster.gen_address, "late")  # register, lease, chunk, ack
        late.register()
        second = late.wait_lease()
        late.send(make_chunk(second, 0, 0, 0, final=True))
        self._pump(lambda: late.acked == 1, "a new generator's ack", gen=late)
        late.close()
        scored = hand_score(self.cluster.reward_address, {(lease.group_id, 0), (lease.group_id, 1)})
        assert scored, "no ScoreRequest for the good group"
        client = BatchClient(self.cluster.redis.client(), "flywheel", StalenessPolicy(1, 2))
        wait_for(lambda: client.redis.zcard(client.keys.ready) >= 1, 60, "the good group ready")
        pairs, _ = client.try_claim(1, 0)
        group = client._load(pairs, 0)[0]
        assert group.group_id == lease.group_id
        # what was acknowledged before the flood is intact, token for token
        assert [s.tokens.tolist() for s in group.samples] == [expected_sample(lease.group_id, s, 1) for s in (0, 1)]
        good.close()


def hand_score(address: str, want: set[tuple[int, int]], timeout_s: float = 60) -> bool:
    """A reward worker by hand: register, answer ScoreRequests until ``want`` are all scored."""
    sock = zsocket(zmq.DEALER, b"hand-reward")
    sock.connect(address)
    decoder = Decoder(ScoreRequest)
    deadline = time.monotonic() + timeout_s
    last_hello = 0.0
    try:
        while want and time.monotonic() < deadline:
            if time.monotonic() - last_hello > 0.5:
                sock.send(encode(RewardRegister(worker_id="hand-reward", capacity=8)))
                last_hello = time.monotonic()
            if not sock.poll(50):
                continue
            req = decoder.decode(sock.recv())
            assert isinstance(req, ScoreRequest)
            sock.send(encode(Score(worker_id="hand-reward", group_id=req.group_id, sample=req.sample, reward=1.0)))
            want.discard((req.group_id, req.sample))
        return not want
    finally:
        sock.close(0)


def fuzz_hub_generator_port(hub: HubRun, seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    result = FuzzResult("hub generator ROUTER")
    lease = hub.lease
    oracle = corpus.hub_generator_port(
        Decoder(ToHub, max_bytes=MAX_BYTES), {lease.lease_id: (lease.group_id, lease.samples)}
    )
    mutator = Mutator(seeds + corpus.valid_seeds(lease), rng)
    before = hub.rejected()
    start = time.perf_counter()
    evil = zsocket(zmq.DEALER, EVIL)
    evil.connect(hub.cluster.gen_address)
    try:
        send_flood(
            evil, result, flood_slices(n, mutator, oracle, oversized=max(1, n // 1000)), between=lambda: drain(evil)
        )
        hub.wait_counted(result, before)
    finally:
        evil.close(0)
    result.seconds = time.perf_counter() - start
    result.transport_dropped = transport_oversize(hub.cluster.gen_address, 4 * MAX_BYTES + 1, 3)
    result.crashes = int(not hub.alive())
    return result


def fuzz_hub_reward_port(hub: HubRun, seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """(Before ``hub.still_serves``: a sample is complete and waits for a reward worker, so no
    score is in flight and every Score is unexpected.)"""
    result = FuzzResult("hub reward ROUTER")
    oracle = corpus.hub_reward_port(Decoder(ToHub, max_bytes=MAX_BYTES))
    mutator = Mutator(seeds + corpus.valid_seeds(hub.lease), rng)
    before = hub.rejected()
    start = time.perf_counter()
    evil = zsocket(zmq.DEALER, EVIL)
    evil.connect(hub.cluster.reward_address)
    try:
        send_flood(
            evil, result, flood_slices(n, mutator, oracle, oversized=max(1, n // 1000)), between=lambda: drain(evil)
        )
        hub.wait_counted(result, before)
    finally:
        evil.close(0)
    result.seconds = time.perf_counter() - start
    result.transport_dropped = transport_oversize(hub.cluster.reward_address, 4 * MAX_BYTES + 1, 3)
    result.crashes = int(not hub.alive())
    return result


# ------------------------------------------------------------------------------ clients


def _bound(kind: int, identity: bytes | None = None) -> tuple[zmq.Socket[bytes], str]:
    sock = zsocket(kind, identity)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def _route(router: zmq.Socket[bytes], identity: bytes, timeout_s: float = 30) -> None:
    """Wait until ``router`` can reach the peer named ``identity`` (its handshake is done)."""
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    ping = [identity, b"\xc1"]  # one malformed frame: the caller counts it as a rejection

    def sent() -> bool:
        try:
            router.send_multipart(ping, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    wait_for(sent, timeout_s, f"the peer {identity!r} to connect")


def _finish(result: FuzzResult, counts: Callable[[], Counter[str]], pump: Callable[[], object]) -> None:
    want = result.expected.total()

    def caught_up() -> bool:
        pump()
        result.counted = Counter(counts())
        return result.counted.total() >= want

    wait_for(caught_up, 300, f"{want} rejections counted", poll_s=0)


def fuzz_hub_link(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """A generator's DEALER to the hub, against a hostile hub (a ROUTER sending garbage)."""
    from generators.hub_link import HubLink

    result = FuzzResult("generator DEALER -> hub")
    router, address = _bound(zmq.ROUTER)
    link = HubLink(address, "gen-fuzz", "tiny", 1, max_message_bytes=MAX_BYTES)
    try:
        link.register(0)
        assert router.poll(30_000), "the generator never registered"
        router.recv_multipart()
        _route(router, b"gen-fuzz")
        result.expected["malformed"] += 1  # _route's ping
        oracle = corpus.accept_valid(link.decoder)  # the receiver's own checks name the reasons
        start = time.perf_counter()
        slices = flood_slices(n, Mutator(seeds + corpus.valid_seeds(), rng), oracle, oversized=max(1, n // 1000))
        send_flood(router, result, slices, prefix=[b"gen-fuzz"], between=lambda: link.poll(0))
        _finish(result, lambda: link.rejects.counts, lambda: link.poll(10))
        result.seconds = time.perf_counter() - start
        # still works: a lease in, a chunk out, its ack in
        lease = corpus.valid(Lease)
        router.send_multipart([b"gen-fuzz", encode(lease)])
        inbox = link.poll(5000)
        assert [x.lease_id for x in inbox.leases] == [lease.lease_id], inbox
        chunk = make_chunk(lease, 0, 0, 0, final=True)
        link.send_chunks([chunk])
        assert router.poll(10_000)
        assert Decoder(ToHub).decode(router.recv_multipart()[1]).chunks == [chunk]  # type: ignore[attr-defined]
        router.send_multipart([b"gen-fuzz", encode(corpus.ack_of(chunk))])
        assert link.poll(5000).acked == 1 and not link.unacked
    finally:
        link.close()
        router.close(0)
    return result


def fuzz_sync_announce(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """A generator's SUB to the learner's announcements, against a hostile publisher."""
    from generators.sync_link import SyncLink

    result = FuzzResult("generator SUB <- learner")
    pub, address = _bound(zmq.XPUB)  # an XPUB sees the subscription: we know when it listens
    port = int(address.rsplit(":", 1)[1])
    sync = SyncLink("127.0.0.1", port, free_port(), "gen-fuzz", 1, max_message_bytes=MAX_BYTES)
    try:
        assert pub.poll(30_000), "the generator never subscribed"
        pub.recv()
        oracle = corpus.accept_valid(sync.decoder)
        start = time.perf_counter()
        slices = flood_slices(n, Mutator(seeds + corpus.valid_seeds(), rng), oracle, oversized=max(1, n // 1000))
        send_flood(pub, result, slices, between=sync.poll)
        _finish(result, lambda: sync.rejects.counts, sync.poll)
        result.seconds = time.perf_counter() - start
        ready = corpus.valid(WeightsReady)
        pub.send(encode(ready))
        got: list[tuple[WeightsReady, bytes]] = []

        def heard() -> bool:
            got.extend(sync.poll())
            return bool(got)

        wait_for(heard, 10, "a valid WeightsReady after the flood")
        assert got[0][0] == ready
    finally:
        sync.close()
        pub.close(0)
    return result


def fuzz_sync_join(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """A generator's DEALER to the learner (which never sends on it), against a hostile ROUTER."""
    from generators.sync_link import SyncLink

    result = FuzzResult("generator DEALER -> learner")
    router, address = _bound(zmq.ROUTER)
    port = int(address.rsplit(":", 1)[1])
    sync = SyncLink("127.0.0.1", free_port(), port, "gen-fuzz", 1)
    try:
        _route(router, b"gen-fuzz")
        start = time.perf_counter()
        slices = flood_slices(n, Mutator(seeds, rng), corpus.every_message("wrong_socket"))
        result.expected["wrong_socket"] += 1  # _route's ping
        send_flood(router, result, slices, prefix=[b"gen-fuzz"], between=sync.poll)
        _finish(result, lambda: sync.rejects.counts, sync.poll)
        result.seconds = time.perf_counter() - start
        sync._join_after = 0.0  # still works: its SyncJoin and WeightsAck reach the learner
        sync.join(3, every_s=0.0)
        sync.ack(3, 7, None, 0.1)
        decoder = Decoder(ToLearner)
        got = []
        for _ in range(2):
            assert router.poll(10_000)
            identity, payload = router.recv_multipart()
            got.append((identity, decoder.decode(payload)))
        assert got == [
            (b"gen-fuzz", SyncJoin(generator_id="gen-fuzz", version=3, workers=1, incarnation=sync.incarnation)),
            (b"gen-fuzz", WeightsAck(generator_id="gen-fuzz", version=3, epoch=7, seconds=0.1)),
        ]
    finally:
        sync.close()
        router.close(0)
    return result


def fuzz_reward_service(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """The reward service's DEALER to the hub (its real loop, on a thread), against a hostile hub."""
    from reward_service.pool import WorkerPool
    from reward_service.scoring import FunctionSpec
    from reward_service.service import RewardService

    result = FuzzResult("reward service DEALER -> hub")
    router, address = _bound(zmq.ROUTER)
    rcfg = RewardConfig(hub_address=address, workers=1, functions=["length"])
    pool = WorkerPool(1, [FunctionSpec("length", 1.0, {})], None, {"max_tokens": 16}, timeout_s=10)
    service = RewardService(rcfg, "rw-fuzz", pool, heartbeat_s=0.2)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            service.run()
        except BaseException as err:  # a crash of the service's loop: reported, not lost
            failure.append(err)

    thread = threading.Thread(target=run, name="reward-service", daemon=True)
    thread.start()
    try:
        assert router.poll(120_000), "the reward service never registered"
        _route(router, b"rw-fuzz")
        result.expected["malformed"] += 1  # _route's ping
        oracle = corpus.accept_valid(service.decoder)
        start = time.perf_counter()
        slices = flood_slices(n, Mutator(seeds + corpus.valid_seeds(), rng), oracle)
        send_flood(router, result, slices, prefix=[b"rw-fuzz"], between=lambda: drain(router))
        _finish(result, lambda: service.rejects.counts, lambda: drain(router) + router.poll(10))
        result.seconds = time.perf_counter() - start
        assert not failure and thread.is_alive(), failure
        # still works: a request in, its score out
        req = ScoreRequest(
            group_id=5, sample=1, prompt_tokens=pack_i32([1]), response_tokens=pack_i32([2] * 8), finish_reason="stop"
        )
        router.send_multipart([b"rw-fuzz", encode(req)])
        decoder = Decoder(ToHub)
        score = None
        deadline = time.monotonic() + 60
        while score is None and time.monotonic() < deadline:
            if router.poll(100):
                msg = decoder.decode(router.recv_multipart()[1])
                if isinstance(msg, ScoreBatch) and msg.scores:
                    score = msg.scores[0]
        assert score is not None and (score.group_id, score.sample, score.error) == (5, 1, None), score
    finally:
        service.stop()
        thread.join(30)
        service.close()
        router.close(0)
    result.crashes = len(failure)
    return result


# ------------------------------------------------------------------------------ the learner


def fuzz_learner_join(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """The learner's ROUTER (SyncJoin, WeightsAck), flooded by a peer that is no generator."""
    from generators.sync_link import SyncLink
    from learner.weight_sync import WeightBroadcaster

    result = FuzzResult("learner ROUTER (joins, acks)")
    bc = WeightBroadcaster(SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=5))
    evil = zsocket(zmq.DEALER, EVIL)
    evil.connect(f"tcp://127.0.0.1:{bc.cfg.join_port}")
    try:
        start = time.perf_counter()
        slices = flood_slices(n, Mutator(seeds + corpus.valid_seeds(), rng), corpus.learner_join_port(bc.decoder))
        send_flood(evil, result, slices, between=bc.poll)
        _finish(result, lambda: bc.rejects.counts, lambda: bc.poll(10))
        result.seconds = time.perf_counter() - start
        assert not bc.members, bc.members  # nothing the fuzzer sent made it a member
        # still works: a generator joins, hears an announcement, and its ack is taken
        sync = SyncLink("127.0.0.1", bc.cfg.announce_port, bc.cfg.join_port, "gen-ok", 1)
        try:

            def joined() -> bool:
                sync.join(0, every_s=0.1)
                bc.poll(10)
                return "gen-ok" in bc.members

            wait_for(joined, 30, "a generator to join after the flood", poll_s=0)
            ready = corpus.valid(WeightsReady)
            got: list[tuple[WeightsReady, bytes]] = []

            def heard() -> bool:
                bc.pub.send(encode(ready))
                got.extend(sync.poll())
                return bool(got)

            wait_for(heard, 10, "an announcement to reach the generator", poll_s=0.05)
            sync.ack(1, 1, None, 0.1)

            def acked() -> bool:
                bc.poll(10)
                return bc.last_ack("gen-ok") is not None

            wait_for(acked, 10, "the generator's ack", poll_s=0)
        finally:
            sync.close()
    finally:
        evil.close(0)
        bc.close()
    return result


def fuzz_learner_announce(seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """The learner's PUB, flooded upstream by an XSUB peer: subscriptions of random prefixes,
    cancellations, and frames that are neither. libzmq consumes all of it (a PUB has no receive
    side): nothing reaches the learner, so there is nothing for it to count. What is checked:
    the learner still publishes to a real generator afterwards."""
    from generators.sync_link import SyncLink
    from learner.weight_sync import WeightBroadcaster

    result = FuzzResult("learner PUB (announcements)", note="libzmq consumes upstream frames; none reach the learner")
    bc = WeightBroadcaster(SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=5))
    evil = zsocket(zmq.XSUB)
    evil.connect(f"tcp://127.0.0.1:{bc.cfg.announce_port}")
    mutator = Mutator(seeds + corpus.valid_seeds(), rng)
    prefixes = (b"\x01", b"\x00", b"")
    try:
        start = time.perf_counter()
        for i in range(n):
            frames = mutator.one()
            evil.send_multipart([prefixes[i % 3] + frames[0], *frames[1:]], zmq.NOBLOCK)
        result.messages = n
        # A last subscription, to everything: once a message published after it reaches us, the
        # PUB has read the whole flood (it reads a peer's frames in order).
        evil.send(b"\x01")

        def flood_read() -> bool:
            bc.pub.send(b"marker")
            return bool(evil.poll(0))

        wait_for(flood_read, 60, "the flood to be read", poll_s=0.01)
        result.seconds = time.perf_counter() - start
        sync = SyncLink("127.0.0.1", bc.cfg.announce_port, bc.cfg.join_port, "gen-ok", 1)
        try:
            ready = corpus.valid(WeightsReady)
            got: list[tuple[WeightsReady, bytes]] = []

            def heard() -> bool:
                bc.pub.send(encode(ready))
                got.extend(sync.poll())
                return bool(got)

            wait_for(heard, 10, "an announcement to reach a generator after the flood", poll_s=0.05)
        finally:
            sync.close()
    finally:
        evil.close(0)
        bc.close()
    return result


# ------------------------------------------------------------------------------ HTTP endpoints

METRICS_SEEDS = [
    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\nAccept-Encoding: gzip\r\n\r\n",
    b"GET /metrics?name[]=flywheel_hub_chunks_in HTTP/1.0\r\n\r\n",
    b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"OPTIONS /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    b"HEAD /metrics HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/2.0\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello
]


def http_specials(path: bytes) -> list[bytes]:
    return [
        b"GET " + path + b"x" * 70_000 + b" HTTP/1.1\r\n\r\n",  # request line too long
        b"GET " + path + b" HTTP/1.1\r\n" + b"X-A: b\r\n" * 120 + b"\r\n",  # too many headers
        b"GET " + path + b" HTTP/1.1\r\nX: " + b"y" * 70_000 + b"\r\n\r\n",  # header line too long
        b"\r\n",
        b"GET\r\n\r\n",
        b"BREW " + path + b" HTCPCP/1.0\r\n\r\n",
    ]


def rm_seeds(structured: list[bytes]) -> list[bytes]:
    """Requests for the reward-model server; JSON bodies of every shape from the hypothesis seeds."""
    import json

    import msgpack

    def post(body: bytes, path: bytes = b"/score", ctype: bytes = b"application/json") -> bytes:
        head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: " + ctype
        return head + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body

    out = [
        post(b'{"prompts": ["What is 1 + 1?"], "completions": [" 2"]}'),
        post(b'{"prompts": [], "completions": []}'),
        post(b'{"prompts": ["a", "b"], "completions": ["c"]}'),
        post(b'{"prompts": "a", "completions": ["c"]}'),
        post(b'{"prompts": [1], "completions": [null]}'),
        post(b"[" * 50_000 + b"]" * 50_000),  # deeper than the JSON parser recurses
        post(b'{"prompts": ["\xff\xfe"], "completions": ["x"]}'),
        post(b"not json"),
        post(b"", ctype=b"text/plain"),
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /score HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",
        b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    ]
    for raw in structured:
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            body = json.dumps(value, default=lambda o: o.hex() if isinstance(o, bytes) else repr(o)).encode()
        except Exception:  # not every seed is valid msgpack or JSON-able: only the others are used
            continue
        if isinstance(value, dict) and value:
            first, *rest = value.values()
            body = json.dumps({"prompts": first, "completions": rest[0] if rest else first}, default=repr).encode()
        out.append(post(body))
    return out


def http_statuses(data: bytes) -> list[int]:
    """Status codes of the responses in ``data`` (bodies skipped by their Content-Length)."""
    codes = []
    while data.startswith(b"HTTP/"):
        line_end, head_end = data.find(b"\r\n"), data.find(b"\r\n\r\n")
        try:
            codes.append(int(data[:line_end].split(b" ", 2)[1]))
        except (ValueError, IndexError):
            break
        if head_end < 0:
            break
        length = len(data)
        for line in data[:head_end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length" and value.strip().isdigit():
                length = int(value)
        data = data[head_end + 4 + length :]
    return codes


def http_flood(
    port: int, payloads: Iterator[bytes], concurrency: int = 4, half_close: bool = True, idle_s: float = 10.0
) -> Counter[str]:
    """Send each payload on a connection of its own and read the answer until the server closes.

    ``half_close``: shut our side after the payload, so that a server waiting for more knows
    there is none (http.server answers then; aiohttp closes at once, unanswered, so for it the
    payloads say ``Connection: close`` instead and a server still silent after ``idle_s`` is
    waiting for bytes that never come: outcome ``timeout``; give it a short ``idle_s``). Outcomes: ``http_<status>`` per
    response, ``no_response`` for a silent close, ``served_http09`` for a body without status,
    ``reset`` when the server reset the connection (it closed with our bytes unread, e.g. past
    a request line too long): an answer it sent may then be lost on the way.
    """
    sel = selectors.DefaultSelector()
    outcomes: Counter[str] = Counter()
    buffers: dict[socket.socket, list[bytes]] = {}
    last: dict[socket.socket, float] = {}
    resets: set[socket.socket] = set()

    def start() -> bool:
        payload = next(payloads, None)
        if payload is None:
            return False
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_WRITE, payload)
        return True

    def done(s: socket.socket, timed_out: bool) -> None:
        data = b"".join(buffers.pop(s))
        del last[s]
        codes = http_statuses(data)
        outcomes.update(f"http_{c}" for c in codes)
        reset = s in resets
        resets.discard(s)
        if codes:
            pass  # answered (a connection the server then kept open, idle, is no timeout)
        elif timed_out:
            outcomes["timeout"] += 1
        elif reset:
            outcomes["reset"] += 1
        else:
            outcomes["served_http09" if data else "no_response"] += 1
        sel.unregister(s)
        s.close()

    running = sum(start() for _ in range(concurrency))
    while running:
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if key.data is not None:  # connected: send it all (blocking, it is small)
                s.setblocking(True)
                with contextlib.suppress(OSError):
                    s.sendall(key.data)
                    if half_close:
                        s.shutdown(socket.SHUT_WR)
                s.setblocking(False)
                buffers[s], last[s] = [], time.monotonic()
                sel.modify(s, selectors.EVENT_READ, None)
                continue
            try:
                chunk = s.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                resets.add(s)
                chunk = b""
            if chunk:
                buffers[s].append(chunk)
                last[s] = time.monotonic()
                continue
            done(s, timed_out=False)
            running -= 1 - start()
        now = time.monotonic()
        for s in [s for s, t in last.items() if now - t > idle_s]:
            done(s, timed_out=True)
            running -= 1 - start()
    return outcomes


def http_payloads(seeds: list[bytes], n: int, rng: random.Random) -> Iterator[bytes]:
    mutator = Mutator(seeds, rng)
    sent = 0
    while sent < n:
        payload = b"".join(mutator.one())
        if payload:  # an empty connection asks nothing
            sent += 1
            yield payload


def _refused(outcomes: Counter[str]) -> Counter[str]:
    return Counter({k: v for k, v in outcomes.items() if k.startswith("http_") and int(k[5:]) >= 400})


def fuzz_hub_metrics(hub: HubRun, n: int, rng: random.Random) -> FuzzResult:
    """The hub's Prometheus endpoint: garbage requests each refused and counted by reason."""
    result = FuzzResult("hub /metrics HTTP")
    family = "flywheel_hub_http_rejected_total"
    before = hub.rejected(family)
    port = hub.cluster.ports["metrics_port"]
    start = time.perf_counter()
    seeds = METRICS_SEEDS + http_specials(b"/metrics")
    outcomes = http_flood(port, http_payloads(seeds, n, rng))
    result.seconds = time.perf_counter() - start
    result.messages = n
    result.expected = _refused(outcomes) + Counter(http_blank=outcomes["no_response"])
    result.undelivered_bound = outcomes["reset"] + outcomes["timeout"]
    result.note = f"outcomes: {dict(outcomes)}"
    hub.wait_counted(result, before, family)
    result.crashes = int(not hub.alive())
    return result


def fuzz_rm_server(tmp: Path, seeds: list[bytes], n: int, rng: random.Random) -> FuzzResult:
    """The reward-model server (a real process, aiohttp, a stub model)."""
    import json
    import urllib.request

    from flywheel.procs import Service, wait_for_state_file

    result = FuzzResult("reward-model server HTTP")
    state = tmp / "rm-fuzz.json"
    root = Path(__file__).resolve().parents[2]
    svc = Service("rm-fuzz", "tests.fuzz.rm_stub", [str(state)], tmp, env={"PYTHONPATH": str(root)})
    try:
        port = wait_for_state_file(state, svc, timeout_s=120)["port"]

        def refused() -> Counter[str]:
            body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read())
            return Counter(body["rejected"])

        start = time.perf_counter()
        payloads = http_payloads(rm_seeds(seeds) + http_specials(b"/score"), n, rng)
        outcomes = http_flood(port, payloads, concurrency=16, half_close=False, idle_s=0.3)
        result.seconds = time.perf_counter() - start
        result.messages = n
        result.expected = _refused(outcomes)  # the refusals the client saw
        result.undelivered_bound = outcomes["timeout"] + outcomes["reset"]
        result.note = f"outcomes: {dict(outcomes)}"
        want = result.expected.total()
        wait_for(lambda: refused().total() >= want, 60, f"{want} refusals counted")
        time.sleep(0.5)  # let refusals the client gave up on be counted too
        result.counted = refused()
        result.crashes = int(not svc.alive())
        # still works: a real request is scored
        body = json.dumps({"prompts": ["ab"], "completions": ["cde"]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/score", body, {"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(req, timeout=30).read()) == {"rewards": [5.0]}
        log = svc.log_path.read_text()
        # aiohttp logs each unparsable request with a traceback: here once per kind per 10 s
        assert log.count("Traceback") <= max(30, n // 100), svc.tail(40)
        assert "RecursionError" not in log and "http_500" not in result.counted, svc.tail(40)
    finally:
        svc.stop()
    return result
