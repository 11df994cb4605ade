"""The reward-model server's HTTP app (``reward_service.rm_server.build_app``) when a forward pass
hangs: its callers get an answer in bounded time and /health says so."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from flywheel.config import RewardModelConfig
from reward_service.rm_server import build_app


class HangingModel:
    """In place of ``RewardModel``: scores by length once ``release`` is set: a forward pass hung on its device until then (the
    fault under test; the HTTP side and the batcher are the real ones)."""

    device = "cpu"

    def __init__(self) -> None:
        self.release = threading.Event()

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def score(self, texts: list[str]) -> list[float]:
        assert self.release.wait(30), "never released"
        return [float(len(t)) for t in texts]


def test_a_hung_forward_pass_answers_503_in_bounded_time_and_health_says_so() -> None:
    """`await future` had no limit: a hung forward held every /score caller for good while /health
    said "ok"."""
    model = HangingModel()
    cfg = RewardModelConfig(model="hanging", request_timeout_s=2.0, batch_wait_ms=1)

    async def scenario() -> None:
        app = build_app(model, cfg)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            body = {"prompts": ["a"], "completions": ["bc"]}
            resp = await asyncio.wait_for(client.post("/score", json=body), 10)
            assert resp.status == 503 and "rm.request_timeout_s" in (await resp.json())["error"]
            health = await client.get("/health")
            assert health.status == 503 and "waited over" in (await health.json())["status"]
            model.release.set()  # the device answers again
            resp = await asyncio.wait_for(client.post("/score", json=body), 10)
            assert resp.status == 200 and (await resp.json())["rewards"] == [3.0]
            health = await client.get("/health")
            assert health.status == 200 and (await health.json())["status"] == "ok"

    try:
        asyncio.run(scenario())
    finally:
        model.release.set()


def test_health_says_when_the_batcher_is_gone() -> None:
    model = HangingModel()
    model.release.set()
    cfg = RewardModelConfig(model="m", batch_wait_ms=1)

    async def scenario() -> None:
        app = build_app(model, cfg)  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            assert (await client.get("/health")).status == 200
            for task in asyncio.all_tasks():
                if task.get_coro().__qualname__.startswith("Batcher.run"):  # type: ignore[union-attr]
                    task.cancel()
            await asyncio.sleep(0.05)
            health = await client.get("/health")
            assert health.status == 503 and "the batcher stopped" in (await health.json())["status"]

    asyncio.run(scenario())


def test_a_short_text_scores_the_same_alone_and_beside_a_long_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The model reads a row's reward at its last token that is not config.pad_token_id; a model
    whose pad id is not the tokenizer's had its short rows padded with another id and read on
    their padding: their reward depended on what else shared the batch."""
    import json

    from flywheel.tiny import build_reward_model
    from reward_service.rm_server import RewardModel

    path = build_reward_model(tmp_path / "rm")
    config = json.loads((path / "config.json").read_text())
    config["pad_token_id"] = 0  # the tokenizer's pad token is <pad> (3)
    (path / "config.json").write_text(json.dumps(config))
    model = RewardModel(RewardModelConfig(model=str(path)))
    short = "What is 3 + 5? Answer: 8"
    alone = model.score([short])[0]
    beside = model.score([short, short + " and then a good deal more text to pad the short row out"])[0]
    assert abs(alone - beside) < 1e-4, (alone, beside)


class SlowModel:
    """In place of ``RewardModel``: a forward pass takes ``seconds``; records what it scored."""

    device = "cpu"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.scored: list[str] = []

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def score(self, texts: list[str]) -> list[float]:
        time.sleep(self.seconds)
        self.scored += texts
        return [float(len(t)) for t in texts]


def test_a_request_whose_client_gave_up_is_not_scored(tmp_path: Path) -> None:
    """A client past its own timeout (``remote``'s, 10 s, against the server's 120) goes, but its
    request stayed queued and was scored for no one; under overload each of its retries queued
    one more forward pass. Its disconnect now cancels it (the real server, ``serve``)."""
    import aiohttp

    from reward_service.rm_server import serve

    model = SlowModel(1.0)
    cfg = RewardModelConfig(model="slow", port=0, batch_wait_ms=1, state_file=str(tmp_path / "rm.json"))

    async def scenario() -> None:
        stop = asyncio.Event()
        server = asyncio.create_task(serve(cfg, stop, model))  # type: ignore[arg-type]
        for _ in range(200):
            if (tmp_path / "rm.json").exists():
                break
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads((tmp_path / 'rm.json').read_text())['port']}/score"
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(session.post(url, json={"prompts": ["a"], "completions": ["1"]}))
            await asyncio.sleep(0.3)  # its forward pass runs
            with pytest.raises(TimeoutError):  # queued behind it, this client gives up
                await asyncio.wait_for(session.post(url, json={"prompts": ["b"], "completions": ["2"]}), 0.3)
            assert (await (await first).json())["rewards"] == [2.0]
        await asyncio.sleep(1.5)  # a forward pass for the request given up would be over by now
        stop.set()
        await server
        assert model.scored == ["a1"]

    asyncio.run(scenario())
