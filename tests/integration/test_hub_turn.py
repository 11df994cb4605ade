"""One hub turn at a time: the hub built in this process on a real Redis, real ZeroMQ sockets
to it, and its turn's steps called in the order its loop calls them. For what no timing of a
separate process can pin down: two things that happen in the same turn."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis
import zmq

from buffer import recovery
from buffer.hub import Hub
from buffer.prompts import PromptSource
from flywheel.config import load_config
from flywheel.redis_server import RedisServer
from flywheel.wire import ChunkAck, Decoder, Heartbeat, Lease, Message, Register, Release, ToGenerator, encode
from tests.integration.handgen import make_chunk


class TurnByTurn:
    """The hub, and one generator's DEALER socket to it (routing id ``gen``)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, b"gen")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{hub.ports['generator_port']}")
        self.decoder = Decoder(ToGenerator)

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def take(self, messages: int = 1) -> None:
        """The first half of a turn: the hub takes the ``messages`` sent last (none of them
        single chunks of a batch), all in this one turn."""
        poller = zmq.Poller()
        poller.register(self.hub.gen_sock, zmq.POLLIN)
        self.hub._turn_items = 0
        deadline = time.monotonic() + 30
        while self.hub._turn_items < messages:
            assert time.monotonic() < deadline, f"{self.hub._turn_items} of {messages} messages reached the hub"
            if poller.poll(100):
                self.hub._drain(self.hub.gen_sock)

    def end(self, kind: type[msgspec.Struct]) -> list[msgspec.Struct]:
        """The second half: dispatch, the Redis write, then what the hub sent back, at least one
        message of ``kind`` (a turn sends each peer one ack, after its write)."""
        self.hub._dispatch_leases()
        self.hub._flush()
        out: list[msgspec.Struct] = []
        deadline = time.monotonic() + 30  # a loaded CI machine delays delivery, never this long
        while not any(isinstance(m, kind) for m in out):
            assert time.monotonic() < deadline, f"no {kind.__name__} from the hub's turn: {out}"
            if self.sock.poll(100, zmq.POLLIN):
                out.append(self.decoder.decode(self.sock.recv()))
        while self.sock.poll(100, zmq.POLLIN):
            out.append(self.decoder.decode(self.sock.recv()))
        return out

    def restart_hub(self) -> Hub:
        """The hub as a kill -9 and a restart leave it: this one's sockets gone, a new one
        rebuilt from Redis (no generator connected to it yet)."""
        self.close()
        old = self.hub
        old.gen_sock.close(linger=0)
        old.reward_sock.close(linger=0)
        self.hub = Hub(old.cfg, PromptSource.from_config(old.cfg.data), old.redis)
        recovery.load(self.hub)
        return self.hub  # (the fixture closes its sockets)

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def turns(redis_server: RedisServer, tokenizer_dir: Path, prompts_jsonl: Path) -> Iterator[TurnByTurn]:
    cfg = load_config(
        [
            "--redis.url", redis_server.url,
            "--data.path", str(prompts_jsonl), "--data.tokenizer", str(tokenizer_dir),
            "--data.n_samples_per_prompt", "2", "--data.shuffle", "false",
            "--async.max_staleness", "1", "--async.groups_per_step", "1",
            "--hub.generator_port", "0", "--hub.reward_port", "0",
        ]
    )  # fmt: skip
    hub = Hub(cfg, PromptSource.from_config(cfg.data), redis_server.client())
    recovery.load(hub)
    t = TurnByTurn(hub)
    yield t
    t.close()
    t.hub.gen_sock.close(linger=0)  # the hub the test ended with (one may stand for a restart)
    t.hub.reward_sock.close(linger=0)


def _leased(t: TurnByTurn) -> Lease:
    t.send(Register(generator_id="gen", model="m", capacity=1, weight_version=0))
    t.take()
    (lease,) = [m for m in t.end(Lease) if isinstance(m, Lease)]
    return lease


def _acked(replies: list[msgspec.Struct]) -> tuple[int, list[str]]:
    acks = [m for m in replies if isinstance(m, ChunkAck)]
    return sum(len(a.seqs) // 4 for a in acks), [r.reason for a in acks for r in a.rejected]


def test_a_group_dropped_in_the_turn_it_took_a_chunk_leaves_no_key_and_acks_nothing_unwritten(
    turns: TurnByTurn,
) -> None:
    """η = 1: the learner reaches v3 while a v0 group is generating. The turn that drops it took
    a chunk of it first: that chunk must not be written after the drop's UNLINK (an orphan key,
    in Redis for good), and so must be refused, not acknowledged."""
    hub, redis = turns.hub, turns.hub.redis
    lease = _leased(turns)
    turns.send(make_chunk(lease, 0, 0, version=0, final=False))
    turns.take()
    assert _acked(turns.end(ChunkAck)) == (1, [])
    turns.send(make_chunk(lease, 0, 1, version=0, final=False))
    turns.take()
    hub.learner_version = 3  # as read with the turn's write; housekeeping then finds the group doomed
    hub._drop_doomed()
    acked, rejected = _acked(turns.end(ChunkAck))
    assert (acked, rejected) == (0, ["revoked_lease"])
    assert not redis.exists(hub.keys.group(lease.group_id))
    assert int(redis.hget(hub.keys.counters, "chunks_persisted") or 0) == 1  # the first chunk only
    assert (hub.stats.chunks_in, hub.stats.rejected["revoked_lease"]) == (1, 1)  # counted once, as refused


def test_a_chunk_taken_in_the_turn_its_lease_is_given_back_is_written_before_its_ack(turns: TurnByTurn) -> None:
    """A generator that drains sends its last chunks, then gives its lease back. In one turn the
    hub takes both: the chunk is acknowledged, so it must be in Redis, though the sample starts
    again under a new lease (readers keep the new lease's chunks)."""
    hub, redis = turns.hub, turns.hub.redis
    lease = _leased(turns)
    turns.send(make_chunk(lease, 0, 0, version=0, final=False))
    turns.send(Release(generator_id="gen", lease_ids=[lease.lease_id]))
    turns.take(messages=2)
    assert _acked(turns.end(ChunkAck)) == (1, [])
    assert int(redis.hget(hub.keys.counters, "chunks_persisted") or 0) == 1
    fields = redis.hkeys(hub.keys.group(lease.group_id))
    assert any(f.startswith(b"c:") for f in fields), fields
    assert hub.groups[lease.group_id].samples[0].lease_id != lease.lease_id  # re-issued


def test_a_turn_whose_write_to_redis_fails_acknowledges_nothing(turns: TurnByTurn, redis_server: RedisServer) -> None:
    """An ack says the chunk is durable. A turn whose write Redis never took must send none: the
    generator resends the chunk to the hub that restarts from Redis."""
    lease = _leased(turns)
    turns.send(make_chunk(lease, 0, 0, version=0, final=False))
    turns.take()
    redis_server.stop()
    with pytest.raises(redis.ConnectionError):
        turns.hub._flush()
    assert not turns.sock.poll(500, zmq.POLLIN), "the hub acknowledged a chunk Redis never took"


def test_groups_a_learner_dropped_stay_listed_until_the_turn_that_removes_them_is_written(
    turns: TurnByTurn,
) -> None:
    """The hub reaps the groups a learner dropped as too stale (their keys unlinked) in its
    turn's write. Taken off the list before that write, a hub killed in between would forget
    them and their keys would stay in Redis for good."""
    hub, redis = turns.hub, turns.hub.redis
    for gid in (7, 8):
        redis.hset(hub.keys.group(gid), "c:x", b"blob")
        redis.rpush(hub.keys.dropped, gid)
    hub._reap_dropped()  # the turn's housekeeping; a kill -9 here must lose nothing
    assert redis.lrange(hub.keys.dropped, 0, -1) == [b"7", b"8"]
    assert redis.exists(hub.keys.group(7), hub.keys.group(8)) == 2
    redis.rpush(hub.keys.dropped, 9)  # a learner drops another one meanwhile
    hub._flush()
    assert redis.lrange(hub.keys.dropped, 0, -1) == [b"9"]
    assert redis.exists(hub.keys.group(7), hub.keys.group(8)) == 0
    assert hub._to_reap == 1  # read back with the write: the next reap takes it


def test_a_garbled_entry_of_the_dropped_list_is_skipped_not_fatal(turns: TurnByTurn) -> None:
    """The list's entries are ``GID`` or ``GID:back``; anything else (a foreign writer, a bug) is
    logged and trimmed with the rest, and the good entries around it are reaped as ever."""
    hub, redis = turns.hub, turns.hub.redis
    for gid in (7, 8):
        redis.hset(hub.keys.group(gid), "c:x", b"blob")
    redis.rpush(hub.keys.dropped, b"7", b"\xff\x00garbage", b"12:front", b"8:back")
    hub._reap_dropped()
    hub._flush()
    assert redis.llen(hub.keys.dropped) == 0
    assert redis.exists(hub.keys.group(7), hub.keys.group(8)) == 0


def test_dropped_entries_parse_or_name_the_format() -> None:
    from flywheel.store import dropped_entry

    assert dropped_entry(b"17") == (17, False)
    assert dropped_entry("17:back") == (17, True)
    for bad in (b"", b"-3", b"17:", b"17:later", b"x:back", b"\xff"):
        with pytest.raises(ValueError, match="GROUP_ID:back"):
            dropped_entry(bad)


def test_a_restarted_hub_gives_a_sample_with_no_token_no_version(turns: TurnByTurn) -> None:
    """A sample that ended with no token (an empty final chunk) has no version, and the live
    hub gives it none; rebuilt from Redis, it read as version 0, and the group, still fresh,
    was dropped as too stale at the restarted hub's first check."""
    hub = turns.hub
    lease = _leased(turns)
    empty = make_chunk(lease, 0, 0, version=0, final=True, n=0)
    turns.send(empty)
    turns.send(make_chunk(lease, 1, 0, version=5, final=False))
    turns.take(messages=2)
    assert _acked(turns.end(ChunkAck)) == (2, [])
    assert hub.groups[lease.group_id].oldest_seen() == 5
    again = turns.restart_hub()
    assert again.groups[lease.group_id].oldest_seen() == 5
    again.learner_version = 5  # η = 1: v5 is fresh
    again._drop_doomed()
    assert lease.group_id in again.groups


def test_a_lease_a_restarted_hub_finds_assigned_goes_back_unless_its_generator_lists_it(turns: TurnByTurn) -> None:
    """A lease is written with its turn and sent after it: a hub killed in between comes back
    with a lease its generator never heard of, which held the group and the generator's slot
    for the whole lease_timeout_s (60 s). It now has until the generator timeout, and a
    heartbeat that lists it (its generator has it) extends it as always."""
    hub = turns.hub
    lease = _leased(turns)
    again = turns.restart_hub()
    deadline = again.leases[lease.lease_id].record.deadline - time.time()
    assert deadline <= hub.hcfg.generator_timeout_s + 1, f"{deadline:.0f}s left"
    again._on_heartbeat(b"gen", Heartbeat(generator_id="gen", weight_version=0, lease_ids=[lease.lease_id]))
    assert again.leases[lease.lease_id].record.deadline - time.time() > hub.hcfg.generator_timeout_s + 1


def test_a_restarted_hub_still_sees_how_old_a_generating_group_is(turns: TurnByTurn) -> None:
    """The version of a sample's first token is kept in memory only; a hub rebuilt from Redis
    must find it again, or a group already too stale would hold its admission slot and its
    engine slots until the learner's claim dropped it, instead of being revoked at once."""
    hub = turns.hub
    lease = _leased(turns)
    turns.send(make_chunk(lease, 0, 0, version=0, final=False))
    turns.take()
    assert _acked(turns.end(ChunkAck)) == (1, [])
    again = turns.restart_hub()
    group = again.groups[lease.group_id]
    assert group.oldest_seen() == 0
    again.learner_version = 3  # η = 1: a v0 token is too stale from v2 on
    again._drop_doomed()
    assert lease.group_id not in again.groups
    again._flush()
    # /metrics reports the run's totals: a hub restarted once more starts from them, not from 0
    again.gen_sock.close(linger=0)
    again.reward_sock.close(linger=0)
    third = Hub(hub.cfg, PromptSource.from_config(hub.cfg.data), hub.redis)
    recovery.load(third)
    turns.hub = third
    assert third.snapshot()["counters"]["groups_dropped_generating"] == 1  # type: ignore[index]


def test_a_re_issued_lease_waiting_for_a_generator_leaves_the_count_when_its_group_is_dropped(
    turns: TurnByTurn,
) -> None:
    """The autoscaler reads active leases as leases less the re-issued ones waiting for a
    generator: a waiting one whose group is dropped as too stale must leave both counts (it
    stayed in the waiting list, and active leases went negative)."""
    t = turns
    lease = _leased(t)
    t.send(make_chunk(lease, 1, 0, 0, final=True))  # sample 1 done, at version 0
    t.send(Heartbeat(generator_id="gen", weight_version=0, lease_ids=[lease.lease_id], draining=True))
    t.send(Release(generator_id="gen", lease_ids=[lease.lease_id]))  # draining: sample 0 waits for another
    t.take(messages=3)
    t.end(ChunkAck)
    gauges = t.hub.snapshot()["gauges"]
    assert (gauges["active_leases"], gauges["unassigned_leases"]) == (0, 1)  # type: ignore[index]
    t.hub.learner_version = 2  # η = 1: a group holding version 0 is now too stale
    t.hub._drop_doomed()
    assert t.hub.stats.groups_dropped_generating == 1
    gauges = t.hub.snapshot()["gauges"]
    assert (gauges["active_leases"], gauges["unassigned_leases"]) == (0, 0)  # type: ignore[index]


def test_weights_older_than_the_claim_ahead_accepts_get_no_lease_and_a_first_token_below_it_drops_its_group(
    turns: TurnByTurn,
) -> None:
    """Once the learner has claimed its next batch ahead (floor v + 1 - η), a group holding an
    older token can never be trained on: the hub gives no lease to weights that old, and drops a
    group leased before the floor rose as soon as its first token shows it (the check made when
    the floor rose saw no token of it yet)."""
    t = turns
    lease = _leased(t)  # weights v0, η = 1
    t.hub.redis.set(t.hub.keys.version, 1)
    t.hub.redis.set(t.hub.keys.claim_floor, 1)  # the learner at v1 claimed ahead: floor 1
    t.hub._refresh_learner_state()
    t.hub._drop_doomed()
    assert lease.group_id in t.hub.groups  # no token yet: nothing to go by
    t.send(make_chunk(lease, 0, 0, 0, final=False))  # its first token, from weights v0
    t.take()
    t.hub._housekeeping()
    replies = t.end(ChunkAck)
    assert lease.group_id not in t.hub.groups and t.hub.stats.groups_dropped_generating == 1
    assert _acked(replies) == (0, ["revoked_lease"])
    assert not [m for m in replies if isinstance(m, Lease)], "a lease went to weights v0"
    t.send(Heartbeat(generator_id="gen", weight_version=1, lease_ids=[], draining=False))  # synced
    t.take()
    assert [m for m in t.end(Lease) if isinstance(m, Lease)]


@contextlib.contextmanager
def _own_hub(redis_server: RedisServer, tokenizer_dir: Path, data: Path, *flags: str) -> Iterator[TurnByTurn]:
    """A hub of this test's own settings, and a generator socket to it."""
    cfg = load_config(
        [
            "--redis.url", redis_server.url, "--data.path", str(data), "--data.tokenizer", str(tokenizer_dir),
            "--data.n_samples_per_prompt", "2", "--data.shuffle", "false",
            "--hub.generator_port", "0", "--hub.reward_port", "0", *flags,
        ]
    )  # fmt: skip
    hub = Hub(cfg, PromptSource.from_config(cfg.data), redis_server.client())
    recovery.load(hub)
    t = TurnByTurn(hub)
    try:
        yield t
    finally:
        t.close()
        hub.gen_sock.close(linger=0)
        hub.reward_sock.close(linger=0)


def test_an_over_long_prompt_is_skipped_and_the_next_one_leased(
    redis_server: RedisServer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """data.overlong_prompts skip: a prompt over data.max_prompt_tokens is not cut from the left
    (its BOS and chat header lost): the hub skips it, counts it, and issues the next row."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1 + 1 = " * 40, "answer": "2"}, {"prompt": "2 + 2 =", "answer": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with _own_hub(redis_server, tokenizer_dir, data, "--data.max_prompt_tokens", "32") as t:
        lease = _leased(t)
        assert t.hub.groups[lease.group_id].meta.prompt_index == 1
        assert t.hub.snapshot()["counters"]["prompts_skipped"] == 1  # type: ignore[index]


def test_leases_carry_the_runs_sampling_seed(
    redis_server: RedisServer, tokenizer_dir: Path, prompts_jsonl: Path
) -> None:
    """rollout.seed reaches the generators (each derives its requests' seeds from it); it was
    never set, so no run's rollouts could be repeated."""
    with _own_hub(redis_server, tokenizer_dir, prompts_jsonl, "--rollout.seed", "7") as t:
        assert _leased(t).sampling.seed == 7
