"""The launcher's contract with a spare generator (``flywheel.standby``): the takeover file
round-trips, and a bad one is refused with the field named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flywheel.standby import Takeover, clear, hand_over, is_ready, mark_ready, wait_for_takeover


def test_a_takeover_handed_over_is_what_the_spare_reads(tmp_path: Path) -> None:
    f = tmp_path / "spare0"
    assert not is_ready(f)
    mark_ready(f)
    assert is_ready(f)

    async def spare() -> Takeover:
        return await asyncio.wait_for(wait_for_takeover(f, poll_s=0.01), timeout=5)

    async def both() -> Takeover:
        task = asyncio.create_task(spare())
        await asyncio.sleep(0.05)
        assert not task.done(), "the spare waits until the launcher hands a place over"
        hand_over(f, Takeover("gen1", "/run/acks/gen1.log"))
        return await task

    assert asyncio.run(both()) == Takeover("gen1", "/run/acks/gen1.log")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    clear(f)
    assert not f.exists() and not is_ready(f)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"id": "gen0", "gpu": 1}', "unknown field"),
        (b'{"ack_log": null}', "field id"),
        (b'{"id": ""}', "field id"),
        (b'{"id": 7}', "field id"),
        (b'{"id": "' + b"x" * 300 + b'"}', "field id"),
        (b'{"id": "gen0", "ack_log": 3}', "field ack_log"),
        (b'{"id": "gen0", "ack_log": ""}', "field ack_log"),
        (b" " * (1 << 17), "more than a takeover holds"),
    ],
)
def test_a_bad_takeover_names_what_is_wrong(raw: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Takeover.decode(raw, "spares/spare0")


def test_garbage_never_passes_as_a_takeover() -> None:
    import random

    rng = random.Random(0)
    for _ in range(2000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        try:
            t = Takeover.decode(raw, "fuzz")
        except ValueError:
            continue
        assert isinstance(t.generator_id, str) and t.generator_id
