"""The staleness rules of DESIGN.md, as pure functions."""

from __future__ import annotations

import pytest

from flywheel.staleness import GroupState, StalenessPolicy, advance


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_admission_limit(eta: int) -> None:
    p = StalenessPolicy(max_staleness=eta, groups_per_step=8)
    for v in range(5):
        limit = (v + eta + 1) * 8
        assert p.may_issue(limit - 1, 0, v)
        assert not p.may_issue(limit, 0, v)
        assert p.may_issue(limit, 1, v)  # dropped groups do not count


def test_eta_zero_is_on_policy() -> None:
    p = StalenessPolicy(0, 4)
    assert p.min_version(7) == 7
    assert not p.too_stale(7, 7)
    assert p.too_stale(7, 6)
    assert p.admission_limit(0) == 4  # exactly one step of groups before the first update


def test_min_version_never_negative() -> None:
    assert StalenessPolicy(4, 1).min_version(2) == 0


def test_lifecycle() -> None:
    s = GroupState.ISSUED
    for nxt in (
        GroupState.GENERATING,
        GroupState.GENERATING,
        GroupState.COMPLETE,
        GroupState.SCORED,
        GroupState.READY,
        GroupState.CONSUMED,
    ):
        s = advance(s, nxt)
    assert advance(GroupState.READY, GroupState.DROPPED) is GroupState.DROPPED
    assert advance(GroupState.GENERATING, GroupState.DROPPED) is GroupState.DROPPED  # async.revoke_stale
    with pytest.raises(AssertionError, match="illegal group transition"):
        advance(GroupState.ISSUED, GroupState.READY)
    with pytest.raises(AssertionError):
        advance(GroupState.CONSUMED, GroupState.READY)
