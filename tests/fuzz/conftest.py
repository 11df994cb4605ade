"""The fuzz corpus, drawn once per session: hypothesis is the slow part, the mutator the fast one."""

from __future__ import annotations

import os
import random

import pytest

from tests.fuzz.corpus import hypothesis_seeds

MESSAGES = int(os.environ.get("FLYWHEEL_FUZZ_MESSAGES", "100000"))
"""Messages per ZMQ socket (the issue asks for at least 100k; bench/fuzz.py runs more)."""
HTTP_REQUESTS = int(os.environ.get("FLYWHEEL_FUZZ_HTTP_REQUESTS", "2000"))
"""Requests per HTTP endpoint: one connection each, about a thousand a second on two cores, so
CI sends fewer than to the ZMQ sockets; bench/fuzz.py sends 100k."""
HYPOTHESIS_EXAMPLES = int(os.environ.get("FLYWHEEL_FUZZ_EXAMPLES", "600"))


@pytest.fixture(scope="session")
def fuzz_seeds() -> list[bytes]:
    return hypothesis_seeds(HYPOTHESIS_EXAMPLES, seed=1)


@pytest.fixture
def fuzz_rng(request: pytest.FixtureRequest) -> random.Random:
    return random.Random(request.node.name)  # reproducible per test
