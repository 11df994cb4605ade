"""The reward-model server (``reward_service.rm_server.serve``, the real HTTP stack) with a stub
model in place of a transformer, for fuzzing its socket: ``python -m tests.fuzz.rm_stub STATE``."""

from __future__ import annotations

import asyncio
import signal
import sys

from flywheel.config import RewardModelConfig
from reward_service.rm_server import RewardModel, serve


class StubModel:
    """Scores a text by its length: the HTTP side is what is under test, not the model."""

    device = "cpu"

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def score(self, texts: list[str]) -> list[float]:
        return [float(len(t)) for t in texts]


async def main(state_file: str) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    cfg = RewardModelConfig(model="stub", port=0, state_file=state_file, batch_wait_ms=1)
    model: RewardModel = StubModel()  # type: ignore[assignment]
    await serve(cfg, stop, model=model)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
