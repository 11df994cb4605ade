"""The hub's hand-packed MULTI/EXEC write against a real redis-server: same effects and replies as
redis-py's transaction pipeline, errors that fail the turn, and a connection that stays usable."""

from __future__ import annotations

import time

import pytest
import redis

from buffer.turn_write import TurnWrite, TurnWriteError
from flywheel.redis_server import RedisServer


def _both(redis_server: RedisServer) -> tuple[list[object], list[object], dict[str, object]]:
    """The same commands through TurnWrite (keys a:*) and redis-py's pipeline (keys b:*)."""
    client = redis_server.client()
    ours, theirs = TurnWrite(client), client.pipeline(transaction=True)
    blob = bytes(range(256)) * 40  # binary and bigger than redis-py's send buffer cut-off
    for prefix, pipe in (("a", ours), ("b", theirs)):
        pipe.hset(f"{prefix}:h", "f", blob)
        pipe.hset(f"{prefix}:h", mapping={b"x": 1, "y": "two", 3: b"\r\n"})
        pipe.hset(f"{prefix}:h", 7, -12)
        pipe.hincrby(f"{prefix}:c", "n", 5)
        pipe.hincrby(f"{prefix}:c", "n", -2)
        pipe.hdel(f"{prefix}:h", "y", "missing")
        pipe.sadd(f"{prefix}:s", 1, 2, 3)
        pipe.srem(f"{prefix}:s", 2)
        pipe.zadd(f"{prefix}:z", {"g1": 4, "g2": 2})
        pipe.rpush(f"{prefix}:l", 10, 11)
        pipe.lpop(f"{prefix}:l")
        pipe.lpop(f"{prefix}:empty")
        pipe.llen(f"{prefix}:l")
        pipe.get(f"{prefix}:none")
        pipe.hget(f"{prefix}:h", "f")
        pipe.unlink(f"{prefix}:gone")
    ours_replies, theirs_replies = ours.execute(), theirs.execute()
    state = {
        name: (
            client.hgetall(f"{name}:h"),
            client.hgetall(f"{name}:c"),
            client.smembers(f"{name}:s"),
            client.zrange(f"{name}:z", 0, -1, withscores=True),
            client.lrange(f"{name}:l", 0, -1),
        )
        for name in ("a", "b")
    }
    return ours_replies, theirs_replies, state


def test_turn_write_matches_redis_py_transaction(redis_server: RedisServer) -> None:
    ours, theirs, state = _both(redis_server)
    assert ours == theirs
    assert state["a"] == state["b"]
    assert state["a"][0][b"f"] == bytes(range(256)) * 40


def test_turn_write_is_empty_after_execute_and_reusable(redis_server: RedisServer) -> None:
    client = redis_server.client()
    write = TurnWrite(client)
    assert write.execute() == []
    write.hincrby("c", "n", 1)
    assert len(write) == 1
    assert write.execute() == [1]
    assert len(write) == 0
    write.hincrby("c", "n", 1)
    assert write.execute() == [2]


def test_a_command_redis_refuses_fails_the_turn_and_the_connection_recovers(redis_server: RedisServer) -> None:
    client = redis_server.client()
    client.set("plain", "x")
    write = TurnWrite(client)
    write.hincrby("c", "n", 1)
    write.hset("plain", "f", "v")  # WRONGTYPE at EXEC
    with pytest.raises(TurnWriteError, match="1 of the turn's 2 commands failed"):
        write.execute()
    assert len(write) == 0
    write._command(b"NOSUCHCOMMAND", "k")  # refused at queueing: EXEC aborts, nothing applied
    write.hincrby("c", "n", 100)
    with pytest.raises(TurnWriteError, match="aborted"):
        write.execute()
    assert client.hget("c", "n") == b"1"  # the aborted turn applied nothing
    write.hincrby("c", "n", 1)
    assert write.execute() == [2]  # the same pool serves the next turn cleanly


def test_a_redis_that_stops_answering_fails_the_turn_with_a_redis_timeout(redis_server: RedisServer) -> None:
    """The replies are read off the socket directly: its timeout is still the client's, and it
    surfaces as redis-py's TimeoutError (a RedisError: the hub exits for a restart)."""
    client = redis_server.client(socket_timeout=0.5)
    write = TurnWrite(client)
    redis_server.client().execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # writes wait 1.5 s
    write.hincrby("c", "n", 1)
    start = time.monotonic()
    with pytest.raises(redis.TimeoutError, match="turn's write to Redis failed"):
        write.execute()
    assert time.monotonic() - start < 1.4, "the write waited past the socket timeout"
    redis_server.client().execute_command("CLIENT", "UNPAUSE")
    write.hincrby("c", "n", 1)
    # a fresh connection; the timed-out turn may or may not have run once the pause ended, which
    # is why the hub then exits and rebuilds its state from Redis
    assert write.execute()[0] in (1, 2)


def test_a_redis_that_dies_mid_turn_fails_the_turn_with_a_redis_error(redis_server: RedisServer) -> None:
    write = TurnWrite(redis_server.client(socket_timeout=5.0))
    write.hincrby("c", "n", 1)
    assert write.execute() == [1]
    redis_server.proc.kill()
    redis_server.proc.wait(timeout=10)
    write.hset("h", "f", b"x" * (1 << 20))
    with pytest.raises(redis.ConnectionError):
        write.execute()


@pytest.mark.parametrize("bad", [None, True, 1.5j, ["list"], {"a": 1}])
def test_arguments_of_the_wrong_type_are_refused_before_anything_is_sent(
    redis_server: RedisServer, bad: object
) -> None:
    client = redis_server.client()
    write = TurnWrite(client)
    with pytest.raises((TypeError, ValueError)):
        write.hset("h", "f", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing to set"):
        write.hset("h")
