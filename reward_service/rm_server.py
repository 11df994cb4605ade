"""The reward-model server: ``flywheel-rm`` / ``python -m reward_service.rm_server``.

Serves any HF ``AutoModelForSequenceClassification`` (one label: the reward) over HTTP, on the
GPU when there is one. It speaks the protocol of the ``remote`` reward function::

    POST /score  {"prompts": [...], "completions": [...]}  ->  {"rewards": [...]}
    GET  /health ->  {"status": "ok", "model": ..., "device": ...}

Requests from many clients are merged into batches of up to ``rm.max_batch`` sequences: a
forward waits at most ``rm.batch_wait_ms`` for its batch to fill, and runs on a thread so the
server keeps accepting requests meanwhile. Use it from the reward service with
``--reward.functions '[{name: reward_model, kwargs: {url: http://HOST:PORT/score}}]'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from flywheel.config import RewardModelConfig, service_config
from flywheel.files import write_atomically
from flywheel.logs import setup_logging

log = logging.getLogger(__name__)


class RewardModel:
    """The model and its tokenizer; ``score`` is one batched forward pass."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if cfg.model is None:
            raise ValueError("rm.model is required: --rm.model PATH (an HF sequence-classification model)")
        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            cfg.dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32
        )
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.tokenizer.truncation_side = "left"  # keep the end of the completion: it decides the reward
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(cfg.model, dtype=dtype).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"rm.model must have one output (num_labels 1), {cfg.model} has {self.model.config.num_labels}"
            )
        # The model reads each row's reward at its last token that is not config.pad_token_id: the
        # rows must be padded with that very id, or a short row is read on its padding (its reward
        # then depends on what else shares the batch).
        if self.model.config.pad_token_id is not None:
            self.tokenizer.pad_token_id = self.model.config.pad_token_id
        else:
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        if not self.cfg.chat_template:
            return [p + c for p, c in zip(prompts, completions, strict=True)]
        return [
            str(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
                )
            )
            for p, c in zip(prompts, completions, strict=True)
        ]

    def score(self, texts: list[str]) -> list[float]:
        import torch

        enc = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.cfg.max_length,
            add_special_tokens=not self.cfg.chat_template,  # the template wrote them (a second BOS else)
        ).to(self.device)
        with torch.inference_mode():
            logits = self.model(**enc).logits
        return logits[:, 0].float().cpu().tolist()


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future[list[float]]


class Batcher:
    """Merges concurrent requests into forward passes of at most ``max_batch`` sequences."""

    def __init__(self, model: RewardModel, max_batch: int, wait_s: float) -> None:
        self.model = model
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.forwards = 0
        self.sequences = 0
        self.last_forward_end = 0.0  # time.monotonic() of the last forward pass's end

    async def score(self, texts: list[str]) -> list[float]:
        future: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(texts, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            if first.future.done():  # its caller gave up (rm.request_timeout_s): not scored for no one
                continue
            batch = [first]
            size = len(first.texts)
            deadline = loop.time() + self.wait_s
            while size < self.max_batch:
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
                if nxt.future.done():
                    continue
                batch.append(nxt)
                size += len(nxt.texts)
            texts = [t for p in batch for t in p.texts]
            try:  # a request larger than max_batch still goes in slices of max_batch
                scores: list[float] = []
                for i in range(0, len(texts), self.max_batch):
                    scores += await loop.run_in_executor(None, self.model.score, texts[i : i + self.max_batch])
                    self.forwards += 1
                    self.last_forward_end = time.monotonic()
            except Exception as err:  # answered to every waiting request; the server goes on
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            self.sequences += len(texts)
            offset = 0
            for p in batch:
                if not p.future.done():
                    p.future.set_result(scores[offset : offset + len(p.texts)])
                offset += len(p.texts)


def build_app(model: RewardModel, cfg: RewardModelConfig, rejected: Counter[str] | None = None) -> Any:
    """The HTTP app; ``rejected`` (filled by the server's access logger, see ``serve``) is
    reported by /health."""
    from aiohttp import web

    rejected = Counter() if rejected is None else rejected

    batcher = Batcher(model, cfg.max_batch, cfg.batch_wait_ms / 1000)
    batcher_task: list[asyncio.Task[None]] = []  # set when the app starts
    stalled: list[float] = []  # when a request last timed out

    async def score(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompts, completions = body["prompts"], body["completions"]
            if not (isinstance(prompts, list) and isinstance(completions, list) and len(prompts) == len(completions)):
                raise ValueError("prompts and completions must be lists of the same length")
            if not all(isinstance(x, str) for x in prompts + completions):
                raise ValueError("prompts and completions must hold strings")
        except (ValueError, KeyError, TypeError, RecursionError) as err:  # RecursionError: JSON nested too deep
            return web.json_response({"error": f"bad request: {err}"}, status=400)
        except ConnectionError:  # the body ended before its Content-Length
            return web.json_response({"error": "bad request: incomplete body"}, status=400)
        try:
            rewards = await asyncio.wait_for(batcher.score(model.texts(prompts, completions)), cfg.request_timeout_s)
        except TimeoutError:
            stalled[:] = [time.monotonic()]  # the last one is all /health reads
            return web.json_response(
                {"error": f"not scored within rm.request_timeout_s {cfg.request_timeout_s:g}s"}, status=503
            )
        return web.json_response({"rewards": rewards})

    async def health(_: web.Request) -> web.Response:
        # not ok when the batcher died (nothing would ever be scored) or a request timed out since
        # the last forward pass finished (a hung forward): a load balancer then takes it out
        problem = None
        if batcher_task and batcher_task[0].done():
            problem = "the batcher stopped"
        elif stalled and stalled[-1] > batcher.last_forward_end:
            problem = f"a request waited over rm.request_timeout_s {cfg.request_timeout_s:g}s"
        return web.json_response(
            {
                "status": "ok" if problem is None else f"error: {problem}",
                "model": cfg.model,
                "device": str(model.device),
                "forwards": batcher.forwards,
                "sequences": batcher.sequences,
                "rejected": dict(rejected),
            },
            status=200 if problem is None else 503,
        )

    async def start_batcher(app: web.Application) -> Any:
        batcher_task.append(asyncio.create_task(batcher.run()))
        yield
        batcher_task[0].cancel()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(start_batcher)
    return app


class _OncePerInterval(logging.Filter):
    """Lets one record per message and exception type through per ``interval_s``: aiohttp logs
    every unparsable request with a traceback, and a flood of them (each counted in /health)
    must not become a flood of log lines."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[object, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.msg, record.exc_info[0] if record.exc_info else None)
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < self.interval_s:
            return False
        self._last[key] = now
        return True


def _counting_access_log(rejected: Counter[str]) -> Any:
    """An access "logger" that logs nothing and counts every refused request by status: it
    sees the 400s of requests aiohttp could not even parse, which never reach a handler."""
    from aiohttp.abc import AbstractAccessLogger

    class CountRefused(AbstractAccessLogger):
        def log(self, request: Any, response: Any, time: float) -> None:
            if response.status >= 400:
                rejected[f"http_{response.status}"] += 1

    return CountRefused


async def serve(cfg: RewardModelConfig, stop: asyncio.Event, model: RewardModel | None = None) -> None:
    """Serve until ``stop`` is set; ``model`` replaces the one ``cfg`` names (tests, fuzzing)."""
    from aiohttp import web

    model = RewardModel(cfg) if model is None else model
    logging.getLogger("aiohttp.server").addFilter(_OncePerInterval())
    rejected: Counter[str] = Counter()
    runner = web.AppRunner(
        build_app(model, cfg, rejected),
        access_log=log,
        access_log_class=_counting_access_log(rejected),
        # a client that gave up (its own timeout) cancels its request, whose texts the batcher
        # then skips: under overload each retry would otherwise queue one more forward pass
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = int(runner.addresses[0][1])  # the bound port (rm.port 0 picks a free one)
    log.info("reward model %s on %s, serving http://%s:%d/score", cfg.model, model.device, cfg.host, port)
    if cfg.state_file:
        write_atomically(cfg.state_file, json.dumps({"port": port}))
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = service_config(
        "flywheel-rm",
        "Serve a reward model (rm.model) over HTTP for the reward service's reward_model function.",
        sys.argv[1:] if argv is None else argv,
    )
    if isinstance(cfg, int):
        return cfg
    setup_logging("rm", cfg.run.log_level)
    if cfg.rm.model is None:
        print("flywheel-rm: rm.model is required: --rm.model PATH", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg.rm, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
