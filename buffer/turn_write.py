"""One hub turn's Redis write: a MULTI/EXEC transaction packed by hand and sent in one syscall.

redis-py's pipeline packs each command through its general serializer and sends every value
larger than its buffer cut-off with a syscall of its own; at half load that was a fifth of the
hub's time (py-spy: packing 11%, sending 11%). A turn only ever writes a handful of command
kinds with bytes, str or int arguments, so it packs RESP directly into one buffer, sends it
with one ``sendall`` on a connection it keeps, and parses the replies with a hiredis reader of its
own, straight off that connection's socket: redis-py's reply path costs a few Python calls per
reply, and a turn of N commands has 2N + 2 (each command's QUEUED, then EXEC's N).

Atomicity is Redis's: the commands sit between MULTI and EXEC, so AOF holds all or none of a
turn. An error reply fails the write (``TurnWriteError``: the hub stops, and a restarted hub
rebuilds from Redis while generators resend what was never acknowledged); a broken connection
is dropped, so no half-read reply can leak into the next turn. Unlike redis-py's pipeline it
never retries a transaction whose EXEC may already have run: counters would count twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hiredis
import redis

Arg = bytes | str | int | float

_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


class TurnWriteError(redis.RedisError):
    """Redis refused the turn's transaction or one of its commands."""


def _arg(value: Arg) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):  # a bool is an int to Python, never meant as one here
        raise TypeError(f"a Redis argument cannot be a bool ({value!r})")
    if isinstance(value, int):
        return b"%d" % value
    if isinstance(value, float):
        return repr(value).encode()
    raise TypeError(f"a Redis argument must be bytes, str, int or float, not {type(value).__name__}")


class TurnWrite:
    """Collects commands like a redis-py transaction pipeline; ``execute`` runs them as one
    MULTI/EXEC and returns their replies in order (bytes stay bytes)."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None  # the turn's own connection, kept across turns (one thread writes)
        self._reader: Any = None  # hiredis, reading that connection's replies (one per connection)
        self._parts: list[bytes] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _command(self, *args: Arg) -> None:
        parts = self._parts
        parts.append(b"*%d\r\n" % len(args))
        for value in args:
            raw = value if value.__class__ is bytes else _arg(value)  # most arguments are bytes already
            parts += (b"$%d\r\n" % len(raw), raw, b"\r\n")
        self._count += 1

    # ------------------------------------------------------------------ the commands a turn uses

    def get(self, key: str) -> None:
        self._command(b"GET", key)

    def hget(self, key: str, field: Arg) -> None:
        self._command(b"HGET", key, field)

    def hset(
        self, key: str, field: Arg | None = None, value: Arg | None = None, mapping: Mapping[Any, Arg] | None = None
    ) -> None:
        pairs: list[Arg] = []
        if field is not None:
            if value is None:
                raise ValueError("hset: a field needs a value")
            pairs += (field, value)
        for k, v in (mapping or {}).items():
            pairs += (k, v)
        if not pairs:
            raise ValueError("hset: nothing to set")
        self._command(b"HSET", key, *pairs)

    def hset_field(self, key: bytes, field: bytes, value: bytes) -> None:
        """HSET of one field, packed in one step: the hub's chunk blob, one per group a turn, so
        the most frequent command of a turn at low load (``_command``'s loop cost it twice)."""
        self._parts += (
            b"*4\r\n$4\r\nHSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, len(field), field, len(value)),
            value,
            b"\r\n",
        )
        self._count += 1

    def hdel(self, key: str, *fields: Arg) -> None:
        self._command(b"HDEL", key, *fields)

    def hincrby(self, key: str, field: Arg, amount: int = 1) -> None:
        self._command(b"HINCRBY", key, field, amount)

    def set(self, key: str, value: Arg) -> None:
        self._command(b"SET", key, value)

    def unlink(self, *keys: str) -> None:
        self._command(b"UNLINK", *keys)

    def sadd(self, key: str, *members: Arg) -> None:
        self._command(b"SADD", key, *members)

    def srem(self, key: str, *members: Arg) -> None:
        self._command(b"SREM", key, *members)

    def zadd(self, key: str, mapping: Mapping[Any, int | float]) -> None:
        pairs: list[Arg] = []
        for member, score in mapping.items():
            pairs += (score, member)
        self._command(b"ZADD", key, *pairs)

    def rpush(self, key: str, *values: Arg) -> None:
        self._command(b"RPUSH", key, *values)

    def lpop(self, key: str) -> None:
        self._command(b"LPOP", key)

    def ltrim(self, key: str, start: int, stop: int) -> None:
        self._command(b"LTRIM", key, start, stop)

    def llen(self, key: str) -> None:
        self._command(b"LLEN", key)

    # ------------------------------------------------------------------ running it

    def close(self) -> None:
        """Give the connection back to the pool, closed."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._reader = None
            conn.disconnect()
            self._pool.release(conn)

    def reset(self) -> None:
        self._parts.clear()
        self._count = 0

    def execute(self) -> list[Any]:
        """Run the collected commands as one transaction; return their replies. Always leaves the
        write empty, whether it succeeded or not."""
        if not self._count:
            return []
        count = self._count
        payload = b"".join((_MULTI, *self._parts, _EXEC))
        self.reset()
        if self._conn is None:
            self._conn = self._pool.get_connection()  # connected: AUTH, SELECT, TLS done by redis-py
            self._reader = hiredis.Reader(replyError=redis.ResponseError)
        try:
            sock = self._conn._sock
            sock.sendall(payload)
            *queued, replies = self._read_replies(sock, count + 2)  # MULTI's OK, the QUEUEDs, EXEC's
            if isinstance(replies, redis.ResponseError):  # refused at queueing: EXEC aborted
                queued_errors = [r for r in queued if isinstance(r, redis.ResponseError)]
                raise TurnWriteError(f"the turn's transaction was aborted: {queued_errors or replies}")
        except OSError as err:  # the socket's own errors, its timeout included, as redis-py's
            self.close()
            kind = redis.TimeoutError if isinstance(err, TimeoutError) else redis.ConnectionError
            raise kind(f"the turn's write to Redis failed: {err!r}") from err
        except BaseException:
            # Whatever was left unread must not reach the next turn: drop the connection (the
            # next turn opens a fresh one).
            self.close()
            raise
        if not isinstance(replies, list) or len(replies) != count:
            raise TurnWriteError(f"EXEC answered {replies!r} for {count} commands")
        failed = [r for r in replies if isinstance(r, redis.ResponseError)]
        if failed:
            raise TurnWriteError(f"{len(failed)} of the turn's {count} commands failed, first: {failed[0]}")
        return replies

    def _read_replies(self, sock: Any, n: int) -> list[Any]:
        """The next ``n`` replies off the socket (its timeout is the client's socket timeout);
        error replies come back as ResponseError objects, not raised."""
        reader = self._reader
        out: list[Any] = []
        while len(out) < n:
            reply = reader.gets()
            if reply is False:  # not a whole reply buffered yet
                data = sock.recv(1 << 16)
                if not data:
                    raise redis.ConnectionError("Redis closed the connection mid-turn")
                reader.feed(data)
            else:
                out.append(reply)
        return out
