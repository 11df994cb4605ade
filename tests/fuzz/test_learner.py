"""The learner's weight-sync sockets under a flood: its ROUTER counts every refused message by
reason and admits no impostor; its PUB keeps publishing. (The torch.distributed TCP store the
broadcast itself rendezvouses on is torch's, not ours: it is not fuzzed here.)"""

from __future__ import annotations

import random

from tests.fuzz.conftest import MESSAGES
from tests.fuzz.drive import fuzz_learner_announce, fuzz_learner_join


def test_join_router(fuzz_seeds: list[bytes], fuzz_rng: random.Random) -> None:
    result = fuzz_learner_join(fuzz_seeds, MESSAGES, fuzz_rng)
    assert result.messages >= MESSAGES and result.crashes == 0
    assert result.counted == result.expected, (result.counted, result.expected)


def test_announce_pub(fuzz_seeds: list[bytes], fuzz_rng: random.Random) -> None:
    result = fuzz_learner_announce(fuzz_seeds, MESSAGES, fuzz_rng)
    assert result.messages >= MESSAGES and result.crashes == 0
