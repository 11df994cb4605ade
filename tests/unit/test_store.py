"""The Redis layout's pure parts: key names, chunk blobs, assembly."""

from __future__ import annotations

import pytest

from flywheel.store import RunKeys, assemble, chunk_blob_field, chunks_by_sample, unpack_chunks
from flywheel.wire import Chunk, encode_list, pack_f32, pack_i32, unpack_i32


def _chunk(sample: int, seq: int, final: bool = False, lease: int = 1) -> Chunk:
    return Chunk(
        lease_id=lease,
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
        chunk_blob_field(1, 0, 2): encode_list([_chunk(0, 2, final=True), _chunk(0, 0)]),
        chunk_blob_field(1, 0, 1): encode_list([_chunk(0, 1), _chunk(1, 0, final=True)]),  # two samples, one blob
        b"meta": b"ignored",
    }
    assert unpack_chunks(raw[chunk_blob_field(1, 0, 1)])[0].seq == 1
    by_sample = chunks_by_sample(raw)
    assert sorted(by_sample) == [0, 1]
    sample = assemble(by_sample[0], 3)
    assert unpack_i32(sample.tokens).tolist() == [0, 0, 1, 1, 2, 2]


def test_assemble_refuses_a_hole() -> None:
    with pytest.raises(ValueError, match=r"chunks \[1\] of 0..2 are missing"):
        assemble({0: _chunk(0, 0), 2: _chunk(0, 2, final=True)}, 3)


@pytest.mark.parametrize("newest_first", [False, True])
def test_a_re_issued_sample_s_earlier_chunks_are_superseded_whatever_the_field_order(newest_first: bool) -> None:
    """Sample 0 was re-issued (lease 1, then lease 4, seqs from 0 again); its lease-1 chunks share
    blobs with sample 1's and stay stored until the group goes."""
    old = (chunk_blob_field(1, 0, 0), encode_list([_chunk(0, 0), _chunk(1, 0), _chunk(0, 1)]))
    new = (
        chunk_blob_field(4, 0, 0),
        encode_list([_chunk(0, 0, lease=4), _chunk(1, 1, final=True), _chunk(0, 1, final=True, lease=4)]),
    )
    assert old[0] != new[0], "a re-issued sample's first blob must not overwrite the earlier one"
    raw = dict([new, old] if newest_first else [old, new])
    by_sample = chunks_by_sample(raw)
    assert {c.lease_id for c in by_sample[0].values()} == {4}
    assert sorted(by_sample[1]) == [0, 1], "the other sample's chunks in the same blobs are all kept"
    assert unpack_i32(assemble(by_sample[0], 2).tokens).tolist() == [0, 0, 1, 1]


def test_a_finished_sample_is_its_done_leases_chunks_even_beside_a_newer_leases() -> None:
    """The sample finished under lease 1 (its SampleDone says so); chunks of a newer lease of it
    (a re-issue that raced the finish) must not replace its tokens."""
    raw = {
        chunk_blob_field(1, 0, 0): encode_list([_chunk(0, 0), _chunk(0, 1, final=True)]),
        chunk_blob_field(4, 0, 0): encode_list([_chunk(0, 0, lease=4)]),
    }
    assert {c.lease_id for c in chunks_by_sample(raw)[0].values()} == {4}  # unfinished: the newest lease
    by_sample = chunks_by_sample(raw, {0: 1})
    assert {c.lease_id for c in by_sample[0].values()} == {1} and sorted(by_sample[0]) == [0, 1]
