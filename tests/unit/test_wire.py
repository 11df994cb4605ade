"""Wire contracts: every message round-trips, and garbage is rejected naming the field."""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest

from flywheel.wire import (
    SCHEMA_VERSION,
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
    ToGenerator,
    ToHub,
    ToLearner,
    WeightsAck,
    WeightsReady,
    WireError,
    encode,
    pack_f32,
    pack_i32,
    pack_i64,
    unpack_f32,
    unpack_i32,
)

ANY = ToHub | ToGenerator | ToLearner | ScoreRequest | WeightsReady


def chunk(**over: object) -> Chunk:
    fields: dict[str, object] = dict(
        lease_id=3,
        group_id=7,
        sample=1,
        seq=0,
        tokens=pack_i32([5, 6, 7]),
        logprobs=pack_f32([-0.1, -2.0, 0.0]),
        versions=pack_i32([4, 4, 5]),
    )
    fields.update(over)
    return Chunk(**fields)  # type: ignore[arg-type]


READY = WeightsReady(
    version=5,
    transport="gloo",
    deadline=1e9,
    buckets=[BucketLayout(names=["w"], shapes=[[2, 3]], dtypes=["float32"], nbytes=24)],
    epoch=1,
    master_addr="127.0.0.1",
    master_port=29500,
    world_size=3,
    ranks={"gen-0": 1, "gen-1": 2},
)

EXAMPLES = [
    Register(generator_id="gen-0", model="tiny", capacity=8, weight_version=3),
    Heartbeat(generator_id="gen-0", weight_version=4, lease_ids=[1, 2]),
    chunk(),
    chunk(finish_reason="stop", seq=9),
    ChunkBatch(generator_id="gen-0", chunks=[chunk(), chunk(seq=1, finish_reason="length")]),
    Lease(
        lease_id=1,
        group_id=2,
        prompt_tokens=pack_i32([1, 2]),
        samples=[0, 1, 2, 3],
        sampling=SamplingParams(max_tokens=16, temperature=0.7),
        min_version=2,
        deadline=1e9,
    ),
    ChunkAck(
        group_ids=pack_i64([1, 2]),
        samples=pack_i32([0, 1]),
        seqs=pack_i32([5, 6]),
        rejected=[ChunkRejection(group_id=9, sample=0, seq=0, reason="unknown_lease")],
    ),
    Revoke(lease_ids=[4]),
    RegisterAgain(generator_id="gen-0"),
    RewardRegister(worker_id="rw", capacity=4),
    ScoreRequest(
        group_id=1,
        sample=0,
        prompt_tokens=pack_i32([1]),
        response_tokens=pack_i32([2, 3]),
        finish_reason="stop",
        metadata={"answer": "8", "n": 3},
    ),
    Score(worker_id="rw", group_id=1, sample=0, reward=1.0, breakdown={"format": 1.0}),
    ScoreBatch(
        worker_id="rw",
        scores=[
            Score(worker_id="rw", group_id=1, sample=0, reward=1.0, breakdown={"format": 1.0}),
            Score(worker_id="rw", group_id=1, sample=1, reward=0.0, error="timeout: no answer"),
        ],
    ),
    ScoreBatch(worker_id="rw", scores=[]),
    Heartbeat(generator_id="gen-0", weight_version=4, lease_ids=[], draining=True),
    Release(generator_id="gen-0", lease_ids=[3, 4]),
    READY,
    SyncJoin(generator_id="gen-0", version=4, workers=2),
    SyncJoin(generator_id="gen-0", version=0, workers=1, needs_weights=True),
    WeightsAck(generator_id="gen-0", version=5, epoch=1),
    WeightsAck(generator_id="gen-0", version=4, epoch=1, error="deadline passed"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__  # a msgpack map with a type tag
    back = Decoder(ANY).decode(data)
    assert back == msg


def test_arrays_are_packed_not_lists() -> None:
    raw = msgspec.msgpack.decode(encode(chunk()))
    assert isinstance(raw["tokens"], bytes) and len(raw["tokens"]) == 12
    assert unpack_i32(raw["tokens"]).tolist() == [5, 6, 7]
    assert np.allclose(unpack_f32(raw["logprobs"]), [-0.1, -2.0, 0.0])
    assert raw["sv"] == SCHEMA_VERSION


def _mutated(msg: object, **changes: object) -> bytes:
    raw = msgspec.msgpack.decode(encode(msg))  # type: ignore[arg-type]
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize(
    ("data", "reason", "field"),
    [
        (b"\x00\x01garbage", "malformed", "<root>"),
        (b"", "malformed", "<frame>"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed", "<root>"),
        (msgspec.msgpack.encode({"type": "Nope"}), "malformed", "type"),
        (_mutated(chunk(), seq="x"), "malformed", "seq"),
        (_mutated(chunk(), extra=1), "malformed", "extra"),
        (_mutated(chunk(), sv=SCHEMA_VERSION + 1), "schema_version", "sv"),
        (_mutated(chunk(), tokens=b"\x01\x02\x03"), "invalid_field", "tokens"),
        (_mutated(chunk(), logprobs=pack_f32([-1.0])), "invalid_field", "logprobs"),
        (_mutated(chunk(), versions=pack_i32([1, 1])), "invalid_field", "versions"),
        (_mutated(chunk(), logprobs=pack_f32([-1.0, math.nan, -1.0])), "invalid_field", "logprobs"),
        (_mutated(chunk(), logprobs=pack_f32([-1.0, 0.5, -1.0])), "invalid_field", "logprobs"),
        (_mutated(chunk(), tokens=pack_i32([1, -5, 2])), "invalid_field", "tokens"),
        (_mutated(chunk(), seq=-1), "invalid_field", "seq"),
        (_mutated(chunk(), finish_reason="exploded"), "invalid_field", "finish_reason"),
        (_mutated(chunk(), tokens=b"", logprobs=b"", versions=b""), "invalid_field", "tokens"),
        (
            _mutated(Register(generator_id="g", model="m", capacity=1, weight_version=0), capacity=0),
            "invalid_field",
            "capacity",
        ),
        (_mutated(Score(worker_id="w", group_id=1, sample=0, reward=0.0), reward=math.inf), "invalid_field", "reward"),
        # what a peer can make the hub keep (in memory, in Redis, in its log) is bounded
        (
            _mutated(Register(generator_id="g", model="m", capacity=1, weight_version=0), model="m" * 5000),
            "invalid_field",
            "model",
        ),
        (_mutated(Score(worker_id="w", group_id=1, sample=0, reward=0.0), error="e" * 20000), "invalid_field", "error"),
        (
            _mutated(
                Score(worker_id="w", group_id=1, sample=0, reward=0.0), breakdown={str(i): 0.0 for i in range(2000)}
            ),
            "invalid_field",
            "breakdown",
        ),
        (encode(Release(generator_id="g", lease_ids=[5, 5])), "invalid_field", "lease_ids"),
    ],
)
def test_garbage_is_rejected_naming_the_field(data: bytes, reason: str, field: str) -> None:
    with pytest.raises(WireError) as err:
        Decoder(ToHub).decode(data)
    assert err.value.reason == reason
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"needs_weights": "yes"}, "needs_weights"),
        ({"version": -1}, "version"),
        ({"workers": 0}, "workers"),
        ({"incarnation": "x" * 65}, "incarnation"),
    ],
)
def test_bad_sync_join_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(WireError) as err:
        Decoder(ToLearner).decode(_mutated(SyncJoin(generator_id="g", version=0, workers=1), **changes))
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"ranks": {"gen-0": 0}}, "ranks"),
        ({"ranks": {"gen-0": 3}}, "ranks"),
        ({"master_port": 0}, "master_port"),
        ({"world_size": 0}, "world_size"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"deadline": math.nan}, "deadline"),
        ({"buckets": [{"names": ["a", "b"], "shapes": [[1]], "dtypes": ["float32"], "nbytes": 4}]}, "buckets[0]"),
        ({"buckets": [{"names": ["a"], "shapes": [[1]], "dtypes": ["float32"], "nbytes": -4}]}, "buckets[0].nbytes"),
        ({"version": -1}, "version"),
        ({"announced_at": math.inf}, "announced_at"),
        ({"announced_at": -1.0}, "announced_at"),
        ({"local_deadline": math.nan}, "local_deadline"),
        ({"announced_at": 1e9 + 1}, "deadline"),  # a deadline before its announcement
        ({"announced_at": 1e9 - 86401}, "deadline"),  # more than a day to sync
    ],
)
def test_bad_weights_ready_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(WireError) as err:
        Decoder(WeightsReady).decode(_mutated(READY, **changes))
    assert err.value.field == field, str(err.value)


def test_a_sync_deadline_is_kept_on_the_receivers_clock() -> None:
    """A 60 s sync announced by a learner whose clock is 1000 s behind a generator's, or ahead
    of it: read on the generator's clock the learner's deadline is long past (or 1000 s away);
    timed from its receipt, the generator gets its 60 s either way. The message stays valid for
    its workers, and keeps the learner's stamp, which names its ipc keys on both sides."""
    learner_now = 5_000.0
    sent = msgspec.structs.replace(READY, announced_at=learner_now, deadline=learner_now + 60)
    for skew in (1000.0, -1000.0):
        ready = Decoder(WeightsReady).decode(encode(sent))
        assert isinstance(ready, WeightsReady)
        here = ready.on_receipt(now=learner_now + skew)
        assert here.due == learner_now + skew + 60
        assert here.sync_stamp == learner_now
        passed_on = Decoder(WeightsReady).decode(encode(here))  # as the workers receive it
        assert isinstance(passed_on, WeightsReady) and passed_on.due == here.due
    # a sender that does not say when it announced: its deadline is taken as it is
    assert READY.on_receipt(now=2e9) is READY and READY.due == READY.sync_stamp == READY.deadline


def test_batch_error_names_the_chunk() -> None:
    bad = ChunkBatch(generator_id="g", chunks=[chunk(), chunk(seq=1), chunk(seq=2, logprobs=pack_f32([-1, 1, -1]))])
    with pytest.raises(WireError) as err:
        Decoder(ToHub).decode(encode(bad))
    assert err.value.field == "chunks[2].logprobs"


@pytest.mark.parametrize(
    ("scores", "field"),
    [
        (
            [{"group_id": 1, "sample": 0, "reward": 1.0}, {"group_id": 1, "sample": 1, "reward": math.nan}],
            "scores[1].reward",
        ),
        ([{"group_id": -1, "sample": 0, "reward": 1.0}], "scores[0].group_id"),
        ([{"group_id": 1, "sample": 0, "reward": "high"}], "scores[0].reward"),
        ("not a list", "scores"),
    ],
)
def test_score_batch_error_names_the_score(scores: object, field: str) -> None:
    if isinstance(scores, list):
        scores = [
            msgspec.msgpack.decode(encode(Score(worker_id="w", group_id=0, sample=0, reward=0.0))) | s for s in scores
        ]
    with pytest.raises(WireError) as err:
        Decoder(ToHub).decode(_mutated(ScoreBatch(worker_id="w", scores=[]), scores=scores))
    assert err.value.field == field, str(err.value)


def test_oversized_frame_is_rejected_before_decoding() -> None:
    big = encode(ChunkBatch(generator_id="g", chunks=[chunk()] * 200))
    with pytest.raises(WireError) as err:
        Decoder(ToHub, max_bytes=1024).decode(big)
    assert err.value.reason == "oversized"


def test_random_garbage_never_escapes_as_another_exception() -> None:
    """Random bytes and random mutations of valid frames: WireError or a valid message, nothing else."""
    rng = random.Random(1234)
    decoder = Decoder(ANY)
    valid = [encode(m) for m in EXAMPLES]  # type: ignore[arg-type]
    outcomes = {"rejected": 0, "accepted": 0}
    for i in range(20000):
        if i % 2:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:
            buf = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] = rng.getrandbits(8)
            data = bytes(buf)
        try:
            decoder.decode(data)
            outcomes["accepted"] += 1
        except WireError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 10000 and outcomes["accepted"] > 0


@pytest.mark.parametrize(
    ("sampling", "samples", "field"),
    [
        ({"temperature": math.nan}, [0], "sampling.temperature"),
        ({"temperature": -1.0}, [0], "sampling.temperature"),
        ({"top_p": 0.0}, [0], "sampling.top_p"),
        ({"top_p": math.nan}, [0], "sampling.top_p"),
        ({"top_k": -2}, [0], "sampling.top_k"),
        ({"max_tokens": 0}, [0], "sampling.max_tokens"),
        ({"stop_token_ids": [-1]}, [0], "sampling.stop_token_ids"),
        ({}, [-1], "samples"),
        ({}, [1 << 40], "samples"),
    ],
)
def test_a_lease_vllm_would_refuse_is_refused_on_receipt(
    sampling: dict[str, object], samples: list[int], field: str
) -> None:
    """A hostile or broken hub must not crash a generator through vLLM's own checks."""
    lease = Lease(
        lease_id=1,
        group_id=2,
        prompt_tokens=pack_i32([1, 2]),
        samples=samples,
        sampling=msgspec.structs.replace(SamplingParams(), **sampling),
        min_version=0,
        deadline=1e9,
    )
    with pytest.raises(WireError) as err:
        Decoder(ToGenerator).decode(encode(lease))
    assert (err.value.reason, err.value.field) == ("invalid_field", field)


def test_a_long_reward_error_is_clipped_to_what_the_hub_takes() -> None:
    from flywheel.wire import MAX_ERROR_CHARS, clip_error

    trace = "ValueError: the judge failed\n" + "  frame\n" * 10_000 + "at the end"
    clipped = clip_error(trace)
    assert len(clipped) <= MAX_ERROR_CHARS and clipped.startswith("ValueError") and clipped.endswith("at the end")
    score = Score(worker_id="w", group_id=1, sample=0, reward=0.0, error=clipped)
    assert Decoder(ToHub).decode(encode(score)) == score
    assert clip_error("short") == "short"
