"""Wire messages shared by every Flywheel service, and their msgpack codec.

Every network message is a msgpack map with a ``type`` tag and a schema version ``sv``. Token
ids, log-probabilities and versions travel as packed little-endian arrays (``bytes``), never as
Python lists. ``decode`` validates structure (msgspec: types, required fields, unknown fields)
and then semantics (``Message.check``); both kinds of failure raise ``WireError`` whose
``field`` names the offending field and whose ``reason`` is a short, countable label.

Nothing here is ever unpickled: msgspec builds only the structs named below.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import msgspec
import numpy as np

SCHEMA_VERSION = 1
"""Bumped whenever a message changes incompatibly; peers with another value are rejected."""

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
GROUP_ID_DTYPE = np.dtype("<i8")

FINISH_REASONS = ("stop", "length", "abort")
"""Why a sample ended: an EOS/stop string, ``max_tokens``, or the generator aborted it."""


class WireError(ValueError):
    """A message that failed validation. ``reason`` is a short label used for counters."""

    def __init__(self, reason: str, field: str, detail: str) -> None:
        super().__init__(f"{reason}: field `{field}`: {detail}")
        self.reason = reason
        self.field = field
        self.detail = detail


def pack_i32(values: object) -> bytes:
    """Pack a sequence of ints as little-endian int32 (token ids, versions)."""
    return np.asarray(values, dtype=TOKEN_DTYPE).tobytes()


def pack_f32(values: object) -> bytes:
    """Pack a sequence of floats as little-endian float32 (log-probabilities)."""
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def pack_i64(values: object) -> bytes:
    return np.asarray(values, dtype=GROUP_ID_DTYPE).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def unpack_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=LOGPROB_DTYPE)


def unpack_i64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=GROUP_ID_DTYPE)


def _require(ok: bool, field: str, detail: str) -> None:
    if not ok:
        raise WireError("invalid_field", field, detail)


def _check_packed(data: bytes, itemsize: int, field: str) -> int:
    _require(len(data) % itemsize == 0, field, f"packed array of {len(data)} bytes is not a multiple of {itemsize}")
    return len(data) // itemsize


def _check_nonneg(value: int, field: str) -> None:
    _require(value >= 0, field, f"must be >= 0, got {value}")


class Rejections:
    """Messages a receiver refused, counted by reason in ``counts``.

    Each reason is logged at most once per ``interval_s``, with how many were suppressed since:
    a flood of garbage costs a counter increment per message, not a log line.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.counts: Counter[str] = Counter()
        self.interval_s = interval_s
        self._log = logger
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def reject(self, reason: str, detail: object, peer: bytes | str = b"") -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        if now - self._last.get(reason, -math.inf) >= self.interval_s:
            more = self._suppressed.pop(reason, 0)
            suffix = f" (+{more} more since last report)" if more else ""
            self._log.warning("rejected %s from %r: %s%s", reason, peer, detail, suffix)
            self._last[reason] = now
        else:
            self._suppressed[reason] += 1


class Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True, gc=False):
    """Base of every wire message. ``sv`` is the schema version of the sender.

    ``gc=False`` (here and on every struct of the wire and the store): messages are trees of
    bytes, numbers and lists, never cycles, so the cyclic GC need not track them; a hub holding
    the chunks of thousands of open samples then pays no collector pauses for them."""

    sv: int = SCHEMA_VERSION

    def check(self) -> None:
        """Semantic validation beyond types; raises WireError naming the field."""


# --------------------------------------------------------------------------- generator → hub


MAX_MODEL_CHARS = 4096  # a Register's model name or path
MAX_BREAKDOWN = 1024  # a Score's named reward terms
MAX_BREAKDOWN_NAME = 256  # characters of one term's name
MAX_ERROR_CHARS = 16384  # a Score's error text (the reward service clips longer ones)
MAX_SYNC_SPAN_S = 86400.0  # a WeightsReady's deadline after its announcement (sync.timeout_s is far less)


def clip_error(text: str) -> str:
    """``text`` within MAX_ERROR_CHARS: its start (what failed) and its end (where)."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2 - 16
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


class Register(Message, tag=True):
    """A generator announces itself (and again after it restarts or the hub restarts)."""

    generator_id: str  # stable id; also the ZMQ routing identity of the generator's socket
    model: str  # model path or name the generator serves
    capacity: int  # how many leases (prompt groups) it runs at once
    weight_version: int  # policy version of the weights it currently serves
    # stopping (it registers again after the hub forgot it): no new lease, as a heartbeat's says
    draining: bool = False

    def check(self) -> None:
        _require(0 < len(self.generator_id) <= 128, "generator_id", "must be 1..128 characters")
        # (kept in the hub's memory and in Redis, rewritten at every version change)
        _require(len(self.model) <= MAX_MODEL_CHARS, "model", f"must be at most {MAX_MODEL_CHARS} characters")
        _require(1 <= self.capacity <= 65536, "capacity", f"must be in 1..65536, got {self.capacity}")
        _check_nonneg(self.weight_version, "weight_version")


class Heartbeat(Message, tag=True):
    """Liveness and the generator's view of its work; extends the deadlines of its leases."""

    generator_id: str
    weight_version: int  # version now served (changes after a weight sync)
    lease_ids: list[int] = []  # leases still running on this generator
    draining: bool = False  # shutting down: send no new leases
    registration: int = 0  # how many Registers its sender had sent (a RegisterAgain echoes it)

    def check(self) -> None:
        _require(0 < len(self.generator_id) <= 128, "generator_id", "must be 1..128 characters")
        _check_nonneg(self.weight_version, "weight_version")
        _check_nonneg(self.registration, "registration")
        _require(len(self.lease_ids) <= 65536, "lease_ids", "too many lease ids")


class Chunk(Message, tag=True):
    """New tokens of one sample. Idempotent: the hub drops duplicates by (group, sample, seq)."""

    lease_id: int  # the lease this work belongs to; chunks of unknown leases are rejected
    group_id: int  # prompt group
    sample: int  # sample index inside the group, 0..n-1
    seq: int  # chunk sequence number inside the sample, from 0, contiguous
    tokens: bytes  # packed int32 token ids
    logprobs: bytes  # packed float32 behaviour log-probabilities, one per token
    versions: bytes  # packed int32 policy version that produced each token
    finish_reason: str | None = None  # set on the sample's last chunk only

    def check(self) -> None:
        _check_nonneg(self.lease_id, "lease_id")
        _check_nonneg(self.group_id, "group_id")
        _check_nonneg(self.sample, "sample")
        _require(0 <= self.seq < 1 << 24, "seq", f"must be in 0..2^24, got {self.seq}")
        n = _check_packed(self.tokens, 4, "tokens")
        _require(_check_packed(self.logprobs, 4, "logprobs") == n, "logprobs", f"needs {n} entries, one per token")
        _require(_check_packed(self.versions, 4, "versions") == n, "versions", f"needs {n} entries, one per token")
        _require(n > 0 or self.finish_reason is not None, "tokens", "empty chunk that does not finish its sample")
        if self.finish_reason is not None:
            _require(self.finish_reason in FINISH_REASONS, "finish_reason", f"must be one of {FINISH_REASONS}")
        if n:
            # One vectorised pass per array; cheap next to the socket and Redis costs.
            _require(bool(unpack_i32(self.tokens).min() >= 0), "tokens", "token ids must be >= 0")
            _require(bool(unpack_i32(self.versions).min() >= 0), "versions", "versions must be >= 0")
            lp = unpack_f32(self.logprobs)
            # NaN fails both comparisons, so this also rejects NaN.
            ok = bool(lp.max() <= 0.0) and bool(lp.min() > -np.inf)
            _require(ok, "logprobs", "log-probabilities must be finite and <= 0")


class ChunkBatch(Message, tag=True):
    """Several chunks in one frame: a generator flushes every sample's new tokens at once."""

    generator_id: str
    chunks: list[Chunk]

    def check(self) -> None:
        """Validate every chunk with one vectorised pass over all of their arrays.

        The hot path checks scalars inline and array values in bulk; only when something is
        wrong does it fall back to per-chunk checks, to name the exact field.
        """
        chunks = self.chunks
        _require(len(chunks) <= 65536, "chunks", "at most 65536 chunks per batch")
        for c in chunks:
            nbytes = len(c.tokens)
            if (
                nbytes & 3
                or len(c.logprobs) != nbytes
                or len(c.versions) != nbytes
                or c.lease_id < 0
                or c.group_id < 0
                or c.sample < 0
                or not 0 <= c.seq < 1 << 24
                or (c.finish_reason is None and nbytes == 0)
                or (c.finish_reason is not None and c.finish_reason not in FINISH_REASONS)
            ):
                self._locate_error()
        if not chunks:
            return
        tokens = unpack_i32(b"".join([c.tokens for c in chunks]))
        versions = unpack_i32(b"".join([c.versions for c in chunks]))
        lp = unpack_f32(b"".join([c.logprobs for c in chunks]))
        if len(tokens) and not (tokens.min() >= 0 and versions.min() >= 0 and lp.max() <= 0.0 and lp.min() > -np.inf):
            self._locate_error()

    def _locate_error(self) -> None:
        for i, chunk in enumerate(self.chunks):
            try:
                chunk.check()
            except WireError as err:
                raise WireError(err.reason, f"chunks[{i}].{err.field}", err.detail) from None
        raise AssertionError("batch check failed but no chunk did")


class Release(Message, tag=True):
    """A generator gives leases back unfinished (draining, or its weights fell behind): re-issue them."""

    generator_id: str
    lease_ids: list[int]

    def check(self) -> None:
        _require(0 < len(self.generator_id) <= 128, "generator_id", "must be 1..128 characters")
        _require(len(self.lease_ids) <= 65536, "lease_ids", "too many lease ids")
        _require(len(set(self.lease_ids)) == len(self.lease_ids), "lease_ids", "names a lease twice")


# --------------------------------------------------------------------------- hub → generator


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """Sampling settings a lease carries (a subset of vLLM's SamplingParams)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []

    def check(self) -> None:
        # What vLLM would refuse (or crash on) later, refused here, on receipt.
        _require(1 <= self.max_tokens <= 1 << 24, "sampling.max_tokens", f"must be in 1..2^24, got {self.max_tokens}")
        ok = math.isfinite(self.temperature) and self.temperature >= 0
        _require(ok, "sampling.temperature", f"must be finite and >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "sampling.top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        _require(len(self.stop_token_ids) <= 65536, "sampling.stop_token_ids", "too many stop tokens")
        _require(all(t >= 0 for t in self.stop_token_ids), "sampling.stop_token_ids", "token ids must be >= 0")


class Lease(Message, tag=True):
    """Work for a generator: generate ``samples`` of one prompt group before ``deadline``."""

    lease_id: int
    group_id: int
    prompt_tokens: bytes  # packed int32
    samples: list[int]  # sample indices to generate (all of 0..n-1 unless re-issued)
    sampling: SamplingParams
    min_version: int  # the generator must serve weights >= this version (v - max_staleness)
    deadline: float  # unix time; extended by chunks and heartbeats; past it the lease is re-issued

    def check(self) -> None:
        _check_nonneg(self.lease_id, "lease_id")
        _check_nonneg(self.group_id, "group_id")
        _require(_check_packed(self.prompt_tokens, 4, "prompt_tokens") > 0, "prompt_tokens", "empty prompt")
        _require(0 < len(self.samples) <= 65536, "samples", "a lease needs 1..65536 samples")
        _require(all(0 <= s < 65536 for s in self.samples), "samples", "sample indices must be in 0..65535")
        self.sampling.check()
        _check_nonneg(self.min_version, "min_version")
        _require(math.isfinite(self.deadline), "deadline", "must be a finite unix time")


class ChunkRejection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    group_id: int
    sample: int
    seq: int
    reason: str  # e.g. "unknown_lease": stop resending this chunk
    # the chunk's lease: (group, sample, seq) alone names a chunk of a re-issued sample's new lease
    # as well as its old one's (seqs restart at 0); -1 from a hub that does not say
    lease_id: int = -1


# Rejection reasons that say the chunk's lease is no longer its generator's (revoked, expired,
# re-issued to another, or never known): the generator stops generating it even if the Revoke
# never came.
LEASE_GONE_REASONS = frozenset({"revoked_lease", "unknown_lease", "not_lease_owner"})


class ChunkAck(Message, tag=True):
    """Chunks now durable in Redis (or duplicates of durable ones), plus chunks refused for good."""

    group_ids: bytes  # packed int64
    samples: bytes  # packed int32
    seqs: bytes  # packed int32
    rejected: list[ChunkRejection] = []

    def check(self) -> None:
        n = _check_packed(self.group_ids, 8, "group_ids")
        _require(_check_packed(self.samples, 4, "samples") == n, "samples", f"needs {n} entries")
        _require(_check_packed(self.seqs, 4, "seqs") == n, "seqs", f"needs {n} entries")


class Revoke(Message, tag=True):
    """The hub took a lease back (expired and re-issued): stop generating it."""

    lease_ids: list[int]


class RegisterAgain(Message, tag=True):
    """The hub does not know this generator (it was evicted after going silent): its leases are
    gone; send Register again to get new ones."""

    generator_id: str
    # the registration of the heartbeat it answers: one answering a heartbeat sent before the
    # generator's last Register is stale (-1: a hub that does not say)
    registration: int = -1


# --------------------------------------------------------------------------- hub ↔ reward service


class RewardRegister(Message, tag=True):
    """A reward worker announces itself and how many samples it scores at once."""

    worker_id: str
    capacity: int

    def check(self) -> None:
        _require(0 < len(self.worker_id) <= 128, "worker_id", "must be 1..128 characters")
        _require(1 <= self.capacity <= 65536, "capacity", f"must be in 1..65536, got {self.capacity}")


class ScoreRequest(Message, tag=True):
    """A completed sample to score."""

    group_id: int
    sample: int
    prompt_tokens: bytes  # packed int32
    response_tokens: bytes  # packed int32
    finish_reason: str
    metadata: dict[str, str | int | float | bool | None] = {}  # dataset fields (e.g. the label)
    # The prompt as the dataset gave it (a chat list: its last user message); None: the reward
    # functions get the prompt tokens decoded
    prompt_text: str | None = None


class Score(Message, tag=True):
    """The reward of one sample. ``error`` set means scoring failed (reward is then ignored)."""

    worker_id: str
    group_id: int
    sample: int
    reward: float
    breakdown: dict[str, float] = {}
    error: str | None = None

    def check(self) -> None:
        _check_nonneg(self.group_id, "group_id")
        _check_nonneg(self.sample, "sample")
        _require(math.isfinite(self.reward), "reward", "must be finite")
        # stored with the sample and logged: bounded, as everything a peer can make the hub keep
        _require(len(self.breakdown) <= MAX_BREAKDOWN, "breakdown", f"at most {MAX_BREAKDOWN} entries")
        _require(
            all(len(k) <= MAX_BREAKDOWN_NAME for k in self.breakdown),
            "breakdown",
            f"names of at most {MAX_BREAKDOWN_NAME} characters",
        )
        _require(
            self.error is None or len(self.error) <= MAX_ERROR_CHARS, "error", f"at most {MAX_ERROR_CHARS} characters"
        )


class ScoreBatch(Message, tag=True):
    """The rewards of a worker batch in one frame (one message per sample cost the hub and the
    reward service a receive, a decode and a send each)."""

    worker_id: str
    scores: list[Score]

    def check(self) -> None:
        _require(len(self.scores) <= 65536, "scores", "at most 65536 scores per batch")
        for i, score in enumerate(self.scores):
            try:
                score.check()
            except WireError as err:
                raise WireError(err.reason, f"scores[{i}].{err.field}", err.detail) from None

    def split_valid(self) -> tuple[list[Score], list[tuple[Score, WireError]]]:
        """The scores that pass their check, and those that do not with why: a receiver that
        decoded the batch unchecked (``Decoder.decode(check=False)``) after ``check`` named a
        score keeps the others rather than refusing the frame."""
        good: list[Score] = []
        bad: list[tuple[Score, WireError]] = []
        for score in self.scores:
            try:
                score.check()
                good.append(score)
            except WireError as err:
                bad.append((score, err))
        return good, bad


# --------------------------------------------------------------------------- learner → generators


class BucketLayout(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, gc=False):
    """One flat bucket of parameters: tensors are laid end to end in this order."""

    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    nbytes: int


class WeightsReady(Message, tag=True):
    """Weights of ``version`` are about to be broadcast; join the transfer before ``deadline``.

    The transfer runs over a standalone process group: rank 0 is the learner, which hosts the
    rendezvous store at ``master_addr:master_port``; a generator with W workers takes ranks
    ``ranks[generator_id] .. ranks[generator_id] + W - 1``. ``epoch`` names the group: while it
    stays the same, receivers reuse the group they already joined.

    ``deadline`` is on the learner's clock, and so is ``announced_at``, the time it sent this. A
    receiver times the sync on its own clock: ``on_receipt`` sets ``local_deadline`` to when it
    read the message plus ``deadline - announced_at``, and every wait reads ``due``. So a
    generator host whose clock is off from the learner's (no NTP, a drifting VM) still gives the
    sync its whole time, where comparing the learner's deadline with its own clock would give up
    that many seconds early (or wait that many late).
    """

    version: int
    buckets: list[BucketLayout]
    transport: str  # "nccl" | "gloo" | "ipc"
    deadline: float  # unix time, the learner's
    epoch: int  # process-group generation; a new one after every membership change or failure
    master_addr: str
    master_port: int
    world_size: int
    ranks: dict[str, int]  # generator id -> its first rank in the group
    # the learner's unix time when it announced this sync; 0: a sender that does not say (its
    # deadline is then taken as it is, on the receiver's clock)
    announced_at: float = 0.0
    # set by the generator that received it, for its workers: the deadline on its own clock
    local_deadline: float = 0.0

    def on_receipt(self, now: float) -> WeightsReady:
        """This announcement as read at ``now`` on the receiver's clock: ``due`` is then ``now``
        plus the time the learner gave the sync."""
        if self.announced_at <= 0:
            return self
        return msgspec.structs.replace(self, local_deadline=now + (self.deadline - self.announced_at))

    @property
    def due(self) -> float:
        """The deadline on this host's clock (``on_receipt``), else as the learner sent it."""
        return self.local_deadline or self.deadline

    @property
    def sync_stamp(self) -> float:
        """What tells this sync from another of the same version on both sides, whatever clock
        each reads (the ipc transport's store keys): the learner's ``announced_at``."""
        return self.announced_at or self.deadline

    def check(self) -> None:
        _check_nonneg(self.version, "version")
        _check_nonneg(self.epoch, "epoch")
        _require(len(self.buckets) <= 1 << 20, "buckets", "too many buckets")
        for i, b in enumerate(self.buckets):
            k = len(b.names)
            _require(
                len(b.shapes) == k and len(b.dtypes) == k, f"buckets[{i}]", "names, shapes, dtypes differ in length"
            )
            _require(b.nbytes >= 0, f"buckets[{i}].nbytes", "must be >= 0")
        _require(self.transport in ("nccl", "gloo", "ipc"), "transport", "must be nccl, gloo or ipc")
        _require(math.isfinite(self.deadline), "deadline", "must be a finite unix time")
        for name in ("announced_at", "local_deadline"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, name, f"must be a finite unix time or 0, got {value}")
        if self.announced_at > 0:
            span = self.deadline - self.announced_at
            ok = 0 <= span <= MAX_SYNC_SPAN_S
            _require(ok, "deadline", f"must be 0..{MAX_SYNC_SPAN_S:g}s after announced_at, got {span:g}s")
        _require(0 < self.master_port < 65536, "master_port", f"must be a TCP port, got {self.master_port}")
        _require(1 <= self.world_size <= 65536, "world_size", f"must be in 1..65536, got {self.world_size}")
        for gen, rank in self.ranks.items():
            _require(0 < rank < self.world_size, "ranks", f"rank {rank} of {gen!r} is outside 1..world_size-1")


class SyncJoin(Message, tag=True):
    """A generator asks to be part of the next weight sync (sent every heartbeat to the learner)."""

    generator_id: str
    version: int  # the version it serves now
    workers: int  # ranks it needs in the group: one per vLLM worker (tensor-parallel size)
    # True while it holds no usable policy weights (it started on the base model and waits for
    # the learner's, or an update failed half-way): the learner sends it the current ones even
    # when its version looks current
    needs_weights: bool = False
    # True once, as it stops (drained, or shut down): the learner leaves it out of the next syncs at
    # once rather than name it for member_timeout_s more, each such sync waiting out its deadline
    # for ranks that never come (and the whole fleet paused meanwhile)
    leaving: bool = False
    # Drawn once per process: a new process under a known id (restarted, or a spare taking its
    # place) at the same version holds none of the group the old one was in. "" (an older
    # sender): told apart by its version going back only.
    incarnation: str = ""

    def check(self) -> None:
        _require(0 < len(self.generator_id) <= 128, "generator_id", "must be 1..128 characters")
        _check_nonneg(self.version, "version")
        _require(1 <= self.workers <= 1024, "workers", f"must be in 1..1024, got {self.workers}")
        _require(len(self.incarnation) <= 64, "incarnation", "must be at most 64 characters")


class WeightsAck(Message, tag=True):
    """A generator now serves ``version`` (or says, in ``error``, why it could not load it)."""

    generator_id: str
    version: int
    epoch: int
    error: str | None = None
    seconds: float = 0.0  # time from WeightsReady to weights loaded, as the generator measured it

    def check(self) -> None:
        _require(0 < len(self.generator_id) <= 128, "generator_id", "must be 1..128 characters")
        _check_nonneg(self.version, "version")


# --------------------------------------------------------------------------- codec

ToHub = Register | Heartbeat | Chunk | ChunkBatch | Release | RewardRegister | Score | ScoreBatch
ToGenerator = Lease | ChunkAck | Revoke | RegisterAgain
ToLearner = SyncJoin | WeightsAck

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def encode_list(msgs: list[Chunk]) -> bytes:
    return _encoder.encode(msgs)


class Decoder:
    """Decodes and validates one family of messages (e.g. what the hub may receive)."""

    def __init__(self, kind: object, max_bytes: int = 64 << 20) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)
        self.max_bytes = max_bytes

    def decode(self, data: bytes, check: bool = True) -> Message:
        """Decode and validate. ``check=False`` skips the value checks (the types are still
        enforced): only for a receiver that then checks the message's parts itself."""
        if len(data) > self.max_bytes:
            raise WireError("oversized", "<frame>", f"{len(data)} bytes > limit {self.max_bytes}")
        try:
            msg = self._decoder.decode(data)
        except msgspec.ValidationError as err:
            raise WireError("malformed", _field_of(str(err)), str(err)) from None
        except (msgspec.DecodeError, UnicodeDecodeError, ValueError, OverflowError, RecursionError) as err:
            # msgspec raises UnicodeDecodeError for invalid UTF-8 in a str field (seen by fuzzing)
            raise WireError("malformed", "<frame>", f"{type(err).__name__}: {err}") from None
        if msg.sv != SCHEMA_VERSION:
            raise WireError(
                "schema_version",
                "sv",
                f"peer speaks schema {msg.sv}, this build speaks {SCHEMA_VERSION}; run the same Flywheel version everywhere",
            )
        if check:
            msg.check()
        return msg


def _field_of(error_text: str) -> str:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.chunks[0].seq`"
    marker = "at `$"
    at = error_text.rfind(marker)
    if at >= 0:
        return error_text[at + len(marker) :].rstrip("`").lstrip(".") or "<root>"
    if "field `" in error_text:
        return error_text.split("field `", 1)[1].split("`", 1)[0]
    return "<root>"
