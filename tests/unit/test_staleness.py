"""The staleness rules of DESIGN.md, as pure functions."""

from __future__ import annotations

import numpy as np
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


def test_doom_floor_follows_a_claim_ahead_by_one_version_at_most() -> None:
    p = StalenessPolicy(4, 1)
    assert p.doom_floor(10, -1) == 6  # no claim yet
    assert p.doom_floor(10, 6) == 6  # the claim for v10
    assert p.doom_floor(10, 7) == 7  # the claim ahead for v11
    assert p.doom_floor(10, 30) == 7  # a learner restarted at v10 after claiming for v34
    assert p.doom_floor(2, 0) == 0  # never below 0
    assert StalenessPolicy(0, 1).doom_floor(5, 5) == 5  # η = 0 claims nothing ahead


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


def test_a_batch_claimed_ahead_that_lands_as_its_wait_times_out_is_kept_for_the_next_call() -> None:
    """The claim ahead completes between the wait's timeout and the bookkeeping after it: the
    batch was dropped (its groups consumed in Redis, never trained, the admission window one
    batch smaller for the rest of the run). Now the next call returns it."""
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    from flywheel.hub_client import Batch, BatchTimeout, ClaimsAhead

    batch = Batch(learner_version=3, groups=[], dropped=0, wait_s=0.0)

    class LandsAsItTimesOut(Future):  # type: ignore[type-arg]
        def result(self, timeout: float | None = None) -> Batch:
            if not self.done():
                self.set_result(batch)  # the claim thread finishes just as the wait gives up
                raise FutureTimeout()
            return super().result(timeout)

    claims = ClaimsAhead(client=None, n_groups=1, timeout_s=1.0)  # type: ignore[arg-type]
    claims._ahead = (3, LandsAsItTimesOut())
    assert claims.claim(3, wait_s=0.01) is batch
    assert claims._ahead is None
    # and a claim made ahead that is not done when the wait ends is kept for the next call
    pending: Future[Batch] = Future()
    claims._ahead = (3, pending)
    with pytest.raises(BatchTimeout, match="not ready after"):
        claims.claim(3, wait_s=0.01)
    pending.set_result(batch)
    assert claims.claim(3, wait_s=0.01) is batch and claims._ahead is None


def test_a_claim_made_ahead_that_gave_up_is_made_again() -> None:
    """The claim made ahead for v gave up (its own BatchTimeout, after train.batch_timeout_s:
    no full batch that long, a slow checkpoint, a stalled fleet). BatchTimeout is a TimeoutError,
    as the wait's own timeout is from Python 3.11 on: taken for "not ready yet", the dead claim
    was kept, and every call after returned its error at once, no claim made again, until the
    learner failed with groups ready in Redis. Now the next call claims afresh."""
    from concurrent.futures import Future

    from flywheel.hub_client import Batch, BatchTimeout, ClaimsAhead

    batch = Batch(learner_version=3, groups=[], dropped=0, wait_s=0.0)
    claimed: list[int] = []

    class Client:
        def claim(self, n_groups: int, version: int, timeout_s: float) -> Batch:
            claimed.append(version)
            return batch

    claims = ClaimsAhead(client=Client(), n_groups=1, timeout_s=1.0)  # type: ignore[arg-type]
    gave_up: Future[Batch] = Future()
    gave_up.set_exception(BatchTimeout("no batch of 1 groups within 1.0s (0 ready)"))
    claims._ahead = (3, gave_up)
    with pytest.raises(BatchTimeout, match="0 ready"):  # its own error, once
        claims.claim(3, wait_s=0.01)
    assert claims._ahead is None
    assert claims.claim(3, wait_s=0.01) is batch and claimed == [3]

    class Interrupted(Future):  # type: ignore[type-arg]
        def result(self, timeout: float | None = None) -> Batch:
            raise KeyboardInterrupt  # Ctrl-C while the learner waits for the claim

    pending = Interrupted()
    claims._ahead = (4, pending)
    with pytest.raises(KeyboardInterrupt):  # at once: not a wait for the claim to end
        claims.claim(4, wait_s=60)
    assert claims._ahead == (4, pending)  # still the learner's, the claim going on


def test_a_learner_out_of_data_trains_the_batch_it_claimed_ahead() -> None:
    """A step whose groups were all filtered out leaves the claim made ahead for v+1 waiting,
    and the learner claims at v again; when the prompts are spent that claim finds nothing, and
    the run ended with the batch claimed ahead consumed in Redis and never trained. Now it is
    the last batch, as v's (its groups meet v's bound: the claim ahead's floor was higher)."""
    from concurrent.futures import Future

    from flywheel.hub_client import Batch, ClaimsAhead, RolloutGroup

    group = RolloutGroup(7, 4, 1, prompt_index=0, prompt_tokens=np.zeros(1, np.int32), metadata={}, samples=[])
    landed: Future[Batch] = Future()
    landed.set_result(Batch(learner_version=5, groups=[group], dropped=0, wait_s=0.0, staleness=[1]))
    claims = ClaimsAhead(client=None, n_groups=1, timeout_s=1.0)  # type: ignore[arg-type]
    claims._ahead = (5, landed)
    batch = claims.take_landed(4)
    assert batch is not None and claims._ahead is None
    assert batch.learner_version == 4 and [g.group_id for g in batch.groups] == [7]
    assert [g.staleness for g in batch.groups] == batch.staleness == [0]
    # one still on its way, or one that failed, is not a batch
    claims._ahead = (5, Future())
    assert claims.take_landed(4) is None and claims._ahead is not None
    failed: Future[Batch] = Future()
    failed.set_exception(RuntimeError("redis gone"))
    claims._ahead = (5, failed)
    assert claims.take_landed(4) is None
