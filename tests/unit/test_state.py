"""The hub's in-memory group and sample assembly (buffer/state.py)."""

from __future__ import annotations

import numpy as np

from buffer.state import OpenGroup, SampleAssembly
from flywheel.store import GroupMeta
from flywheel.wire import Chunk, pack_f32, pack_i32


def _final(n_tokens: int, version: int) -> Chunk:
    return Chunk(
        lease_id=1,
        group_id=0,
        sample=0,
        seq=0,
        tokens=pack_i32(np.arange(n_tokens)),
        logprobs=pack_f32(np.full(n_tokens, -0.5)),
        versions=pack_i32(np.full(n_tokens, version)),
        finish_reason="length",
    )


def _done(chunk: Chunk) -> SampleAssembly:
    sample = SampleAssembly(lease_id=1, chunks={0: chunk}, final_seq=0)
    sample.complete()
    return sample


def test_a_sample_with_no_token_does_not_make_its_group_old() -> None:
    meta = GroupMeta(
        group_id=0, prompt_index=0, epoch=0, prompt_tokens=b"", n_samples=2, metadata={}, issued_at_version=3
    )
    group = OpenGroup(meta, [_done(_final(4, 5)), _done(_final(0, 0))])  # the second: a prompt too long to answer
    assert group.version == 5  # it read 0: η versions old at once, dropped at every claim
    assert OpenGroup(meta, [_done(_final(0, 0)), _done(_final(0, 0))]).version == 3  # none: as issued
