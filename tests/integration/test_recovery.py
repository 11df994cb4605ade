"""Crash safety: kill -9 the hub mid-stream, restart it, and lose nothing acknowledged; and
racing consumers never share a group."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from pathlib import Path
from typing import Any

from flywheel.hub_client import BatchClient
from flywheel.staleness import StalenessPolicy
from flywheel.wire import Lease
from tests.conftest import Cluster, wait_until
from tests.integration.handgen import HandGenerator, expected_sample, make_chunk

N_SAMPLES = 2


def chunks_in_sample(group: int, sample: int) -> int:
    return 3 + (group * 5 + sample * 3) % 6  # 3..8 chunks, fixed per (group, sample)


class Streamer:
    """Streams every leased sample one chunk per turn, deterministic content; records acks."""

    def __init__(self, gen: HandGenerator) -> None:
        self.gen = gen
        self.next_seq: dict[tuple[int, int], int] = {}
        self.leases: dict[int, Lease] = {}
        self.acked_groups: set[int] = set()

    def turn(self) -> None:
        self._exchange()
        chunks = []
        for (lease_id, s), seq in list(self.next_seq.items()):
            lease = self.leases.get(lease_id)
            if lease is None:
                del self.next_seq[(lease_id, s)]
                continue
            total = chunks_in_sample(lease.group_id, s)
            chunks.append(make_chunk(lease, s, seq, version=0, final=seq == total - 1))
            if seq == total - 1:
                del self.next_seq[(lease_id, s)]
            else:
                self.next_seq[(lease_id, s)] = seq + 1
        if chunks:
            self.gen.send(*chunks)
        self._exchange()

    def _exchange(self) -> None:
        before = set(self.gen.link.unacked)
        inbox = self.gen.pump(0.01)
        self.acked_groups |= {k[0] for k in before - set(self.gen.link.unacked)}
        for lease in inbox.leases:
            self.leases[lease.lease_id] = lease
            for s in lease.samples:
                self.next_seq[(lease.lease_id, s)] = 0
        for lease_id in inbox.revoked:
            self.leases.pop(lease_id, None)


def test_kill9_hub_mid_stream_loses_nothing_acknowledged(cluster: Cluster) -> None:
    args = (
        "--async.max_staleness",
        "1000",
        "--async.groups_per_step",
        "2",
        "--data.n_samples_per_prompt",
        str(N_SAMPLES),
        "--hub.generator_timeout_s",
        "20",
        "--data.epochs",
        "3",
    )
    ports = cluster.start_hub(*args)
    gen = HandGenerator(cluster.gen_address, "streamer", capacity=6, resend_after_s=0.3)
    gen.register()
    streamer = Streamer(gen)
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1000, 2))
    served: list[int] = []

    def consume() -> None:
        pairs, _ = client.try_claim(2, 0)
        if pairs:
            for group in client._load(pairs, 0):
                served.append(group.group_id)
                for s, sample in enumerate(group.samples):
                    assert sample.tokens.tolist() == expected_sample(
                        group.group_id, s, chunks_in_sample(group.group_id, s)
                    ), f"group {group.group_id} sample {s} corrupted"

    deadline = time.monotonic() + 20
    while len(served) < 10:
        assert time.monotonic() < deadline, "stream did not start"
        streamer.turn()
        consume()
    assert cluster.hub is not None
    cluster.hub.kill9()  # mid-stream: leases out, chunks in flight, samples half-assembled
    acked_before_kill = set(streamer.acked_groups)
    for _ in range(20):  # keep streaming into the void: these chunks stay unacked
        streamer.turn()
    cluster.start_hub(*args, ports=ports)
    deadline = time.monotonic() + 60
    while not acked_before_kill <= set(served):
        assert time.monotonic() < deadline, (
            f"groups acknowledged before the crash never served: {sorted(acked_before_kill - set(served))}"
        )
        streamer.turn()
        consume()
    assert len(served) == len(set(served)), "a group was served twice"
    assert client.counters()["groups_consumed"] == len(served)
    gen.close()


def _race(url: str, out: str, target: int, seed: int, barrier: Any) -> None:
    import redis

    client = BatchClient(redis.Redis.from_url(url, socket_timeout=10), "flywheel", StalenessPolicy(1000, 2))
    barrier.wait(timeout=60)  # start together, on a backlog of ready groups
    rng = random.Random(seed)
    got = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and int(client.redis.hget(client.keys.counters, "groups_consumed") or 0) < target:
        pairs, _ = client.try_claim(rng.choice([1, 2, 3]), 0)
        got += [gid for gid, _ in pairs]
    Path(out).write_text(" ".join(map(str, got)))


def test_two_racing_consumers_never_get_the_same_group(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_hub(
        "--async.max_staleness",
        "1000",
        "--async.groups_per_step",
        "4",
        "--data.n_samples_per_prompt",
        "1",
        "--algo.advantage.estimator",
        "reinforce_pp",  # one sample per prompt: a group estimator refuses it
        "--data.epochs",
        "20",
    )
    for i in range(2):
        cluster.start_simgen(f"sim{i}", "--min-len", "4", "--max-len", "12", "--capacity", "16", "--seed", str(i))
    cluster.start_reward()
    target = 200
    r = cluster.redis.client()
    wait_until(lambda: r.zcard("fw:{flywheel}:ready") >= 100, 60, "a backlog of 100 ready groups")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    outs = [tmp_path / f"consumer{i}.txt" for i in range(2)]
    procs = [ctx.Process(target=_race, args=(cluster.redis.url, str(outs[i]), target, i, barrier)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
        assert p.exitcode == 0
    a, b = ({int(x) for x in o.read_text().split()} for o in outs)
    assert a and b, "both consumers should have won some claims"
    assert not a & b, f"groups served twice: {sorted(a & b)}"
    consumed = int(cluster.redis.client().hget("fw:{flywheel}:counters", "groups_consumed") or 0)
    assert len(a) + len(b) == consumed >= target


def test_redis_kill9_stops_the_hub_and_a_restart_loses_nothing_acknowledged(cluster: Cluster) -> None:
    args = (
        "--async.max_staleness",
        "1000",
        "--async.groups_per_step",
        "2",
        "--data.n_samples_per_prompt",
        str(N_SAMPLES),
    )
    ports = cluster.start_hub(*args)
    gen = HandGenerator(cluster.gen_address, "streamer", capacity=4, resend_after_s=0.3)
    gen.register()
    streamer = Streamer(gen)
    for _ in range(40):
        streamer.turn()
    acked = set(streamer.acked_groups)
    assert acked, "some chunks should be acknowledged before the crash"
    redis_dir, redis_port = cluster.redis.dir, cluster.redis.port
    cluster.redis.proc.kill()  # kill -9 of Redis itself: acknowledged writes must be in the AOF
    cluster.redis.proc.wait(timeout=10)
    assert cluster.hub is not None
    deadline = time.monotonic() + 30
    while cluster.hub.alive():  # its next write fails: it must stop, not ack from memory
        assert time.monotonic() < deadline, "hub kept running without Redis"
        streamer.turn()
    assert cluster.hub.proc.returncode == 3
    assert "exiting so that a restart recovers from Redis" in cluster.hub.log_path.read_text()

    from flywheel.redis_server import RedisServer

    cluster.redis = RedisServer(redis_dir, port=redis_port)  # same AOF, same port
    try:
        cluster.start_hub(*args, ports=ports)
        cluster.start_reward()
        client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1000, 2))
        served: set[int] = set()
        deadline = time.monotonic() + 60
        while not acked <= served:
            assert time.monotonic() < deadline, f"acknowledged groups lost: {sorted(acked - served)}"
            streamer.turn()
            pairs, _ = client.try_claim(1, 0)
            for group in client._load(pairs, 0):
                for s, sample in enumerate(group.samples):
                    assert sample.tokens.tolist() == expected_sample(
                        group.group_id, s, chunks_in_sample(group.group_id, s)
                    )
                served.add(group.group_id)
    finally:
        gen.close()
        cluster.redis.stop()


def test_a_sample_reissued_just_before_the_kill_starts_over_after_the_restart(cluster: Cluster) -> None:
    """A sample re-issued to a new lease, the hub killed before any of the new lease's chunks:
    the restarted hub kept the old lease's token count, so the new generator's chunks ran past
    rollout.max_tokens and were refused (over_max_tokens) while its heartbeats kept the lease."""
    args = (
        *("--async.max_staleness", "0", "--async.groups_per_step", "1", "--data.n_samples_per_prompt", "2"),
        *("--rollout.max_tokens", "40", "--hub.generator_timeout_s", "1", "--data.shuffle", "false"),
    )
    ports = cluster.start_hub(*args)
    first = HandGenerator(cluster.gen_address, "first")
    first.register()
    lease = first.wait_lease()
    first.send(*[make_chunk(lease, 0, seq, version=0, final=False, n=10) for seq in range(3)])  # 30 of 40 tokens
    wait_until(lambda: first.pump(0.05) is not None and first.acked == 3, 10, "30 tokens acknowledged")
    second = HandGenerator(cluster.gen_address, "second")
    second.register()
    relet = second.wait_lease(timeout_s=20)  # `first` is silent: its lease goes to `second`
    assert relet.group_id == lease.group_id and relet.lease_id != lease.lease_id
    assert cluster.hub is not None
    cluster.hub.proc.kill()  # before any chunk of the new lease
    cluster.hub.proc.wait(timeout=10)
    cluster.start_hub(*args, ports=ports)
    second.send(
        *[make_chunk(relet, s, seq, version=0, final=seq == 2, n=10) for s in relet.samples for seq in range(3)]
    )
    wait_until(lambda: second.pump(0.05) is not None and second.acked + second.rejected >= 6, 20, "the answers")
    assert (second.acked, second.rejected) == (6, 0)
    first.close()
    second.close()


def test_an_open_group_redis_lost_is_counted_as_dropped_not_held_for_good(cluster: Cluster) -> None:
    """A group the hub had open whose data Redis no longer holds (evicted under maxmemory, or
    deleted by hand) while the hub was down: recovery forgot it without counting it dropped, so
    it held its slot under the staleness bound for good. At η = 0 and one group a step, that
    was the only slot: no lease ever again."""
    import redis

    from flywheel.store import RunKeys

    args = (
        *("--async.max_staleness", "0", "--async.groups_per_step", "1", "--data.n_samples_per_prompt", "2"),
        *("--hub.generator_timeout_s", "1",),
    )  # fmt: skip
    ports = cluster.start_hub(*args)
    gen = HandGenerator(cluster.gen_address, "g0")
    gen.register()
    lease = gen.wait_lease()
    assert cluster.hub is not None
    cluster.hub.proc.kill()
    cluster.hub.proc.wait(timeout=10)
    r, keys = redis.Redis.from_url(cluster.redis.url), RunKeys("flywheel")
    assert r.delete(keys.group(lease.group_id)) == 1
    cluster.start_hub(*args, ports=ports)
    gen.close()
    again = HandGenerator(cluster.gen_address, "g1")
    again.register()
    fresh = again.wait_lease(timeout_s=20)
    assert fresh.group_id != lease.group_id
    counters = {k.decode(): int(v) for k, v in r.hgetall(keys.counters).items()}
    assert counters["groups_dropped"] == 1 and counters["groups_lost_in_redis"] == 1
    again.close()


def test_a_hub_restarted_on_other_prompts_refuses_to_go_on(cluster: Cluster) -> None:
    """The run's prompt position (epoch, cursor) counts rows of the order the data and data.seed
    make. A hub restarted with another seed (or other data) went on from the same cursor in
    another order, repeating some prompts and skipping others in silence; one with fewer rows
    than the cursor crashed at every restart. Now it refuses, naming what changed (exit 2: the
    launcher does not restart a refused configuration); the same prompts go on."""
    import pytest

    cluster.start_hub()
    g = HandGenerator(cluster.gen_address, "g0")
    g.register()
    g.wait_lease()  # a group issued: the run began
    g.close()
    cluster.hub.stop()
    with pytest.raises(RuntimeError, match=r"exited \(2\)[\s\S]*changed since it began \(data.seed 0 -> 1\)"):
        cluster.start_hub("--data.seed", "1")
    cluster.start_hub()  # the prompts it began with: on it goes
