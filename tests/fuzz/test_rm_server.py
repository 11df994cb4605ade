"""The reward-model server under a flood of malformed requests (the hub's Prometheus endpoint is
flooded in test_hub.py). Each refusal is counted by reason (``http_<status>``) against what the
client saw; the server stays up and answers a real request afterwards."""

from __future__ import annotations

import random
from pathlib import Path

from tests.fuzz.conftest import HTTP_REQUESTS
from tests.fuzz.drive import fuzz_rm_server


def test_reward_model_server(tmp_path: Path, fuzz_seeds: list[bytes], fuzz_rng: random.Random) -> None:
    result = fuzz_rm_server(tmp_path, fuzz_seeds, HTTP_REQUESTS, fuzz_rng)
    assert result.messages >= HTTP_REQUESTS and result.crashes == 0
    # every refusal the client saw was counted, under its status...
    assert not result.expected - result.counted, (result.counted, result.expected)
    # ... and nothing more, but for answers to connections the client gave up on
    assert result.counted.total() - result.expected.total() <= result.undelivered_bound, result.note
    assert result.expected.total() > HTTP_REQUESTS // 2  # most of the flood is refused, not served
