"""The hub against real sockets and a real Redis: garbage, leases, duplicates, ordering."""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
import pytest
import redis
import zmq

from flywheel.hub_client import BatchClient
from flywheel.staleness import StalenessPolicy
from flywheel.store import RunKeys
from flywheel.wire import ChunkBatch, Lease, Release, Score, WireError, encode, pack_f32
from tests.conftest import Cluster, wait_until
from tests.integration.handgen import HandGenerator, expected_sample, make_chunk


def pump_until(gen: HandGenerator, predicate, what: str, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    def step() -> bool:
        gen.pump(0.05)
        return bool(predicate())

    wait_until(step, timeout_s, what, poll_s=0)


def metrics(cluster: Cluster) -> dict[str, float]:
    return cluster.metrics()


def rejected(cluster: Cluster, reason: str) -> float:
    return metrics(cluster).get(f'flywheel_hub_rejected_total{{reason="{reason}"}}', 0.0)


def test_garbage_is_counted_and_the_hub_keeps_serving(cluster: Cluster) -> None:
    cluster.start_hub(
        "--hub.max_message_bytes",
        "65536",
        "--async.groups_per_step",
        "2",
        "--data.n_samples_per_prompt",
        "2",
        "--hub.reject_log_interval_s",
        "60",
    )
    # A well-behaved generator first: what it gets acknowledged must survive the garbage.
    good = HandGenerator(cluster.gen_address, "good")
    good.register()
    lease = good.wait_lease()
    good.send(make_chunk(lease, 0, 0, version=0, final=True))
    pump_until(good, lambda: good.acked == 1, "ack of the good chunk")

    ctx = zmq.Context.instance()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(cluster.gen_address)
    for _ in range(50):
        evil.send(b"\x93\x01\x02")  # msgpack array, not a map
    evil.send(b"\xff" * 10)
    evil.send(msgspec.msgpack.encode({"type": "Chunk", "sv": 1, "lease_id": "x"}))
    evil.send(b"\x00" * 100_000)  # oversized
    evil.send_multipart([b"a", b"b"])  # three frames at the ROUTER
    evil.send(encode(make_chunk(lease, 1, 0, version=0, final=False, group=lease.group_id + 1000)))  # unknown lease
    positive_logprobs = msgspec.structs.replace(
        make_chunk(lease, 1, 0, version=0, final=False), logprobs=pack_f32([1, 1, 1, 1])
    )
    evil.send(encode(positive_logprobs))
    evil.send(encode(Score(worker_id="x", group_id=0, sample=0, reward=1.0)))  # a Score on the generator port
    # a lease given back twice in one Release, by its own generator (it crashed the hub): refused whole
    good.link._send(encode(Release(generator_id="good", lease_ids=[lease.lease_id, lease.lease_id])))

    wait_until(
        lambda: rejected(cluster, "oversized") >= 1 and rejected(cluster, "unknown_lease") >= 1,
        10,
        "rejections counted",
    )
    assert rejected(cluster, "malformed") >= 52
    wait_until(lambda: rejected(cluster, "invalid_field") >= 2, 10, "the Release naming a lease twice refused")
    assert rejected(cluster, "wrong_socket") >= 1
    assert cluster.hub is not None and cluster.hub.alive()
    # logged once per reason per interval, not once per message
    log = cluster.hub.log_path.read_text()
    assert len(re.findall(r"rejected malformed", log)) <= 2, log

    # The hub still works: finish the group, score it, serve it; the early chunk is intact.
    good.send(make_chunk(lease, 1, 0, version=0, final=True))
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, 2))
    wait_until(lambda: client.redis.zcard(client.keys.ready) >= 1, 20, "group ready")
    pairs, _ = client.try_claim(1, 0)
    group = client._load(pairs, 0)[0]
    assert [s.tokens.tolist() for s in group.samples] == [expected_sample(lease.group_id, s, 1) for s in range(2)]
    good.close()
    evil.close()


@pytest.mark.parametrize("hub_restart", [False, True])
def test_dead_generator_lease_is_reissued_for_unfinished_samples(cluster: Cluster, hub_restart: bool) -> None:
    """With ``hub_restart``, the hub is killed once the sample is re-issued and before its new
    lease sent anything: the restarted hub must not take the old lease's stored chunk (seq 0,
    still in Redis) for the new lease's seq 0."""
    args = (
        "--hub.generator_timeout_s",
        "1.5",
        "--data.n_samples_per_prompt",
        "2",
        "--async.groups_per_step",
        "1",
        "--async.max_staleness",
        "0",
    )
    ports = cluster.start_hub(*args)
    a = HandGenerator(cluster.gen_address, "gen-a")
    a.register()
    lease = a.wait_lease()
    assert lease.samples == [0, 1] and lease.min_version == 0
    a.send(make_chunk(lease, 0, 0, 0, final=True), make_chunk(lease, 1, 0, 0, final=False))
    pump_until(a, lambda: a.acked == 2, "acks for gen-a")

    b = HandGenerator(cluster.gen_address, "gen-b")
    b.register()
    b.pump(0.5)
    assert not b.leases, "η = 0 admits one step of groups: nothing more to lease yet"
    b.send(make_chunk(lease, 1, 1, 0, final=True))  # gen-a's lease: not gen-b's to write
    pump_until(b, lambda: b.rejected == 1, "rejection of a chunk for someone else's lease")
    # gen-a goes silent; after generator_timeout_s its unfinished sample is re-issued to gen-b
    re_lease = b.wait_lease(timeout_s=10)
    assert re_lease.group_id == lease.group_id and re_lease.samples == [1] and re_lease.lease_id != lease.lease_id
    # gen-a comes back too late: its chunk for the old lease is refused, not merged
    a.send(make_chunk(lease, 1, 1, 0, final=True))
    pump_until(a, lambda: a.rejected == 1, "rejection of the stale lease's chunk")
    if hub_restart:
        assert cluster.hub is not None
        cluster.hub.kill9()
        cluster.start_hub(*args, ports=ports)

    b.send(make_chunk(re_lease, 1, 0, 0, final=False), make_chunk(re_lease, 1, 1, 0, final=True))
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(0, 1))
    pump_until(b, lambda: client.redis.zcard(client.keys.ready) >= 1, "group ready")
    batch = client.claim(1, 0, timeout_s=5)
    tokens = [s.tokens.tolist() for s in batch.groups[0].samples]
    assert tokens == [expected_sample(lease.group_id, 0, 1), expected_sample(lease.group_id, 1, 2)]
    assert client.counters()["leases_reissued"] == 1
    a.close()
    b.close()


def test_a_generator_back_under_its_id_takes_over_a_connection_still_open(cluster: Cluster) -> None:
    """A generator restarted (or a spare taking its place) while the hub still holds the old
    connection under the same id (a frozen process, a half-open TCP connection): the new one
    gets through at once and its registration re-issues the old leases."""
    cluster.start_hub(
        "--data.n_samples_per_prompt",
        "1",
        "--algo.advantage.estimator",
        "reinforce_pp",
        "--async.groups_per_step",
        "1",
        "--async.max_staleness",
        "0",
    )
    old = HandGenerator(cluster.gen_address, "gen-x")
    old.register()
    lease = old.wait_lease()
    new = HandGenerator(cluster.gen_address, "gen-x")  # `old` stays connected: nothing told the hub
    new.register()
    again = new.wait_lease(timeout_s=5)
    assert again.group_id == lease.group_id and again.lease_id != lease.lease_id
    new.send(make_chunk(again, 0, 0, 0, final=True))
    pump_until(new, lambda: new.acked == 1, "ack for the generator back under its id")
    old.close()
    new.close()


def test_a_lease_the_hub_took_back_without_a_revoke_is_dropped_at_its_first_rejected_chunk(cluster: Cluster) -> None:
    """A lease re-issued with no Revoke (here: a second Register from a live generator, as a late
    RegisterAgain can cause; a Revoke dropped at the hub's high-water mark ends the same way): the
    generator learns it from the rejection of the lease's next chunk and stops generating it,
    instead of holding the slot and listing the lease in every heartbeat."""
    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1", "--async.max_staleness", "0")
    g = HandGenerator(cluster.gen_address, "gen-twice", capacity=1)
    g.register()
    lease = g.wait_lease()
    g.send(make_chunk(lease, 0, 0, 0, final=False))
    pump_until(g, lambda: g.acked == 1, "the first chunk acked")
    g.register()  # the hub re-issues the lease and sends no Revoke: this generator asked for it
    g.send(make_chunk(lease, 0, 1, 0, final=False))
    pump_until(g, lambda: g.rejected == 1, "the old lease's chunk rejected")
    assert lease.lease_id in g.revoked and lease.lease_id not in g.link.lease_ids
    assert rejected(cluster, "unknown_lease") == 1
    g.close()


def test_a_rejected_chunk_of_a_samples_old_lease_leaves_its_new_lease_alone(cluster: Cluster) -> None:
    """A sample re-issued to the same generator restarts at seq 0 under a new lease, so a chunk of
    the old lease and one of the new share (group, sample, seq). The old one's rejection used to
    take the new one's place in the resend map and drop the new lease as gone."""
    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1", "--async.max_staleness", "0")
    g = HandGenerator(cluster.gen_address, "gen-again", capacity=1)
    g.register()
    old = g.wait_lease()
    g.register()  # the hub re-issues the group's samples to us under a new lease (no Revoke)
    new = g.wait_lease()
    assert (new.group_id, new.lease_id) == (old.group_id, old.lease_id + 1)
    # the new lease's seq 1 in flight (sent, not yet acknowledged), and the old lease's seq 1 resent
    ours = make_chunk(new, 0, 1, 0, final=False)
    g.link.unacked[(ours.group_id, ours.sample, ours.seq)] = (ours, time.monotonic(), False)
    g.link.sock.send(encode(ChunkBatch(generator_id="gen-again", chunks=[make_chunk(old, 0, 1, 0, final=False)])))
    wait_until(lambda: rejected(cluster, "unknown_lease") == 1, 15, "the old lease's chunk rejected")
    pump_until(g, lambda: old.lease_id in g.revoked, "the old lease dropped at its chunk's rejection")
    assert new.lease_id in g.link.lease_ids and new.lease_id not in g.revoked, "the new lease was dropped"
    assert (ours.group_id, ours.sample, ours.seq) in g.link.unacked
    g.close()


def test_a_register_again_answering_a_heartbeat_sent_before_the_last_register_is_ignored(cluster: Cluster) -> None:
    """Evicted, a generator's next heartbeats each get a RegisterAgain. It registers at the first;
    the others answer heartbeats sent before that Register, and a second Register would make the
    hub re-issue its new leases. The hub now echoes the heartbeat's registration count, so they
    are told apart whatever the timing (a time guard of two heartbeat periods did it before)."""
    cluster.start_hub("--hub.generator_timeout_s", "1", "--async.groups_per_step", "1")
    g = HandGenerator(cluster.gen_address, "gen-evicted", capacity=1)
    g.register()
    g.wait_lease()
    g.link.heartbeat_s = 0.0  # (the old guard: a RegisterAgain later than two periods counts)
    wait_until(lambda: metrics(cluster).get("flywheel_hub_generators_evicted_total", 0) == 1, 15, "the eviction")
    g.link.heartbeat(force=True)
    g.link.heartbeat(force=True)  # two heartbeats of registration 1: two RegisterAgains
    time.sleep(1.0)  # both answers wait at the generator's socket
    g.pump(1.0, heartbeat=False)
    wait_until(lambda: metrics(cluster).get("flywheel_hub_generator_registrations_total", 0) == 2, 10, "2 Registers")
    time.sleep(0.5)
    assert metrics(cluster).get("flywheel_hub_generator_registrations_total", 0) == 2
    g.close()


def test_a_draining_generator_told_to_register_again_gets_no_new_lease(cluster: Cluster) -> None:
    """A generator stopping (drained) that the hub counted as gone meanwhile, or that a restarted
    hub no longer knows, is told to register again. A Register says nothing of the draining, so the
    hub took it for a fresh generator and leased to it, each lease sent straight back (or held
    until the lease timed out, once the generator was gone). Its draining heartbeat now follows
    the Register."""
    cluster.start_hub("--hub.generator_timeout_s", "1", "--async.groups_per_step", "1")
    g = HandGenerator(cluster.gen_address, "gen-stopping", capacity=1)
    g.register()
    g.wait_lease()
    g.link.drain()  # stopping: it finishes (here: gives back) what it holds and wants no more
    g.link.release(sorted(g.link.lease_ids))
    g.pump(0.3)
    # silent past the timeout: gone, as a drained generator leaves (a hub restart forgets it alike)
    wait_until(lambda: metrics(cluster).get("flywheel_hub_generators_departed_total", 0) == 1, 15, "its departure")
    held = len(g.leases)
    g.link.heartbeat(force=True)  # answered by a RegisterAgain
    g.pump(1.0)
    assert metrics(cluster).get("flywheel_hub_generator_registrations_total", 0) == 2, "it never registered again"
    g.pump(2.0)
    assert len(g.leases) == held, "the hub leased to a generator that is stopping"
    g.close()


def test_lease_past_its_deadline_is_revoked_and_reissued(cluster: Cluster) -> None:
    cluster.start_hub(
        "--hub.lease_timeout_s",
        "1.0",
        "--data.n_samples_per_prompt",
        "1",
        "--algo.advantage.estimator",
        "reinforce_pp",  # one sample per prompt: a group estimator refuses it
        "--async.groups_per_step",
        "1",
        "--async.max_staleness",
        "0",
    )
    g = HandGenerator(cluster.gen_address, "slow")
    g.register()
    lease = g.wait_lease()
    g.link.lease_ids.clear()  # alive (heartbeats) but no longer reporting the lease as running
    second = g.wait_lease(timeout_s=10)
    assert lease.lease_id in g.revoked
    assert second.group_id == lease.group_id and second.lease_id != lease.lease_id
    g.close()


def test_duplicates_and_out_of_order_chunks(cluster: Cluster) -> None:
    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1")
    g = HandGenerator(cluster.gen_address, "gen")
    g.register()
    lease = g.wait_lease()
    c0, c1, c2 = (make_chunk(lease, 0, s, 0, final=(s == 2)) for s in range(3))
    g.send(c2)  # the last chunk first
    g.send(c0, c0)  # a duplicate inside one batch
    g.send(c1)
    g.send(c1, c0)  # duplicates of durable chunks: acknowledged again, stored once
    pump_until(g, lambda: g.acked == 3 and not g.link.unacked, "every chunk acknowledged (duplicates too)")
    g.send(make_chunk(lease, 0, 3, 0, final=False))  # past the end of a finished sample
    g.send(make_chunk(lease, 1, 1, 0, final=True))
    g.send(make_chunk(lease, 1, 0, 0, final=True))  # a second final chunk for the same sample
    pump_until(g, lambda: g.rejected == 2 and g.acked == 4, "rejections of the bad chunks")
    g.send(make_chunk(lease, 1, 0, 0, final=False))
    pump_until(g, lambda: g.acked == 5, "sample 1 complete")

    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, 1))
    batch = client.claim(1, 0, timeout_s=20)
    samples = batch.groups[0].samples
    assert samples[0].tokens.tolist() == expected_sample(lease.group_id, 0, 3)  # in sequence order
    assert samples[1].tokens.tolist() == expected_sample(lease.group_id, 1, 2)
    assert samples[0].finish_reason == "stop" and samples[0].version == 0
    m = metrics(cluster)
    assert m["flywheel_hub_duplicate_chunks_total"] >= 3
    assert m["flywheel_hub_chunks_in_total"] == 5  # 3 + 2 chunks: each stored once
    assert int(cluster.redis.client().hget(RunKeys("flywheel").counters, "chunks_persisted") or 0) == 5
    assert rejected(cluster, "second_final_chunk") == 1
    assert rejected(cluster, "seq_after_final") == 1
    g.close()


def test_a_backlog_of_chunks_goes_out_in_frames_the_hub_accepts(cluster: Cluster) -> None:
    """Tokens held back by flow control or a hub restart go out at once: in one frame, past the
    hub's message limit, they were refused whole, on every resend, and never acknowledged."""
    cluster.start_hub(
        "--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1", "--hub.max_message_bytes", "4096",
        "--rollout.max_tokens", "2048",
    )  # fmt: skip
    g = HandGenerator(cluster.gen_address, "gen", max_message_bytes=4096)
    g.register()
    lease = g.wait_lease()
    backlog = [make_chunk(lease, s, seq, 0, final=False, n=64) for s in (0, 1) for seq in range(20)]  # ~40 KB
    g.link.send_chunks(backlog)
    pump_until(g, lambda: g.acked == len(backlog) and not g.link.unacked, "the whole backlog acknowledged")
    assert rejected(cluster, "oversized") == 0
    g.close()


def test_a_sample_past_its_leases_max_tokens_is_refused(cluster: Cluster) -> None:
    """What a generator sends for one sample is bounded by the lease's max_tokens: a buggy or
    hostile one grew a sample without limit in the hub's memory and in Redis, then in a batch."""
    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1", "--rollout.max_tokens", "8")
    g = HandGenerator(cluster.gen_address, "gen")
    g.register()
    lease = g.wait_lease()
    g.send(make_chunk(lease, 0, 0, 0, final=False, n=4), make_chunk(lease, 0, 1, 0, final=False, n=4))
    pump_until(g, lambda: g.acked == 2, "the first 8 tokens acknowledged")
    g.send(make_chunk(lease, 0, 2, 0, final=True, n=1))
    pump_until(g, lambda: g.rejected == 1, "the ninth token refused")
    assert rejected(cluster, "over_max_tokens") == 1
    g.close()


def test_hub_warns_when_redis_keeps_no_aof(cluster: Cluster) -> None:
    cluster.redis.client().config_set("appendonly", "no")
    cluster.start_hub()
    assert cluster.hub is not None
    wait_until(lambda: "without append-only persistence" in cluster.hub.log_path.read_text(), 10, "the AOF warning")  # type: ignore[union-attr]


def test_metrics_endpoint_reports_queues_and_rates(cluster: Cluster) -> None:
    cluster.start_hub("--async.groups_per_step", "2")
    cluster.start_simgen("sim", "--min-len", "8", "--max-len", "32", "--tokens-per-s", "5000")
    cluster.start_reward()
    wait_until(lambda: metrics(cluster).get("flywheel_hub_groups_ready_total", 0) >= 2, 30, "groups ready")
    m = metrics(cluster)
    for key in (
        "flywheel_hub_ingest_tokens_per_s",
        "flywheel_hub_open_groups",
        "flywheel_hub_active_leases",
        "flywheel_hub_ready_groups",
        "flywheel_hub_learner_version",
        "flywheel_hub_tokens_in_total",
        "flywheel_hub_leases_reissued_total",
        "flywheel_hub_groups_dropped_total",
    ):
        assert key in m, key
    assert m["flywheel_hub_tokens_in_total"] > 0
    # the anatomy of a turn that acknowledged chunks: its Redis write is part of it
    assert m["flywheel_hub_turn_chunks_p50"] >= 1
    assert 0 < m["flywheel_hub_turn_write_ms_p50"] <= m["flywheel_hub_turn_durable_ms_p99"]
    keys = RunKeys("flywheel")
    assert cluster.redis.client().config_get("appendonly")["appendonly"] == "yes"
    assert cluster.redis.client().exists(keys.counters)
    time.sleep(1.2)
    log = cluster.hub.log_path.read_text() if cluster.hub else ""
    assert "tok/s" in log
    assert "without append-only persistence" not in log  # the test Redis runs with AOF


def test_a_stalled_hub_evicts_nobody_whose_heartbeat_waits_in_its_backlog(cluster: Cluster) -> None:
    """The hub stops reading for longer than the generator timeout (a stall: here SIGSTOP). Its
    first turns after it takes at most max_turn_items messages: it evicted every generator whose
    heartbeat still waited unread behind the others' chunks, re-issuing their leases (and on
    their next heartbeat they registered again, dropping their work). The hub's own stall now
    counts against no one, a generator's chunks say it is alive as its heartbeats do, and nobody
    is evicted while input waits unread."""
    import os
    import signal

    cluster.start_hub("--hub.generator_timeout_s", "3", "--hub.max_turn_items", "4", "--async.max_staleness", "8")
    for i in range(3):
        cluster.start_simgen(f"sim{i}", "--min-len", "40", "--max-len", "400", "--capacity", "8", "--seed", str(i))
    wait_until(lambda: cluster.metrics()["flywheel_hub_generators"] == 3, 60, "three generators")
    wait_until(lambda: cluster.metrics()["flywheel_hub_chunks_in_total"] > 50, 60, "chunks flowing")
    assert cluster.hub is not None
    os.kill(cluster.hub.pid, signal.SIGSTOP)
    try:
        time.sleep(6)
    finally:
        os.kill(cluster.hub.pid, signal.SIGCONT)
    time.sleep(6)
    m = cluster.metrics()
    assert m["flywheel_hub_generators_evicted_total"] == 0, cluster.hub.tail(30)
    assert m["flywheel_hub_generators"] == 3


def test_a_lease_whose_message_was_lost_is_sent_again_not_held_until_its_timeout(cluster: Cluster) -> None:
    """A ROUTER drops what it cannot deliver (a generator reconnecting): a lease the generator's
    heartbeats never list, with no chunk of it come, goes out again within seconds, not after
    hub.lease_timeout_s (60 s here) with its slot and its group held all along."""
    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "1", "--async.max_staleness", "0")
    g = HandGenerator(cluster.gen_address, "gen-lossy", capacity=1)
    lost: list[Lease] = []

    class LosesTheFirstLease:  # the message is gone before the generator could act on it
        def __init__(self, decoder: Any) -> None:
            self.decoder = decoder

        def decode(self, frame: bytes) -> Any:
            msg = self.decoder.decode(frame)
            if isinstance(msg, Lease) and not lost:
                lost.append(msg)
                raise WireError("lost", "lease", "dropped by the test")
            return msg

    g.link.decoder = LosesTheFirstLease(g.link.decoder)
    g.register()
    again = g.wait_lease(timeout_s=10)
    assert lost and (again.lease_id, again.group_id, again.samples) == (
        lost[0].lease_id,
        lost[0].group_id,
        lost[0].samples,
    )
    assert metrics(cluster)["flywheel_hub_leases_resent_total"] == 1
    for s in again.samples:
        g.send(make_chunk(again, s, 0, 0, final=True))
    pump_until(g, lambda: metrics(cluster)["flywheel_hub_samples_completed_total"] == 2, "its samples complete")
    g.pump(2.5)  # heartbeats that no longer list it: finished (its chunks came), not lost
    assert metrics(cluster)["flywheel_hub_leases_resent_total"] == 1
    g.close()


def test_a_lease_sent_again_runs_once_on_the_generator() -> None:
    """The hub's second copy of a lease the generator holds or has finished is not work again."""
    from flywheel.wire import SamplingParams, pack_i32
    from generators.hub_link import HubLink

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = HubLink(f"tcp://127.0.0.1:{port}", "gen-dup", "hand", 2)
    try:
        link.register(0)
        identity, _ = router.recv_multipart()
        lease = Lease(
            lease_id=7, group_id=3, prompt_tokens=pack_i32([1, 2]), samples=[0], sampling=SamplingParams(),
            min_version=0, deadline=time.time() + 60,
        )  # fmt: skip

        def deliver() -> list[Lease]:
            router.send_multipart([identity, encode(lease)])
            return wait_until(lambda: link.poll(50).leases or None, 5, "the lease", poll_s=0)

        assert [x.lease_id for x in deliver()] == [7]
        seen: list[Lease] = []

        def copies(n: int) -> bool:
            seen.extend(link.poll(20).leases)
            return link.duplicate_leases == n

        router.send_multipart([identity, encode(lease)])  # a copy while it runs
        wait_until(lambda: copies(1), 10, "the copy taken for one", poll_s=0)
        link.lease_done(7)
        router.send_multipart([identity, encode(lease)])  # a copy after it finished
        wait_until(lambda: copies(2), 10, "the second copy taken for one", poll_s=0)
        assert seen == []
    finally:
        link.close()
        router.close(0)


def test_a_generator_stopping_sends_what_it_finished_before_it_gives_the_rest_back(cluster: Cluster) -> None:
    """At a stop the generator service gave its leases back first and flushed after, by then with
    nothing left to send: samples, and whole leases, finished before the stop were lost and
    generated again elsewhere. Real hub, the service's own shutdown over a real link."""
    import asyncio

    from flywheel.config import load_config
    from generators.service import GeneratorService, SampleRun

    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "2", "--async.max_staleness", "0")
    g = HandGenerator(cluster.gen_address, "gen-stop", capacity=2)
    g.register()
    pump_until(g, lambda: len(g.leases) == 2, "two leases")
    a, b = g.leases

    def run(lease: Lease, sample: int, finished: bool) -> SampleRun:
        r = SampleRun(lease, sample)
        r.add([5, 6, 7], [-0.5] * 3, 0)
        r.finish = "stop" if finished else None
        return r

    service = GeneratorService(load_config([]), None, g.link, None, "gen-stop", 4096)
    service.samples = {
        a.lease_id: {0: run(a, 0, True), 1: run(a, 1, False)},  # half done: sample 1 goes back
        b.lease_id: {0: run(b, 0, True), 1: run(b, 1, True)},  # done, not yet retired by a tick
    }
    asyncio.run(service._shutdown())
    wait_until(lambda: metrics(cluster)["flywheel_hub_leases_released_total"] == 1, 10, "the unfinished lease back")
    m = metrics(cluster)
    assert m["flywheel_hub_samples_completed_total"] == 3 and m["flywheel_hub_leases_reissued_total"] == 1
    g.close()


def test_a_generator_that_fails_gives_its_leases_back_at_once(cluster: Cluster) -> None:
    """A failing generator (a wedged engine, a failed update) said nothing to the hub: its leases
    waited out hub.generator_timeout_s (15 s by default) before anyone else could take them."""
    import asyncio

    from flywheel.config import load_config
    from generators.service import GeneratorService, SampleRun

    cluster.start_hub("--data.n_samples_per_prompt", "2", "--async.groups_per_step", "2", "--async.max_staleness", "0")
    g = HandGenerator(cluster.gen_address, "gen-fails", capacity=2)
    g.register()
    pump_until(g, lambda: len(g.leases) == 2, "two leases")
    service = GeneratorService(load_config([]), None, g.link, None, "gen-fails", 4096)
    service.samples = {lease.lease_id: {0: SampleRun(lease, 0)} for lease in g.leases}

    async def wedged(max_seconds: float | None) -> None:
        raise RuntimeError("the engine gave no token")

    service._serve = wedged  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no token"):
        asyncio.run(service.run())
    wait_until(lambda: metrics(cluster)["flywheel_hub_leases_released_total"] == 2, 10, "both leases given back")
    g.close()


def test_an_idle_hub_reads_redis_every_refresh_period(cluster: Cluster) -> None:
    """With nothing to do, the hub still follows the learner's version (and its drops) in Redis,
    every REFRESH_S (50 ms). It did so every tick (5 ms): the refresh never noted that it had
    run, so an idle hub sent Redis about 850 commands a second (now about 95)."""
    cluster.start_hub()
    r = redis.Redis.from_url(cluster.redis.url)
    time.sleep(3.0)  # started, its first turns done
    before = r.info("stats")["total_commands_processed"]
    time.sleep(2.0)
    per_s = (r.info("stats")["total_commands_processed"] - before - 1) / 2.0  # (less this INFO)
    assert per_s < 250, f"an idle hub sent Redis {per_s:.0f} commands a second"
