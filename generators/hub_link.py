"""A generator's connection to the hub: register, heartbeat, take leases, stream chunks.

Chunks stay in ``unacked`` until the hub acknowledges them (after its Redis write) and are
resent once unacknowledged for longer than the resend timeout (``resend_after_s`` at least; it
follows the ack latency and backs off while resends go unanswered); the hub drops duplicates, so
resending is always safe. This is what makes a hub restart lose nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import zmq

from flywheel.config import SecurityConfig
from flywheel.netsec import curve_client
from flywheel.wire import (
    LEASE_GONE_REASONS,
    Chunk,
    ChunkAck,
    ChunkBatch,
    ChunkRejection,
    Decoder,
    Heartbeat,
    Lease,
    Register,
    RegisterAgain,
    Rejections,
    Release,
    Revoke,
    ToGenerator,
    WireError,
    encode,
    unpack_i32,
    unpack_i64,
)

log = logging.getLogger(__name__)

CHUNK_OVERHEAD_BYTES = 128  # a chunk's encoding beyond its three arrays (field names, ids, the reason)
MAX_BACKOFF = 8  # the resend timeout grows at most this many times while resends go unanswered


@dataclass
class Inbox:
    leases: list[Lease] = field(default_factory=list)
    revoked: list[int] = field(default_factory=list)
    acked: int = 0
    acked_chunks: list[Chunk] = field(default_factory=list)  # the chunks counted in ``acked``
    rejected: int = 0


MAX_UNACKED_CHUNKS = 8192
"""The default flow-control window: chunks a generator may have sent and not had acknowledged."""
ENDED_LEASES_REMEMBERED = 4096  # far more than end within one of the hub's lease resends


class LatencySample:
    """Send -> ack latencies in bounded memory, sampled alike over the whole run: past ``cap``
    values every other one is dropped, and from then on one in 2 (4, 8, ...) is kept. (A plain
    cap kept the first million only: a benchmark's percentiles missed the end of its window.)"""

    def __init__(self, cap: int = 1 << 17) -> None:  # 131k samples: a p99 within a tenth of a percent of rank
        self.cap = cap
        self.values: list[float] = []  # of the chunks whose ack index is a multiple of ``every``
        self.every = 1
        self.count = 0  # every ack seen, sampled or not

    def add(self, latencies: list[float]) -> None:
        if self.every == 1:
            self.values += latencies
        else:
            self.values += latencies[(-self.count) % self.every :: self.every]
        self.count += len(latencies)
        if len(self.values) >= self.cap:
            del self.values[1::2]
            self.every *= 2

    def reset(self) -> None:
        """Forget what was seen (a benchmark's warm-up)."""
        self.values.clear()
        self.every, self.count = 1, 0


class HubLink:
    def __init__(
        self,
        address: str,
        generator_id: str,
        model: str,
        capacity: int,
        resend_after_s: float = 2.0,
        heartbeat_s: float = 0.5,
        hwm: int = 10000,
        max_unacked: int = MAX_UNACKED_CHUNKS,
        ack_log: str | None = None,
        security: SecurityConfig | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.generator_id = generator_id
        # One line per ack message: how many chunks it confirmed. Written straight to the file
        # (no buffer), so it survives a kill -9 of this process; tests/chaos sum it.
        self._ack_log = os.open(ack_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if ack_log else None
        self.model = model
        self.capacity = capacity
        self.resend_after_s = resend_after_s
        self.max_unacked = max_unacked
        self.heartbeat_s = heartbeat_s
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, generator_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        # As the hub does: frames over the checked limit are counted; far over it, ZMQ drops them.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes)
        curve_client(self.sock, security)
        self.sock.connect(address)
        self.decoder = Decoder(ToGenerator, max_bytes=max_message_bytes)
        self.max_frame_bytes = max_message_bytes // 2
        self.rejects = Rejections(log)  # what the hub sent that failed validation, by reason
        # (group, sample, seq) -> (chunk, when sent, whether it is a resend), in send order
        self.unacked: dict[tuple[int, int, int], tuple[Chunk, float, bool]] = {}
        # The resend timeout adapts to the ack latency as TCP's does (Jacobson/Karels: smoothed
        # latency + 4 deviations, never below resend_after_s; Karn: acks of resent chunks are no
        # sample) and doubles after each resend until a fresh ack (at most MAX_BACKOFF times). A
        # hub that is slow, not gone, then gets no flood of duplicates on top of its backlog: at
        # 1000 generators, fixed 2 s resends turned a few seconds of lag into a resend storm that
        # filled the hub's receive queues (bench/load.py).
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._backoff = 1
        self._last_heartbeat = 0.0
        self._last_resend_check = 0.0
        self._last_resend_round = 0.0
        self._last_heard = 0.0  # when the hub last sent anything
        self.weight_version = 0
        self.lease_ids: set[int] = set()
        # The hub sends a lease again when our heartbeats do not list it (it takes the first
        # message for lost): a copy of one held, finished or given back must not run it again.
        # Ended ones, newest last (one dropped on a RegisterAgain or a Revoke is never sent again).
        self._ended_leases: dict[int, None] = {}
        self.duplicate_leases = 0
        self.draining = False
        self._registered_at = 0.0
        self.registrations = 0  # Registers sent: heartbeats carry it, a RegisterAgain echoes it
        self.ack_latency = LatencySample()  # send -> ack of the chunks: their chunk-to-durable times
        self.resent = 0

    def register(self, weight_version: int) -> None:
        self.weight_version = weight_version
        self._registered_at = time.monotonic()
        self.registrations += 1
        self._send(
            encode(
                Register(
                    generator_id=self.generator_id,
                    model=self.model,
                    capacity=self.capacity,
                    weight_version=weight_version,
                    draining=self.draining,
                )
            )
        )

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self._send(
                encode(
                    Heartbeat(
                        generator_id=self.generator_id,
                        weight_version=self.weight_version,
                        lease_ids=sorted(self.lease_ids),
                        draining=self.draining,
                        registration=self.registrations,
                    )
                )
            )

    def set_weight_version(self, version: int) -> None:
        if version != self.weight_version:
            self.weight_version = version
            self.heartbeat(force=True)

    def window_full(self) -> bool:
        """Flow control: stop producing while this many chunks await their ack, so a slow hub
        slows its generators instead of growing queues (and latency) without bound."""
        return len(self.unacked) >= self.max_unacked

    def send_chunks(self, chunks: list[Chunk], resend: bool = False) -> None:
        """Send ``chunks``, in frames of at most half the hub's message limit: after a stall
        (flow control, a hub restart) the tokens held back all go out at once, and one frame
        over the limit is refused whole, on every resend."""
        if not chunks:
            return
        now = time.monotonic()
        self.unacked.update({(c.group_id, c.sample, c.seq): (c, now, resend) for c in chunks})
        frame: list[Chunk] = []
        size = 0
        for c in chunks:
            n = len(c.tokens) + len(c.logprobs) + len(c.versions) + CHUNK_OVERHEAD_BYTES
            if frame and size + n > self.max_frame_bytes:
                self._send(encode(ChunkBatch(generator_id=self.generator_id, chunks=frame)))
                frame, size = [], 0
            frame.append(c)
            size += n
        self._send(encode(ChunkBatch(generator_id=self.generator_id, chunks=frame)))

    def resend_timeout_s(self) -> float:
        adaptive = self.resend_after_s if self._srtt is None else self._srtt + 4 * self._rttvar
        return max(self.resend_after_s, adaptive) * self._backoff

    def resend_due(self) -> int:
        """Resend every chunk unacknowledged for longer than ``resend_timeout_s()``."""
        now = time.monotonic()
        if now - self._last_resend_check < min(0.1, self.resend_after_s):
            return 0
        self._last_resend_check = now
        due = []
        timeout = self.resend_timeout_s()
        for c, sent, _ in self.unacked.values():  # insertion order is send order: oldest first
            if now - sent < timeout:
                break
            due.append(c)
        if not due:
            return 0
        if self._last_heard < self._last_resend_round:
            # Not a word from the hub since the last round: its copies are on their way still
            # (ZeroMQ queues them while the hub is away and delivers them when it is back). The
            # whole window again each round would pile up copy after copy in memory and reach a
            # restarted hub as one burst of duplicates: one probe a round instead, and the rest
            # goes at the first round after the hub answers.
            if now - self._last_resend_round < timeout:
                return 0
            due = due[:1]
        self._last_resend_round = now
        self.resent += len(due)
        self._backoff = min(2 * self._backoff, MAX_BACKOFF)
        for c in due:  # re-inserted at the end by send_chunks, keeping the order
            del self.unacked[(c.group_id, c.sample, c.seq)]
        for i in range(0, len(due), 256):
            self.send_chunks(due[i : i + 256], resend=True)
        return len(due)

    def _note_acked(self, entries: list[tuple[Chunk, float, bool]], inbox: Inbox) -> None:
        """Chunks one ack confirmed: counted, their latencies kept, and one round-trip sample
        taken for the resend timeout, the slowest of them sent once (Karn: of a resent chunk,
        either copy may have been acked, so it gives none). One sample an ack, not a chunk: an
        ack confirms a turn's worth of chunks, and per-chunk updates cost as much as the rest of
        this link's work together."""
        now = time.monotonic()
        latencies = [now - sent for _, sent, _ in entries]
        inbox.acked += len(entries)
        inbox.acked_chunks += [c for c, _, _ in entries]
        self.ack_latency.add(latencies)
        fresh = [lat for lat, (_, _, resent) in zip(latencies, entries, strict=True) if not resent]
        if fresh:
            self._note_round_trip(max(fresh))
        if self._ack_log is not None:
            os.write(self._ack_log, b"%d\n" % len(entries))

    def _note_round_trip(self, seconds: float) -> None:
        if self._srtt is None:
            self._srtt, self._rttvar = seconds, seconds / 2
        else:
            self._rttvar += (abs(self._srtt - seconds) - self._rttvar) / 4
            self._srtt += (seconds - self._srtt) / 8
        self._backoff = 1

    def poll(self, timeout_ms: int) -> Inbox:
        """Receive whatever the hub sent within ``timeout_ms`` (acks, leases, revocations)."""
        inbox = Inbox()
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return inbox
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return inbox
            if len(frames) != 1:
                self.rejects.reject("malformed", f"expected 1 frame, got {len(frames)}", "hub")
                continue
            try:
                msg = self.decoder.decode(frames[0])
            except WireError as err:
                self.rejects.reject(err.reason, err, "hub")
                continue
            self._last_heard = time.monotonic()
            if isinstance(msg, ChunkAck):
                pop = self.unacked.pop
                keys = zip(
                    unpack_i64(msg.group_ids).tolist(),
                    unpack_i32(msg.samples).tolist(),
                    unpack_i32(msg.seqs).tolist(),
                    strict=True,
                )
                entries = [e for e in [pop(key, None) for key in keys] if e is not None]
                if entries:
                    self._note_acked(entries, inbox)
                for rej in msg.rejected:
                    self._on_rejected(rej, inbox)
            elif isinstance(msg, Lease):
                if msg.lease_id in self.lease_ids or msg.lease_id in self._ended_leases:
                    self.duplicate_leases += 1
                    continue
                self.lease_ids.add(msg.lease_id)
                inbox.leases.append(msg)
            elif isinstance(msg, Revoke):
                self.lease_ids.difference_update(msg.lease_ids)
                self.forget_chunks(msg.lease_ids)
                inbox.revoked.extend(msg.lease_ids)
            elif isinstance(msg, RegisterAgain) and not self._stale(msg):
                # The hub evicted us (we were silent too long): it re-issued our leases already.
                log.warning(
                    "the hub no longer knows this generator: registering again, dropping %d leases", len(self.lease_ids)
                )
                inbox.revoked.extend(self.lease_ids)
                self.lease_ids.clear()
                self.register(self.weight_version)  # (saying whether it drains: no new lease then)

    def _stale(self, again: RegisterAgain) -> bool:
        """A RegisterAgain answering a heartbeat sent before our last Register: the hub knows us
        again already, and registering once more would make it re-issue our new leases."""
        if again.registration >= 0:
            return again.registration < self.registrations
        return time.monotonic() - self._registered_at <= 2 * self.heartbeat_s  # (a hub that does not echo)

    def _on_rejected(self, rej: ChunkRejection, inbox: Inbox) -> None:
        """A chunk the hub refused for good: not resent; and if the hub says its lease is no
        longer ours, the lease is dropped as a Revoke would drop it (the Revoke was lost, dropped
        at the hub's high-water mark, or never sent: a re-issue after a re-registration)."""
        key = (rej.group_id, rej.sample, rej.seq)
        entry = self.unacked.get(key)
        lease_id = rej.lease_id if rej.lease_id >= 0 else (None if entry is None else entry[0].lease_id)
        if entry is not None and entry[0].lease_id == lease_id:  # (else: the same sample's newer lease's)
            del self.unacked[key]
            inbox.rejected += 1
            log.debug("hub rejected chunk %s of lease %s: %s", key, lease_id, rej.reason)
        if rej.reason in LEASE_GONE_REASONS and lease_id in self.lease_ids:
            log.info("the hub no longer counts lease %d as ours (%s): dropping it", lease_id, rej.reason)
            self.lease_ids.discard(lease_id)
            self.forget_chunks([lease_id])
            inbox.revoked.append(lease_id)

    def lease_done(self, lease_id: int) -> None:
        self.lease_ids.discard(lease_id)
        self._remember_ended(lease_id)

    def _remember_ended(self, lease_id: int) -> None:
        self._ended_leases[lease_id] = None
        if len(self._ended_leases) > ENDED_LEASES_REMEMBERED:
            del self._ended_leases[next(iter(self._ended_leases))]

    def forget_chunks(self, lease_ids: list[int]) -> int:
        """Stop resending revoked leases' chunks: the hub refuses them for good (and a rejection of
        one could only meet the same sample's chunk of a newer lease)."""
        if not lease_ids or not self.unacked:
            return 0
        dead = set(lease_ids)
        gone = [key for key, (c, _, _) in self.unacked.items() if c.lease_id in dead]
        for key in gone:
            del self.unacked[key]
        return len(gone)

    def release(self, lease_ids: list[int]) -> None:
        """Give leases back unfinished; the hub re-issues their unfinished samples to others."""
        if lease_ids:
            self.lease_ids.difference_update(lease_ids)
            for lease_id in lease_ids:  # a copy the hub sent before the Release reached it is not work
                self._remember_ended(lease_id)
            self._send(encode(Release(generator_id=self.generator_id, lease_ids=sorted(lease_ids))))

    def drain(self) -> None:
        """Ask for no more leases (sent at once and with every heartbeat after)."""
        self.draining = True
        self.heartbeat(force=True)

    def _send(self, payload: bytes) -> None:
        # at the high-water mark a frame is dropped: unacked chunks are resent, heartbeats repeat
        with contextlib.suppress(zmq.Again):
            self.sock.send(payload, zmq.NOBLOCK)

    def close(self) -> None:
        # a Release or a last heartbeat still queued gets half a second; a hub away costs no more
        self.sock.close(linger=500)
        if self._ack_log is not None:
            os.close(self._ack_log)
            self._ack_log = None
