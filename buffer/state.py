"""The hub's in-memory mirror of what Redis holds durably (rebuilt from Redis on restart)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from flywheel.staleness import GroupState, advance
from flywheel.store import GeneratorRecord, GroupMeta, LeaseRecord, SampleDone, StoredScore
from flywheel.wire import Chunk, unpack_i32

_first_i32 = struct.Struct("<i").unpack_from


@dataclass
class SampleAssembly:
    """One sample being generated: chunks by sequence number until the last one arrives."""

    lease_id: int
    chunks: dict[int, Chunk] = field(default_factory=dict)
    final_seq: int | None = None
    done: SampleDone | None = None  # set once every chunk up to the final one is in
    response: bytes | None = None  # packed tokens, kept only until the sample is scored
    score: StoredScore | None = None
    oldest: int | None = None  # version of the first token accepted: the oldest (note_chunk_version)
    tokens: int = 0  # accepted so far under this lease (at most the lease's max_tokens)

    def note_chunk_version(self, versions: bytes) -> None:
        """Called for the sample's first accepted chunk only (the hot path skips it after): its
        first token is the sample's oldest, since versions never decrease inside a sample. Were
        they to, or chunk 0 arrive after a later one, ``oldest`` would only be newer than the
        truth: a group found too old still is, and ``complete`` takes the exact minimum."""
        if len(versions) >= 4:
            self.oldest = _first_i32(versions)[0]

    @property
    def version(self) -> int:
        assert self.done is not None
        return self.done.version

    def is_complete(self) -> bool:
        return self.final_seq is not None and len(self.chunks) == self.final_seq + 1

    def complete(self) -> SampleDone:
        """Assemble the response (for scoring) and mark the sample done; chunks stay stored."""
        assert self.final_seq is not None
        # Only the tokens (for scoring) and the oldest version are needed here: the log-probs
        # stay in Redis for the learner, unjoined (this runs for every sample, on the hub's loop).
        ordered = [self.chunks[seq] for seq in range(self.final_seq + 1)]
        versions = unpack_i32(b"".join([c.versions for c in ordered]))
        finish = ordered[-1].finish_reason
        assert finish is not None
        self.done = SampleDone(
            finish_reason=finish,
            lease_id=self.lease_id,
            n_chunks=len(ordered),
            n_tokens=len(versions),
            version=int(versions.min()) if len(versions) else 0,
        )
        self.response = b"".join([c.tokens for c in ordered])
        self.chunks = {}
        return self.done

    def restart(self, lease_id: int) -> None:
        """Drop partial chunks: the sample is re-issued to a new lease and starts again at seq 0.
        Those already stored, or taken this turn (written with it: they were acknowledged), stay
        in Redis, superseded by the new lease's (``chunks_by_sample``)."""
        self.lease_id, self.chunks, self.final_seq = lease_id, {}, None
        self.oldest, self.tokens = None, 0


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
        """The oldest token version of the group. A sample with no token (a prompt that left no
        room to generate, an engine that stopped before the first token) has no version: counted
        as 0, it made the group look η versions old and dropped it at every claim."""
        versions = [s.version for s in self.samples if s.done is not None and s.done.n_tokens]
        return min(versions) if versions else self.meta.issued_at_version

    def all_done(self) -> bool:
        return all(s.done is not None for s in self.samples)

    def oldest_seen(self) -> int | None:
        """A lower bound on the version the group will have: the oldest token it holds so far."""
        seen = [s.oldest for s in self.samples if s.oldest is not None]
        return min(seen) if seen else None

    def all_scored(self) -> bool:
        return all(s.score is not None for s in self.samples)


@dataclass
class GeneratorInfo:
    record: GeneratorRecord
    identity: bytes  # ZMQ routing id
    last_seen: float
    leases: set[int] = field(default_factory=set)
    draining: bool = False  # shutting down: it finishes what it holds and gets nothing new

    def free_slots(self) -> int:
        return 0 if self.draining else self.record.capacity - len(self.leases)


@dataclass
class RewardWorker:
    identity: bytes
    capacity: int
    last_seen: float
    inflight: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class ActiveLease:
    record: LeaseRecord
    owner: bytes = b""  # routing identity of the generator running it; only it may send chunks
    min_version: int = 0  # the weights version its Lease message asked for
    sent_at: float = 0.0  # monotonic: when its Lease message was last sent
    confirmed: bool = False  # a heartbeat listed it or a chunk of it came: the generator has it
    resends: int = 0  # its Lease message sent again, taken for lost (Hub._resend_lost_leases)

    @property
    def lease_id(self) -> int:
        return self.record.lease_id
