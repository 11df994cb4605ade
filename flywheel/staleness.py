"""Versions and staleness: the rules of DESIGN.md as one small, testable object.

Lifecycle of a prompt group (the unit the learner consumes):

    ISSUED ──► GENERATING ──► COMPLETE ──► SCORED ──► READY ──► CONSUMED
                    │  ▲                                  │
                    └──┘ (lease expired: unfinished        └──► DROPPED (too stale at
                          samples re-issued)                     consumption; prompt
                                                                 re-queued if configured)

- ISSUED: a prompt was taken from the source and counted against admission.
- GENERATING: at least one lease of the group is running on a generator.
- COMPLETE: every sample has its final chunk; samples are with the reward service.
- SCORED / READY: every sample has a score; the group sits in the ready queue with its
  version (the oldest version among all its tokens).
- CONSUMED: claimed by a learner at version v with v - version <= η (exactly once).
- DROPPED: found with v - version > η when claimed; it no longer counts as issued. The hub
  also drops a group still GENERATING once a token it already holds is older than v - η
  (``async.revoke_stale``): it could never be claimed, so its leases are revoked at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GroupState(enum.Enum):
    ISSUED = "issued"
    GENERATING = "generating"
    COMPLETE = "complete"
    SCORED = "scored"
    READY = "ready"
    CONSUMED = "consumed"
    DROPPED = "dropped"


_NEXT: dict[GroupState, frozenset[GroupState]] = {
    GroupState.ISSUED: frozenset({GroupState.GENERATING}),
    GroupState.GENERATING: frozenset({GroupState.GENERATING, GroupState.COMPLETE, GroupState.DROPPED}),
    GroupState.COMPLETE: frozenset({GroupState.SCORED}),
    GroupState.SCORED: frozenset({GroupState.READY, GroupState.DROPPED}),  # dropped: a failed reward
    GroupState.READY: frozenset({GroupState.CONSUMED, GroupState.DROPPED}),
    GroupState.CONSUMED: frozenset(),
    GroupState.DROPPED: frozenset(),
}


def advance(current: GroupState, new: GroupState) -> GroupState:
    """Return ``new`` if the lifecycle allows ``current → new``; an internal invariant otherwise."""
    assert new in _NEXT[current], f"illegal group transition {current.value} -> {new.value}"
    return new


@dataclass(frozen=True)
class StalenessPolicy:
    """η and the step size: everything admission and consumption need to decide."""

    max_staleness: int  # η
    groups_per_step: int

    def min_version(self, learner_version: int) -> int:
        """Oldest version a sample may have to be trained on (also the minimum weights version
        a generator must serve to take a lease)."""
        return max(0, learner_version - self.max_staleness)

    def doom_floor(self, learner_version: int, claim_floor: int) -> int:
        """The oldest version a group may still hold and be trained on: ``min_version`` of the
        learner's version, or one version on once the learner has claimed its next batch ahead
        (``claim_floor``, what that claim accepted). A claim floor further ahead than that is
        a learner restarted at an older version: it counts only up to the next version's."""
        return max(self.min_version(learner_version), min(claim_floor, self.min_version(learner_version + 1)))

    def admission_limit(self, learner_version: int, versions_without_batch: int = 0) -> int:
        """How many groups may be issued (net of drops) while the learner is at this version.

        ``versions_without_batch``: versions up to it that trained no batch (a learner resumed
        past the published version, or on a Redis that lost the run's counters): v counts the
        batches trained, which the bound assumes."""
        return (learner_version - versions_without_batch + self.max_staleness + 1) * self.groups_per_step

    def may_issue(
        self, groups_issued: int, groups_dropped: int, learner_version: int, versions_without_batch: int = 0
    ) -> bool:
        """Admission: lease a new group only while issued - dropped < (v + η + 1) · groups_per_step."""
        return groups_issued - groups_dropped < self.admission_limit(learner_version, versions_without_batch)

    def staleness(self, learner_version: int, sample_version: int) -> int:
        return learner_version - sample_version

    def too_stale(self, learner_version: int, sample_version: int) -> bool:
        return self.staleness(learner_version, sample_version) > self.max_staleness
