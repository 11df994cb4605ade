"""The launcher's contract with a spare generator and the standby learner (``flywheel.standby``):
the takeover file round-trips, a bad one is refused with the field named, and the standby learner
waits for its takeover."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
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


def test_the_standby_learner_waits_for_its_takeover_then_gets_a_fresh_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flywheel import redis_server
    from learner.__main__ import _single_process_env, _stand_by

    ports = itertools.count(41000)
    monkeypatch.setattr(redis_server, "free_port", lambda: next(ports))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FLYWHEEL_OWN_WORLD"):
        monkeypatch.delenv(var, raising=False)
    _single_process_env()
    assert os.environ["MASTER_PORT"] == "41000"
    path = tmp_path / "learner1"
    waiting = threading.Thread(target=_stand_by, args=(None, path), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 10
    while not is_ready(path):
        assert time.monotonic() < deadline, "the standby never marked itself ready"
        time.sleep(0.02)
    time.sleep(0.3)
    assert waiting.is_alive(), "a standby must wait for its takeover"
    hand_over(path, Takeover("learner"))
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert os.environ["MASTER_PORT"] == "41001"  # the one chosen before the wait may be taken since
