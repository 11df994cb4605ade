"""Checkpoint housekeeping of the learner: what is kept, what is deleted, how `latest` is written."""

from __future__ import annotations

from pathlib import Path

from flywheel.files import write_atomically
from learner.trainer import prune_checkpoints


def make(directory: Path, *versions: int, critic: bool = True) -> None:
    for v in versions:
        (directory / f"v{v}").mkdir(parents=True)
        (directory / f"v{v}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
        if critic:
            (directory / "critic" / f"v{v}").mkdir(parents=True)


def test_the_newest_checkpoints_are_kept_with_their_critic(tmp_path: Path) -> None:
    make(tmp_path, 2, 4, 6, 8, 10)
    (tmp_path / "not-a-checkpoint").mkdir()
    assert prune_checkpoints(tmp_path, latest=10, keep=3) == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic", "not-a-checkpoint", "v10", "v6", "v8"]
    assert sorted(p.name for p in (tmp_path / "critic").iterdir()) == ["v10", "v6", "v8"]
    assert prune_checkpoints(tmp_path, latest=10, keep=0) == [], "0 keeps them all"


def test_a_save_a_kill_left_unfinished_goes_and_latest_is_never_deleted(tmp_path: Path) -> None:
    # v12 is a save cut short (never `latest`): a resumed learner continues past the published
    # version, so it never saves v12 again, and nothing else would remove it
    make(tmp_path, 9, 12, critic=False)
    make(tmp_path, 13)
    assert prune_checkpoints(tmp_path, latest=13, keep=1) == [9, 12]
    assert [p.name for p in tmp_path.glob("v*")] == ["v13"]


def test_latest_is_replaced_whole(tmp_path: Path) -> None:
    write_atomically(tmp_path / "latest", "v3")
    write_atomically(tmp_path / "latest", "v4")
    assert (tmp_path / "latest").read_text() == "v4"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"], "no temporary file left behind"
