"""Run files written whole: the old content or the new one, never half, and private when asked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel import files
from flywheel.files import write_atomically


def test_a_private_file_is_the_owners_only_even_over_a_readable_one(tmp_path: Path) -> None:
    path = tmp_path / "services.json"
    path.write_text("old")
    path.chmod(0o644)
    write_atomically(path, '{"redis_url": "redis://:secret@host"}', private=True)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_text() == '{"redis_url": "redis://:secret@host"}'


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "latest"
    write_atomically(path, "v3", durable=True)

    def fail(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, "v4")
    assert path.read_text() == "v3"
    assert os.listdir(tmp_path) == ["latest"]
