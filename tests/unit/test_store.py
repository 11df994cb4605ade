"""The Redis layout's pure parts: key names, chunk blobs, assembly."""

from __future__ import annotations

import pytest

from flywheel.store import RunKeys, assemble, chunk_blob_field, chunks_by_sample, unpack_chunks
from flywheel.wire import Chunk, encode_list, pack_f32, pack_i32, unpack_i32


def _chunk(sample: int, seq: int, final: bool = False) -> Chunk:
    return Chunk(
        lease_id=1,
        group_id=9,
        sample=sample,
        seq=seq,
        tokens=pack_i32([seq, seq]),
        logprobs=pack_f32([-1.0, -1.0]),
        versions=pack_i32([3, 3]),
        finish_reason="stop" if final else None,
    )


def test_keys_share_hash_tags() -> None:
    k = RunKeys("exp")
    tags = {key[key.index("{") + 1 : key.index("}")] for key in k.all_run_keys()}
    assert tags == {"exp"}  # run-level keys: one slot, so the claim script is cluster-safe
    assert k.group(5) == "fw:exp:g:{exp:5}" and k.group(5) != k.group(6)


def test_blobs_round_trip_and_assemble_in_order() -> None:
    raw = {
        chunk_blob_field(0, 2): encode_list([_chunk(0, 2, final=True), _chunk(0, 0)]),
        chunk_blob_field(0, 1): encode_list([_chunk(0, 1)]),
        chunk_blob_field(1, 0): encode_list([_chunk(1, 0, final=True)]),
        b"meta": b"ignored",
    }
    assert unpack_chunks(raw[chunk_blob_field(0, 1)])[0].seq == 1
    by_sample = chunks_by_sample(raw)
    assert sorted(by_sample) == [0, 1]
    sample = assemble(by_sample[0], 3)
    assert unpack_i32(sample.tokens).tolist() == [0, 0, 1, 1, 2, 2]


def test_assemble_refuses_a_hole() -> None:
    with pytest.raises(ValueError, match=r"chunks \[1\] of 0..2 are missing"):
        assemble({0: _chunk(0, 0), 2: _chunk(0, 2, final=True)}, 3)
