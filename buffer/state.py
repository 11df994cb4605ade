"""The hub's in-memory mirror of what Redis holds durably (rebuilt from Redis on restart)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flywheel.staleness import GroupState, advance
from flywheel.store import GeneratorRecord, GroupMeta, LeaseRecord, StoredSample, StoredScore
from flywheel.wire import Chunk, unpack_i32


@dataclass
class SampleAssembly:
    """One sample being generated: chunks by sequence number until the last one arrives."""

    lease_id: int
    chunks: dict[int, Chunk] = field(default_factory=dict)
    pending: list[Chunk] = field(default_factory=list)  # accepted this turn, not yet in Redis
    blobs: list[bytes] = field(default_factory=list)  # Redis fields holding its earlier chunks
    final_seq: int | None = None
    done: StoredSample | None = None  # set once every chunk up to the final one is in
    version: int = -1  # oldest token version, once done
    score: StoredScore | None = None

    def is_complete(self) -> bool:
        return self.final_seq is not None and len(self.chunks) == self.final_seq + 1

    def assemble(self) -> StoredSample:
        """Concatenate the chunks in sequence order (they may have arrived out of order)."""
        assert self.final_seq is not None
        ordered = [self.chunks[i] for i in range(self.final_seq + 1)]
        versions = b"".join(c.versions for c in ordered)
        finish = ordered[-1].finish_reason
        assert finish is not None
        self.done = StoredSample(
            tokens=b"".join(c.tokens for c in ordered),
            logprobs=b"".join(c.logprobs for c in ordered),
            versions=versions,
            finish_reason=finish,
            lease_id=self.lease_id,
        )
        v = unpack_i32(versions)
        self.version = int(v.min()) if len(v) else 0
        self.chunks, self.pending = {}, []
        return self.done

    def take_blobs(self) -> list[bytes]:
        """Forget the stored chunks (now assembled or abandoned); return their Redis fields."""
        blobs, self.blobs, self.pending = self.blobs, [], []
        return blobs

    def restart(self, lease_id: int) -> list[bytes]:
        """Drop partial chunks (re-issued to a new lease); return the Redis fields to delete."""
        self.lease_id, self.chunks, self.final_seq = lease_id, {}, None
        return self.take_blobs()


@dataclass
class OpenGroup:
    """A group issued and not yet ready (ready groups live only in Redis)."""

    meta: GroupMeta
    samples: list[SampleAssembly]
    state: GroupState = GroupState.ISSUED

    def move(self, new: GroupState) -> None:
        self.state = advance(self.state, new)

    @property
    def version(self) -> int:
        return min(s.version for s in self.samples)

    def all_done(self) -> bool:
        return all(s.done is not None for s in self.samples)

    def all_scored(self) -> bool:
        return all(s.score is not None for s in self.samples)


@dataclass
class GeneratorInfo:
    record: GeneratorRecord
    identity: bytes  # ZMQ routing id
    last_seen: float
    leases: set[int] = field(default_factory=set)

    def free_slots(self) -> int:
        return self.record.capacity - len(self.leases)


@dataclass
class RewardWorker:
    identity: bytes
    capacity: int
    last_seen: float
    inflight: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class ActiveLease:
    record: LeaseRecord
    assigned_at: float = 0.0

    @property
    def lease_id(self) -> int:
        return self.record.lease_id
