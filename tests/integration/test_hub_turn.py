"""One hub turn at a time: the hub built in this process on a real Redis, real ZeroMQ sockets
to it, and its turn's steps called in the order its loop calls them. For what no timing of a
separate process can pin down: two things that happen in the same turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from buffer import recovery
from buffer.hub import Hub
from buffer.prompts import PromptSource
from flywheel.config import load_config
from flywheel.redis_server import RedisServer
from flywheel.wire import ChunkAck, Decoder, Lease, Register, Release, ToGenerator, encode
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

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(encode(msg))  # type: ignore[arg-type]

    def take(self) -> None:
        """The first half of a turn: the hub takes every message sent so far."""
        poller = zmq.Poller()
        poller.register(self.hub.gen_sock, zmq.POLLIN)
        assert poller.poll(5000), "nothing reached the hub"
        self.hub._turn_items = 0
        self.hub._drain(self.hub.gen_sock)

    def end(self) -> list[msgspec.Struct]:
        """The second half: dispatch, the Redis write, then what the hub sent back."""
        self.hub._dispatch_leases()
        self.hub._flush()
        out = []
        while self.sock.poll(200, zmq.POLLIN):
            out.append(self.decoder.decode(self.sock.recv()))
        return out

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
    hub.gen_sock.close(linger=0)
    hub.reward_sock.close(linger=0)


def _leased(t: TurnByTurn) -> Lease:
    t.send(Register(generator_id="gen", model="m", capacity=1, weight_version=0))
    t.take()
    (lease,) = [m for m in t.end() if isinstance(m, Lease)]
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
    assert _acked(turns.end()) == (1, [])
    turns.send(make_chunk(lease, 0, 1, version=0, final=False))
    turns.take()
    hub.learner_version = 3  # as read with the turn's write; housekeeping then finds the group doomed
    hub._drop_doomed()
    acked, rejected = _acked(turns.end())
    assert (acked, rejected) == (0, ["revoked_lease"])
    assert not redis.exists(hub.keys.group(lease.group_id))
    assert int(redis.hget(hub.keys.counters, "chunks_persisted") or 0) == 1  # the first chunk only


def test_a_chunk_taken_in_the_turn_its_lease_is_given_back_is_written_before_its_ack(turns: TurnByTurn) -> None:
    """A generator that drains sends its last chunks, then gives its lease back. In one turn the
    hub takes both: the chunk is acknowledged, so it must be in Redis, though the sample starts
    again under a new lease (readers keep the new lease's chunks)."""
    hub, redis = turns.hub, turns.hub.redis
    lease = _leased(turns)
    turns.send(make_chunk(lease, 0, 0, version=0, final=False))
    turns.send(Release(generator_id="gen", lease_ids=[lease.lease_id]))
    turns.take()
    replies = turns.end()
    assert _acked(replies) == (1, [])
    assert int(redis.hget(hub.keys.counters, "chunks_persisted") or 0) == 1
    fields = redis.hkeys(hub.keys.group(lease.group_id))
    assert any(f.startswith(b"c:") for f in fields), fields
    assert hub.groups[lease.group_id].samples[0].lease_id != lease.lease_id  # re-issued
