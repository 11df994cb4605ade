"""A generator's connection to the learner's weight sync: SUB for WeightsReady, DEALER for
SyncJoin (every heartbeat) and WeightsAck."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

import zmq

from flywheel.config import SecurityConfig
from flywheel.netsec import curve_client
from flywheel.wire import Decoder, Rejections, SyncJoin, WeightsAck, WeightsReady, WireError, encode

log = logging.getLogger(__name__)


class SyncLink:
    def __init__(
        self,
        host: str,
        announce_port: int,
        join_port: int,
        generator_id: str,
        workers: int,
        security: SecurityConfig | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.generator_id = generator_id
        self.workers = workers
        self.incarnation = uuid.uuid4().hex  # this process's, in every SyncJoin
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes)  # far over the checked limit: ZMQ drops it
        curve_client(self.sub, security)
        self.sub.connect(f"tcp://{host}:{announce_port}")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, generator_id.encode())
        self.dealer.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # the learner sends nothing on it (see poll)
        curve_client(self.dealer, security)
        self.dealer.connect(f"tcp://{host}:{join_port}")
        self.decoder = Decoder(WeightsReady, max_bytes=max_message_bytes)
        self.rejects = Rejections(log)  # what arrived on either socket and failed validation, by reason
        # A SUB socket misses what is published before its subscription reaches the publisher:
        # announce ourselves only after giving it time, so we are never in a group we cannot hear.
        self._join_after = time.monotonic() + 0.5
        self._last_join = 0.0

    def join(self, version: int, every_s: float, needs_weights: bool = False) -> None:
        now = time.monotonic()
        if now >= self._join_after and now - self._last_join >= every_s:
            self._last_join = now
            self._send_join(version, needs_weights=needs_weights)

    def leave(self, version: int) -> None:
        """This generator stops: out of the next syncs at once (sent once; close gives it time to go)."""
        self._send_join(version, leaving=True)

    def _send_join(self, version: int, **flags: bool) -> None:
        msg = SyncJoin(
            generator_id=self.generator_id,
            version=version,
            workers=self.workers,
            incarnation=self.incarnation,
            **flags,
        )
        with contextlib.suppress(zmq.Again):
            self.dealer.send(encode(msg), zmq.NOBLOCK)

    def poll(self) -> list[tuple[WeightsReady, bytes]]:
        """Every valid WeightsReady received (with its encoded form, passed on to the workers)."""
        self._drain_dealer()
        out: list[tuple[WeightsReady, bytes]] = []
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 1:
                self.rejects.reject("malformed", f"expected 1 frame, got {len(frames)}", "announce")
                continue
            payload = frames[0]
            try:
                msg = self.decoder.decode(payload)
            except WireError as err:
                self.rejects.reject(err.reason, err, "announce")
                continue
            assert isinstance(msg, WeightsReady)
            if msg.announced_at > 0:  # its deadline on this host's clock, for the workers too
                msg = msg.on_receipt(time.time())
                payload = encode(msg)
            out.append((msg, payload))

    def _drain_dealer(self) -> None:
        """The learner never sends on the join socket: whatever arrives there is refused (and
        read, so that it cannot fill the socket's queue)."""
        while True:
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.rejects.reject("wrong_socket", f"{len(frames)} frames on the join socket", "join")

    def ack(self, version: int, epoch: int, error: str | None, seconds: float) -> None:
        msg = WeightsAck(generator_id=self.generator_id, version=version, epoch=epoch, error=error, seconds=seconds)
        with contextlib.suppress(zmq.Again):
            self.dealer.send(encode(msg), zmq.NOBLOCK)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=500)  # a leave still queued gets half a second; a learner away costs no more
