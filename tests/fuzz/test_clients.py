"""The services' client sockets against a hostile peer flooding them with malformed messages:
a generator's links to the hub and to the learner, the reward service's link to the hub."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.fuzz.conftest import MESSAGES
from tests.fuzz.drive import FuzzResult, fuzz_hub_link, fuzz_reward_service, fuzz_sync_announce, fuzz_sync_join

TARGETS: dict[str, Callable[[list[bytes], int, random.Random], FuzzResult]] = {
    "hub_link": fuzz_hub_link,
    "sync_announce": fuzz_sync_announce,
    "sync_join": fuzz_sync_join,
    "reward_service": fuzz_reward_service,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_client_survives_and_counts(target: str, fuzz_seeds: list[bytes], fuzz_rng: random.Random) -> None:
    result = TARGETS[target](fuzz_seeds, MESSAGES, fuzz_rng)
    assert result.messages >= MESSAGES
    assert result.crashes == 0
    assert result.counted == result.expected, (result.counted, result.expected)
