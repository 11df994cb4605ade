"""The built-in reward functions. Each takes a batch (see ``registry``) and returns one reward
per sample; ``metadata`` carries the dataset fields named by ``data.metadata_keys``."""

from __future__ import annotations

import asyncio
import random
import re
import threading
from typing import Any

from flywheel.tasks import arithmetic_correct
from reward_service.registry import register


def _answer(meta: dict[str, Any], key: str) -> str:
    if meta.get(key) is None:
        raise ValueError(f"metadata has no {key!r}: add it to data.metadata_keys (or set kwargs.answer_key)")
    return str(meta[key]).strip()


@register("arithmetic")
def arithmetic(
    prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], answer_key: str = "answer", **_: Any
) -> list[dict[str, float]]:
    """The demo task's verifier: 1 when the first integer of the completion is the answer.

    >>> arithmetic(["What is 3 + 5? Answer:"], [" 8</s>"], [{"answer": "8"}])
    [{'reward': 1.0, 'format': 1.0}]
    """
    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        hit, has_number = arithmetic_correct(completion, _answer(meta, answer_key))
        out.append({"reward": float(hit), "format": float(has_number)})
    return out


@register("math")
def math_answer(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    answer_key: str = "answer",
    timeout_s: int = 5,
    **_: Any,
) -> list[float]:
    """Math answer verification with ``math-verify``: the completion's final answer (a
    ``\\boxed{}`` or the last expression) equals the reference symbolically (1/2 == 0.5).

    >>> math_answer(["1/2 + 0?"], ["So the result is $\\\\boxed{0.5}$."], [{"answer": "\\\\frac{1}{2}"}])
    [1.0]
    """
    from math_verify import parse, verify

    # math-verify bounds its sympy work with SIGALRM, which exists only in the main thread
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        gold_text = _answer(meta, answer_key)
        gold = parse(gold_text if "$" in gold_text or "\\" in gold_text else f"${gold_text}$", parsing_timeout=timeout)
        pred = parse(completion, parsing_timeout=timeout)
        out.append(float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)))
    return out


@register("exact_match")
def exact_match(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    answer_key: str = "answer",
    extract: str | None = r"(-?\d+(?:\.\d+)?)(?!.*\d)",
    ignore_case: bool = False,
    **_: Any,
) -> list[float]:
    """1 when the extracted answer equals the reference after whitespace normalisation.

    ``extract`` is a regex whose first group is the answer (default: the last number; ``None``:
    the whole completion).

    >>> exact_match(["2+2?"], ["I think it is 4"], [{"answer": "4"}])
    [1.0]
    """
    pattern = re.compile(extract, re.DOTALL) if extract else None
    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        text = completion
        if pattern is not None:
            found = pattern.search(completion)
            text = (found.group(1) if found.groups() else found.group()) if found else ""
        got, want = " ".join(text.split()), " ".join(_answer(meta, answer_key).split())
        if ignore_case:
            got, want = got.lower(), want.lower()
        out.append(float(bool(got) and got == want))
    return out


@register("regex_match")
def regex_match(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    pattern: str | None = None,
    pattern_key: str | None = None,
    **_: Any,
) -> list[float]:
    """1 when the completion contains a match of ``pattern`` (or of the per-sample regex in
    ``metadata[pattern_key]``).

    >>> regex_match(["?"], ["the answer: yes"], [{}], pattern=r"answer: (yes|no)")
    [1.0]
    """
    if (pattern is None) == (pattern_key is None):
        raise ValueError("regex_match needs exactly one of kwargs.pattern or kwargs.pattern_key")
    fixed = re.compile(pattern, re.DOTALL) if pattern is not None else None
    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        rx = fixed or re.compile(_answer(meta, str(pattern_key)), re.DOTALL)
        out.append(float(rx.search(completion) is not None))
    return out


@register("format")
def format_reward(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>",
    **_: Any,
) -> list[float]:
    """1 when the whole completion (stripped) has the required format; by default
    ``<think>…</think><answer>…</answer>``.

    >>> format_reward(["?"], ["<think>hm</think> <answer>4</answer>"], [{}])
    [1.0]
    """
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.fullmatch(c.strip()) is not None) for c in completions]


@register("length_penalty", needs_text=False)
def length_penalty(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    completion_ids: list[list[int]],
    max_tokens: int,
    buffer_tokens: int | None = None,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong penalty: 0 up to ``max_tokens - buffer_tokens``, then falling
    linearly to -1 at ``max_tokens`` (``buffer_tokens`` defaults to a quarter of it).

    >>> length_penalty([""], [""], [{}], completion_ids=[[0] * 90], max_tokens=100, buffer_tokens=20)
    [-0.5]
    """
    buffer = max(1, buffer_tokens if buffer_tokens is not None else max_tokens // 4)
    free = max_tokens - buffer
    return [max(-1.0, min(0.0, (free - len(ids)) / buffer)) for ids in completion_ids]


@register("length", needs_text=False)
def length_fraction(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    completion_ids: list[list[int]],
    max_tokens: int,
    **_: Any,
) -> list[float]:
    """The share of the token budget used: a smooth, model-free signal for demos and benchmarks.

    >>> length_fraction([""], [""], [{}], completion_ids=[[0] * 25], max_tokens=100)
    [0.25]
    """
    return [min(len(ids) / max_tokens, 1.0) for ids in completion_ids]


# --------------------------------------------------------------------------- remote


class BatchError(Exception):
    """The whole batch failed (an endpoint down or answering garbage): scoring the samples one
    by one would fail the same way, so they are not retried individually."""


class _Retryable(Exception):
    pass


@register("remote")
async def remote(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    url: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    **_: Any,
) -> list[Any]:
    """POST ``{"prompts", "completions", "metadata"}`` as JSON to ``url``; the answer must be
    ``{"rewards": [...]}`` (or the bare list), one float or ``{"reward": x, ...}`` per sample.

    Connection errors, timeouts, 429 and 5xx are retried ``retries`` times with exponential
    back-off and jitter; any other status or a malformed answer fails the batch at once.
    """
    import aiohttp

    if not url:
        raise ValueError("remote needs kwargs.url, e.g. {name: remote, kwargs: {url: http://host:port/score}}")
    body = {"prompts": prompts, "completions": completions, "metadata": metadata}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    last = ""
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                return await _post(session, url, body, len(prompts))
            except _Retryable as err:
                last = str(err)
            except (aiohttp.ClientError, TimeoutError) as err:
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    raise BatchError(f"{url} failed {retries + 1} times; last: {last}")


async def _post(session: Any, url: str, body: dict[str, Any], n: int) -> list[Any]:
    async with session.post(url, json=body) as resp:
        if resp.status == 429 or resp.status >= 500:
            raise _Retryable(f"HTTP {resp.status}")
        if resp.status != 200:
            raise BatchError(f"{url} answered HTTP {resp.status}: {(await resp.text())[:200]!r}")
        try:
            data = await resp.json(content_type=None)
        except ValueError:
            raise BatchError(f"{url} answered something that is not JSON: {(await resp.text())[:200]!r}") from None
    rewards = data.get("rewards") if isinstance(data, dict) else data
    if not isinstance(rewards, list) or len(rewards) != n:
        raise BatchError(f"{url} must answer {{'rewards': [{n} numbers]}}, got {str(data)[:200]!r}")
    for r in rewards:
        value = r.get("reward") if isinstance(r, dict) else r
        if isinstance(value, bool) or not isinstance(value, int | float):  # NaN / inf: the scorer's check
            raise BatchError(f"{url} answered a reward that is not a number: {r!r}")
    return rewards


@register("reward_model")
async def reward_model(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    url: str = "http://127.0.0.1:8300/score",
    **kwargs: Any,
) -> list[Any]:
    """Scores from a reward-model server (``flywheel-rm``), which speaks the ``remote`` protocol."""
    return await remote(prompts, completions, metadata, url=url, **kwargs)
