"""A generator driven by the test: deterministic tokens, so the hub's output can be checked
token by token, and every step (send, pause, resend, die) under the test's control."""

from __future__ import annotations

import time

import numpy as np

from flywheel.wire import Chunk, Lease, pack_f32, pack_i32
from generators.hub_link import HubLink, Inbox


def tokens_of(group: int, sample: int, seq: int, n: int = 4) -> list[int]:
    """The tokens a hand generator emits for one chunk: a function of where they belong."""
    base = (group * 7919 + sample * 104729 + seq * 31) % 50000
    return [(base + i) % 50000 for i in range(n)]


def expected_sample(group: int, sample: int, n_chunks: int, n: int = 4) -> list[int]:
    return [t for seq in range(n_chunks) for t in tokens_of(group, sample, seq, n)]


def make_chunk(
    lease: Lease, sample: int, seq: int, version: int, final: bool, n: int = 4, group: int | None = None
) -> Chunk:
    g = lease.group_id if group is None else group
    return Chunk(
        lease_id=lease.lease_id,
        group_id=g,
        sample=sample,
        seq=seq,
        tokens=pack_i32(tokens_of(g, sample, seq, n)),
        logprobs=pack_f32(np.full(n, -0.5)),
        versions=pack_i32(np.full(n, version)),
        finish_reason="stop" if final else None,
    )


class HandGenerator:
    def __init__(
        self,
        address: str,
        gen_id: str,
        capacity: int = 1,
        resend_after_s: float = 0.5,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        self.link = HubLink(
            address,
            gen_id,
            "hand",
            capacity,
            resend_after_s=resend_after_s,
            heartbeat_s=0.2,
            max_message_bytes=max_message_bytes,
        )
        self.leases: list[Lease] = []
        self.revoked: list[int] = []
        self.acked = 0
        self.rejected = 0

    def register(self, version: int = 0) -> None:
        self.link.register(version)

    def pump(self, seconds: float = 0.1, heartbeat: bool = True) -> Inbox:
        """Exchange messages with the hub for a while (heartbeats and resends included)."""
        total = Inbox()
        end = time.monotonic() + seconds
        while True:
            inbox = self.link.poll(20)
            self.leases += inbox.leases
            self.revoked += inbox.revoked
            self.acked += inbox.acked
            self.rejected += inbox.rejected
            total.leases += inbox.leases
            total.revoked += inbox.revoked
            total.acked += inbox.acked
            total.rejected += inbox.rejected
            if heartbeat:
                self.link.heartbeat()
                self.link.resend_due()
            if time.monotonic() >= end:
                return total

    def wait_lease(self, timeout_s: float = 20.0) -> Lease:
        deadline = time.monotonic() + timeout_s
        start = len(self.leases)
        while len(self.leases) == start:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.link.generator_id}: no lease within {timeout_s}s")
            self.pump(0.05)
        return self.leases[-1]

    def send(self, *chunks: Chunk) -> None:
        self.link.send_chunks(list(chunks))

    def close(self) -> None:
        self.link.close()
