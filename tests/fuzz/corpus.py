"""Fuzz corpora: structured seeds drawn by hypothesis once, then a fast in-house mutator.

Hypothesis draws message-shaped msgpack maps from the wire schema itself (``msgspec.inspect``):
every message type, with well-typed fields, wrong-typed fields, missing and unknown fields,
unknown and misplaced ``type`` tags, foreign schema versions, invalid UTF-8 in strings. That
costs milliseconds an example, so it runs once per session (tests/fuzz/conftest.py); the
mutator then derives hundreds of thousands of messages from them (and from real, valid
messages) at some microseconds each: truncations, bit flips, interesting bytes, splices, random bytes, lying
msgpack length headers, deep nesting, empty and extra frames, frames over the size limit.

An oracle per socket says, for each mutant, which rejection reason(s) the receiver must count,
or ``None`` when the mutant is a message the receiver would accept (those are not sent: the
flood holds only messages that must be refused, so counters can be compared exactly).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import msgspec
import msgspec.inspect as mi
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from flywheel import wire
from flywheel.wire import (
    BucketLayout,
    Chunk,
    ChunkAck,
    ChunkBatch,
    ChunkRejection,
    Decoder,
    Heartbeat,
    Lease,
    Register,
    RegisterAgain,
    Release,
    Revoke,
    RewardRegister,
    SamplingParams,
    Score,
    ScoreBatch,
    ScoreRequest,
    SyncJoin,
    WeightsAck,
    WeightsReady,
    WireError,
    encode,
    pack_f32,
    pack_i32,
    pack_i64,
)

MESSAGES: list[type[wire.Message]] = [
    Register,
    Heartbeat,
    Chunk,
    ChunkBatch,
    Release,
    RewardRegister,
    Score,
    ScoreBatch,
    Lease,
    ChunkAck,
    Revoke,
    RegisterAgain,
    ScoreRequest,
    WeightsReady,
    SyncJoin,
    WeightsAck,
]
TAGS = [m.__name__ for m in MESSAGES]
M = TypeVar("M", bound=wire.Message)

Frames = list[bytes]
Oracle = Callable[[Frames], "tuple[str, ...] | None"]

# ------------------------------------------------------------------------------ hypothesis seeds

EDGE_INTS = [0, -1, 1, 3, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1, 65535, 65536, 1 << 24]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]
EDGE_TEXT = ["", "stop", "length", "abort", "nccl", "gloo", "ipc", "good", "x" * 129, "\x00", "é" * 70]


def _ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-5, 70), st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))


def _packed() -> st.SearchStrategy[bytes]:
    """Packed arrays as the wire carries them: right and wrong lengths, odd values (NaN, < 0)."""
    i32 = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6).map(pack_i32)
    f32 = st.lists(st.floats(width=32), max_size=6).map(pack_f32)
    i64 = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(pack_i64)
    return st.one_of(i32, f32, i64, st.binary(max_size=24))


ANY: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


def _of_type(t: mi.Type) -> st.SearchStrategy[Any]:
    """Well-typed values for one field of the schema (not necessarily valid ones)."""
    if isinstance(t, mi.IntType):
        return _ints()
    if isinstance(t, mi.FloatType):
        return st.one_of(st.floats(), st.sampled_from(EDGE_FLOATS))
    if isinstance(t, mi.StrType):
        return st.one_of(st.text(max_size=16), st.sampled_from(EDGE_TEXT))
    if isinstance(t, mi.BytesType):
        return _packed()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(_of_type(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(_of_type(t.key_type), _of_type(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        return st.one_of([_of_type(x) for x in t.types])
    if isinstance(t, mi.StructType):
        return _struct_map(t)
    return ANY


def _struct_map(t: mi.StructType) -> st.SearchStrategy[dict[str, Any]]:
    required = {f.encode_name: _of_type(f.type) for f in t.fields if f.required}
    optional = {f.encode_name: _of_type(f.type) for f in t.fields if not f.required}
    if t.tag_field is not None:
        required[t.tag_field] = st.just(t.tag)
    return st.fixed_dictionaries(required, optional=optional)


PERTURBATIONS = ("none", "none", "wrong_type", "drop", "extra", "tag_unknown", "tag_other", "sv", "no_tag", "array")


def _perturb(args: tuple[dict[str, Any], str, Any, str, str, int]) -> Any:
    msg, how, junk, word, other_tag, pick = args
    keys = [k for k in msg if k != "type"]
    key = keys[pick % len(keys)] if keys else "sv"
    if how == "wrong_type":
        msg[key] = junk
    elif how == "drop" and keys:
        del msg[key]
    elif how == "extra":
        msg[word or "x"] = junk
    elif how == "tag_unknown":
        msg["type"] = word
    elif how == "tag_other":
        msg["type"] = other_tag
    elif how == "sv":
        msg["sv"] = wire.SCHEMA_VERSION + 1 if junk == wire.SCHEMA_VERSION else junk
    elif how == "no_tag":
        msg.pop("type", None)
    elif how == "array":
        return list(msg.values())
    return msg


def message_maps() -> st.SearchStrategy[Any]:
    """A message-shaped msgpack value: a map of one message type, perhaps perturbed."""
    per_type = [_struct_map(mi.type_info(m)) for m in MESSAGES]  # type: ignore[arg-type]
    return st.tuples(
        st.one_of(per_type),
        st.sampled_from(PERTURBATIONS),
        ANY,
        st.text(max_size=8),
        st.sampled_from(TAGS),
        st.integers(0, 1000),
    ).map(_perturb)


def _pack(value: Any, str_bytes: bool) -> bytes:
    # use_bin_type=False writes bytes as msgpack *str*: invalid UTF-8 where strings are expected
    return msgpack.packb(value, use_bin_type=not str_bytes)


def hypothesis_seeds(n: int, seed: int = 0) -> list[bytes]:
    """Draw ``n`` message-shaped msgpack encodings with hypothesis (deterministic for a seed)."""
    out: list[bytes] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(message_maps(), st.booleans())
    def draw(value: Any, str_bytes: bool) -> None:
        out.append(_pack(value, str_bytes))

    draw()
    return out


# ------------------------------------------------------------------------------ valid seeds


def valid_messages(lease: Lease | None = None) -> list[wire.Message]:
    """Real, valid messages of every type (chunks for ``lease`` when given)."""
    lease_id, group, samples = (lease.lease_id, lease.group_id, lease.samples) if lease else (0, 0, [0, 1])
    n = 4
    chunk = Chunk(
        lease_id=lease_id,
        group_id=group,
        sample=samples[-1],
        seq=0,
        tokens=pack_i32(range(100, 100 + n)),
        logprobs=pack_f32(np.full(n, -0.5)),
        versions=pack_i32(np.zeros(n)),
        finish_reason=None,
    )
    final = msgspec.structs.replace(chunk, seq=1, finish_reason="stop")
    sampling = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=-1, seed=3, stop_token_ids=[2])
    buckets = [BucketLayout(names=["w", "b"], shapes=[[4, 4], [4]], dtypes=["float32", "float32"], nbytes=80)]
    return [
        Register(generator_id="gen-a", model="tiny", capacity=2, weight_version=0),
        Heartbeat(generator_id="gen-a", weight_version=0, lease_ids=[lease_id], draining=False),
        chunk,
        ChunkBatch(generator_id="gen-a", chunks=[chunk, final]),
        Release(generator_id="gen-a", lease_ids=[lease_id]),
        RewardRegister(worker_id="rw-a", capacity=4),
        Score(worker_id="rw-a", group_id=group, sample=0, reward=1.0, breakdown={"len": 0.5}),
        ScoreBatch(
            worker_id="rw-a",
            scores=[
                Score(worker_id="rw-a", group_id=group, sample=0, reward=1.0),
                Score(worker_id="rw-a", group_id=group, sample=1, reward=0.0, error="timeout: slow"),
            ],
        ),
        Lease(
            lease_id=lease_id,
            group_id=group,
            prompt_tokens=pack_i32([1, 2, 3]),
            samples=list(samples),
            sampling=sampling,
            min_version=0,
            deadline=1e9,
        ),
        ChunkAck(
            group_ids=pack_i64([group]),
            samples=pack_i32([0]),
            seqs=pack_i32([0]),
            rejected=[ChunkRejection(group_id=group, sample=1, seq=0, reason="unknown_lease")],
        ),
        Revoke(lease_ids=[lease_id]),
        RegisterAgain(generator_id="gen-a"),
        ScoreRequest(
            group_id=group,
            sample=0,
            prompt_tokens=pack_i32([1, 2]),
            response_tokens=pack_i32([3, 4]),
            finish_reason="stop",
            metadata={"label": "7", "n": 3},
        ),
        WeightsReady(
            version=1,
            buckets=buckets,
            transport="gloo",
            deadline=1e9,
            epoch=1,
            master_addr="127.0.0.1",
            master_port=29500,
            world_size=2,
            ranks={"gen-a": 1},
        ),
        SyncJoin(generator_id="gen-a", version=0, workers=1),
        WeightsAck(generator_id="gen-a", version=1, epoch=1),
    ]


def valid(cls: type[M]) -> M:
    """The valid message of type ``cls`` from ``valid_messages()``."""
    return next(m for m in valid_messages() if isinstance(m, cls))


def ack_of(chunk: Chunk) -> ChunkAck:
    return ChunkAck(group_ids=pack_i64([chunk.group_id]), samples=pack_i32([chunk.sample]), seqs=pack_i32([chunk.seq]))


def valid_seeds(lease: Lease | None = None) -> list[bytes]:
    return [encode(m) for m in valid_messages(lease)]


# ------------------------------------------------------------------------------ the mutator

INTERESTING = bytes([0x00, 0x01, 0x7F, 0x80, 0xC0, 0xC1, 0xC2, 0xC3, 0xCA, 0xCB, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF])
# msgpack headers that promise far more than follows: str32, bin32, array32, map32, ext32
LIARS = [
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc9\x7f",
]


class Mutator:
    """Derives malformed messages from seeds, a few microseconds each (``random`` only)."""

    def __init__(self, seeds: list[bytes], rng: random.Random) -> None:
        assert seeds
        self.seeds = seeds
        self.rng = rng
        self._random = rng.random
        self.ops: list[Callable[[], Frames]] = [
            self.as_is,
            self.truncate,
            self.truncate,
            self.bit_flip,
            self.bit_flip,
            self.bit_flip,
            self.interesting_byte,
            self.interesting_byte,
            self.insert_delete,
            self.splice,
            self.random_bytes,
            self.liar,
            self.nesting,
            self.frames,
        ]

    def _below(self, n: int) -> int:
        return int(self._random() * n)

    def seed(self) -> bytes:
        return self.seeds[self._below(len(self.seeds))]

    def one(self) -> Frames:
        return self.ops[self._below(len(self.ops))]()

    def as_is(self) -> Frames:
        return [self.seed()]

    def truncate(self) -> Frames:
        s = self.seed()
        return [s[: self._below(len(s))] if s else s]

    def bit_flip(self) -> Frames:
        b = bytearray(self.seed())
        for _ in range(1 + self._below(4)):
            if b:
                b[self._below(len(b))] ^= 1 << self._below(8)
        return [bytes(b)]

    def interesting_byte(self) -> Frames:
        b = bytearray(self.seed())
        for _ in range(1 + self._below(3)):
            if b:
                b[self._below(len(b))] = INTERESTING[self._below(len(INTERESTING))]
        return [bytes(b)]

    def insert_delete(self) -> Frames:
        s = self.seed()
        i = self._below(len(s) + 1)
        if self.rng.random() < 0.5:
            return [s[:i] + self.rng.randbytes(1 + self._below(8)) + s[i:]]
        return [s[:i] + s[i + 1 + self._below(8) :]]

    def splice(self) -> Frames:
        a, b = self.seed(), self.seed()
        return [a[: self._below(len(a) + 1)] + b[self._below(len(b) + 1) :]]

    def random_bytes(self) -> Frames:
        return [self.rng.randbytes(self._below(96))]

    def liar(self) -> Frames:
        return [LIARS[self._below(len(LIARS))] + self.rng.randbytes(self._below(12))]

    def nesting(self) -> Frames:
        depth = self.rng.choice((64, 600, 3000))
        return [self.rng.choice((b"\x91", b"\x81\xa1k")) * depth + b"\xc0"]

    def frames(self) -> Frames:
        """The wrong number of frames: an extra one (maybe empty) around a seed."""
        extra = self.rng.choice((b"", self.seed(), b"\x00"))
        return [self.seed(), extra] if self.rng.random() < 0.5 else [extra, self.seed(), self.seed()]

    def oversized(self, limit: int) -> Frames:
        """Over the checked limit (``limit``) and under ZMQ's own (4x): counted as 'oversized'."""
        size = limit + 1 + self._below(3 * limit - 1)
        s = self.seed()
        return [s + bytes(size - len(s))] if self.rng.random() < 0.5 else [self.rng.randbytes(size)]


def build_flood(
    n: int, mutator: Mutator, oracle: Oracle, oversized: int = 0, limit: int = 0
) -> tuple[list[Frames], Counter[str], int]:
    """``n`` messages the receiver must refuse, the reasons it must count, and how many mutants
    were skipped as acceptable. ``oversized`` of them are over ``limit`` bytes."""
    flood: list[Frames] = [mutator.oversized(limit) for _ in range(oversized)]
    expected: dict[str, int] = {"oversized": oversized} if oversized else {}
    skipped = 0
    one = mutator.one
    while len(flood) < n:
        frames = one()
        reasons = oracle(frames)
        if reasons is None:
            skipped += 1
            continue
        flood.append(frames)
        for reason in reasons:
            expected[reason] = expected.get(reason, 0) + 1
    mutator.rng.shuffle(flood)
    return flood, Counter(expected), skipped


# ------------------------------------------------------------------------------ oracles

MALFORMED = ("malformed",)


def decode_or_reason(decoder: Decoder, frames: Frames) -> wire.Message | tuple[str]:
    """The message, or the reason the receiver's checks refuse it (any other exception is a bug
    the fuzzer found, and propagates)."""
    if len(frames) != 1:
        return MALFORMED
    try:
        return decoder.decode(frames[0])
    except WireError as err:
        return (err.reason,)


def accept_valid(decoder: Decoder) -> Oracle:
    """A client: every valid message is accepted; only what fails validation is counted."""

    def oracle(frames: Frames) -> tuple[str, ...] | None:
        got = decode_or_reason(decoder, frames)
        return got if isinstance(got, tuple) else None

    return oracle


def hub_generator_port(decoder: Decoder, leases: dict[int, tuple[int, list[int]]]) -> Oracle:
    """The hub's generator ROUTER, for a sender whose identity no generator id can have (it
    is not valid UTF-8). ``leases``: live lease id -> (group id, samples), all held by others."""

    def chunk_reason(c: Chunk) -> str:
        lease = leases.get(c.lease_id)
        if lease is None or lease[0] != c.group_id or c.sample not in lease[1]:
            return "unknown_lease"
        return "not_lease_owner"

    def oracle(frames: Frames) -> tuple[str, ...] | None:
        msg = decode_or_reason(decoder, frames)
        if isinstance(msg, tuple):
            return msg
        if isinstance(msg, Register):
            return ("identity_mismatch",)
        if isinstance(msg, Heartbeat | Release):
            return ("unregistered_generator",)
        if isinstance(msg, Chunk):
            return (chunk_reason(msg),)
        if isinstance(msg, ChunkBatch):
            return tuple(chunk_reason(c) for c in msg.chunks) or None  # an empty batch is no error
        return ("wrong_socket",)

    return oracle


def hub_reward_port(decoder: Decoder) -> Oracle:
    """The hub's reward ROUTER while no score is in flight: every Score is unexpected."""

    def oracle(frames: Frames) -> tuple[str, ...] | None:
        msg = decode_or_reason(decoder, frames)
        if msg == ("invalid_field",):
            # a ScoreBatch whose scores fail their checks: each is refused on its own, the rest taken
            unchecked = decoder.decode(frames[0], check=False)
            if isinstance(unchecked, ScoreBatch) and len(unchecked.scores) <= 65536:
                good, bad = unchecked.split_valid()
                if bad:
                    return ("invalid_field",) * len(bad) + ("unexpected_score",) * len(good)
        if isinstance(msg, tuple):
            return msg
        if isinstance(msg, RewardRegister):
            return None  # a reward worker registering is accepted (and would be sent work)
        if isinstance(msg, Score):
            return ("unexpected_score",)
        if isinstance(msg, ScoreBatch):
            return ("unexpected_score",) * len(msg.scores) or None  # an empty batch is no error
        return ("wrong_socket",)

    return oracle


def learner_join_port(decoder: Decoder) -> Oracle:
    """The learner's ROUTER, for a sender whose identity is no generator's id."""

    def oracle(frames: Frames) -> tuple[str, ...] | None:
        msg = decode_or_reason(decoder, frames)
        return msg if isinstance(msg, tuple) else ("identity_mismatch",)

    return oracle


def every_message(reason: str) -> Oracle:
    """A socket on which nothing may arrive: each message is one rejection."""
    reasons = (reason,)
    return lambda frames: reasons
