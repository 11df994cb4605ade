"""A weight update's engine calls (pause, cache reset, resume) end within a timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from generators import service


def test_an_engine_call_that_never_returns_fails_the_update_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "ENGINE_CALL_TIMEOUT_S", 0.2)

    async def stuck() -> None:
        await asyncio.Event().wait()  # as a pause queued behind a load that never ends

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the engine did not resume within 0.2s"):
        asyncio.run(service.GeneratorService._engine_call(stuck(), "resume"))
    assert time.monotonic() - started < 5
