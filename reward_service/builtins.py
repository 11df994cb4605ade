"""The built-in reward functions. Each takes a batch (see ``registry``) and returns one reward
per sample; ``metadata`` carries the dataset fields named by ``data.metadata_keys``."""

from __future__ import annotations

import asyncio
import math
import random
import re
import threading
from typing import Any

from flywheel.tasks import arithmetic_correct
from reward_service.registry import register


def _regexes_compile(kwargs: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if kwargs.get(key) is not None:
            try:
                re.compile(kwargs[key])
            except (re.error, TypeError) as err:
                raise ValueError(f"kwargs.{key} {kwargs[key]!r} is not a regular expression ({err})") from None


def _one_pattern(kwargs: dict[str, Any]) -> None:
    if (kwargs.get("pattern") is None) == (kwargs.get("pattern_key") is None):
        raise ValueError("give exactly one of kwargs.pattern (a regex) or kwargs.pattern_key (a metadata key)")
    _regexes_compile(kwargs, "pattern")


def _needs_url(kwargs: dict[str, Any]) -> None:
    if not kwargs.get("url"):
        raise ValueError("kwargs.url is needed, e.g. {name: remote, kwargs: {url: http://host:port/score}}")


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
    timeout_s: float = 5,
    **_: Any,
) -> list[float]:
    """Math answer verification with ``math-verify``: the completion's final answer equals the
    reference symbolically (1/2 == 0.5).

    The reference is read as LaTeX in a ``\\boxed{}`` (as verl does): bare, ``3\\sqrt{2}`` read
    as 3 and ``\\sqrt{2}`` as nothing. The answer is the last ``<answer>…</answer>`` block after
    the last ``</think>`` when there is one, else what follows the last ``</think>``, else a completion that is nothing but
    an expression (``12``, ``$x^2+1$``: the prompt asked for the bare answer). Prose with none of
    these must state its answer (a ``\\boxed{}``, or "the answer is …", as Open-R1 asks): its
    last number is no answer, it may be a step of the reasoning.

    >>> math_answer(["1/2 + 0?"], ["So the result is $\\\\boxed{0.5}$."], [{"answer": "\\\\frac{1}{2}"}])
    [1.0]
    >>> math_answer(["?"], ["\\\\boxed{3}"], [{"answer": "3\\\\sqrt{2}"}])
    [0.0]
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify bounds its sympy work with SIGALRM, which takes whole seconds and exists only in
    # the main thread (a float made it fail inside, and score every sample 0)
    timeout = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    latex = [LatexExtractionConfig()]
    latex_expr = [LatexExtractionConfig(), ExprExtractionConfig()]  # math-verify's default
    only_stated = [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]
    golds: dict[str, Any] = {}  # a group's samples share their reference: parsed once a batch

    def reference(text: str) -> Any:
        if len(text) > 1 and text[0] == text[-1] == "$":
            text = text[1:-1]
        boxed = text if "\\boxed" in text else "\\boxed{" + text + "}"
        gold = parse(boxed, extraction_config=latex, parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"math: the reference answer {text!r} does not parse as LaTeX")
        return gold

    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        gold_text = _answer(meta, answer_key)
        if gold_text not in golds:
            golds[gold_text] = reference(gold_text)
        gold = golds[gold_text]
        stated, anchored = _final_answer(completion)
        pred = parse(stated, extraction_config=latex_expr if anchored else only_stated, parsing_timeout=timeout)
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=timeout)))
    return out


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_PROSE = re.compile(r"[^\W\d_]{2,}")  # a word of two letters or more (x^2 is no prose, \frac no word)


def _final_answer(completion: str) -> tuple[str, bool]:
    """Where a completion states its answer, and whether that place holds nothing else: the last
    ``<answer>`` block after the last ``</think>`` (a tag inside the reasoning is no answer), else
    what follows the last ``</think>`` (a number in the reasoning is no answer), else the whole
    completion (marked off when it is no prose, only an expression).

    >>> _final_answer("<think>is it <answer>3</answer>?</think> So <answer>5</answer>")
    ('5', True)
    >>> _final_answer("<think>7?</think>Therefore x = 42")
    ('Therefore x = 42', True)
    """
    _, think_end, after = completion.rpartition("</think>")
    tagged = _ANSWER_TAG.findall(after)
    if tagged:
        return str(tagged[-1]), True
    if think_end:
        return after, True
    return completion, not _PROSE.search(_LATEX_COMMAND.sub(" ", completion))


LAST_NUMBER = "last_number"  # exact_match's default extraction
# a number in text: thousands separators only in threes (a comma after it is punctuation)
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)
# a whole text that is a number: a sign, separators in threes, a decimal point (12. too), an exponent
_NUMBER_TEXT = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?", re.ASCII)


@register("exact_match", check=lambda kw: _regexes_compile(kw, "extract"))
def exact_match(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    answer_key: str = "answer",
    extract: str | None = LAST_NUMBER,
    ignore_case: bool = False,
    **_: Any,
) -> list[float]:
    """1 when the extracted answer equals the reference after whitespace normalisation; two
    numbers are compared as numbers (``1,000`` equals ``1000``, ``42.0`` equals ``42``).

    ``extract`` is a regex whose first group is the answer (default ``last_number``: the
    completion's last number, found in one pass; ``None``: the whole completion).

    >>> exact_match(["2+2?"], ["I think it is 4"], [{"answer": "4"}])
    [1.0]
    >>> exact_match(["?"], ["The answer is 1,000."], [{"answer": "1000"}])
    [1.0]
    >>> exact_match(["?"], ["The answer is 42, as required."], [{"answer": "42"}])
    [1.0]
    """
    pattern = re.compile(extract, re.DOTALL) if extract and extract != LAST_NUMBER else None
    out = []
    for completion, meta in zip(completions, metadata, strict=True):
        text = completion
        if extract == LAST_NUMBER:
            numbers = _NUMBER_IN_TEXT.findall(completion)
            text = numbers[-1] if numbers else ""
        elif pattern is not None:
            found = pattern.search(completion)
            text = ((found.group(1) or "") if found.groups() else found.group()) if found else ""
        got, want = " ".join(text.split()), " ".join(_answer(meta, answer_key).split())
        if ignore_case:
            got, want = got.lower(), want.lower()
        number = _number(got)
        same = got == want or (number is not None and number == _number(want))
        out.append(float(bool(got) and same))
    return out


def _number(text: str) -> float | None:
    """``text`` as a number (thousands separators allowed), or None: only ASCII digits, so not
    ``inf``, ``1_0`` or other scripts' digits, which ``float`` would take.

    >>> _number("1,000"), _number("12."), _number("-0.5"), _number("1_0"), _number("inf")
    (1000.0, 12.0, -0.5, None, None)
    """
    if not _NUMBER_TEXT.fullmatch(text):
        return None
    return float(text.replace(",", ""))


@register("regex_match", check=lambda kw: _one_pattern(kw))
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


@register("format", check=lambda kw: _regexes_compile(kw, "pattern"))
def format_reward(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    pattern: str = r"(?:<think>)?(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>",
    **_: Any,
) -> list[float]:
    """1 when the whole completion (stripped) has the required format; by default
    ``<think>…</think><answer>…</answer>``: one of each, nothing nested, and the opening
    ``<think>`` optional (chat templates of reasoning models put it in the prompt).

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
    if buffer > max_tokens:
        raise ValueError(f"length_penalty: buffer_tokens {buffer} is more than max_tokens {max_tokens}")
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


@register("remote", check=lambda kw: _needs_url(kw))
async def remote(
    prompts: list[str],
    completions: list[str],
    metadata: list[dict[str, Any]],
    url: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    call_timeout_s: float | None = None,
    **_: Any,
) -> list[Any]:
    """POST ``{"prompts", "completions", "metadata"}`` as JSON to ``url``; the answer must be
    ``{"rewards": [...]}`` (or the bare list), one float or ``{"reward": x, ...}`` per sample.

    Connection errors, timeouts, 429 and 5xx are retried ``retries`` times with exponential
    back-off and jitter; any other status or a malformed answer fails the batch at once. All of it
    ends within 0.8 of ``call_timeout_s`` (what is left of the service's ``reward.timeout_s`` for
    the batch when this function starts), so that a dead
    endpoint fails the batch as such, before the pool kills the worker and retries each sample
    alone, each then waiting out the whole deadline.
    """
    import aiohttp

    if not url:
        raise ValueError("remote needs kwargs.url, e.g. {name: remote, kwargs: {url: http://host:port/score}}")
    body = {"prompts": prompts, "completions": completions, "metadata": metadata}
    loop = asyncio.get_running_loop()
    budget_end = None if call_timeout_s is None else loop.time() + 0.8 * call_timeout_s
    last, tries = "", 0
    async with aiohttp.ClientSession(headers=headers) as session:
        for attempt in range(retries + 1):
            if attempt:
                pause = backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                if budget_end is not None and loop.time() + pause >= budget_end:
                    break
                await asyncio.sleep(pause)
            left = timeout_s if budget_end is None else min(timeout_s, budget_end - loop.time())
            if left <= 0:
                break
            tries += 1
            try:
                return await _post(session, url, body, len(prompts), aiohttp.ClientTimeout(total=left))
            except _Retryable as err:
                last = str(err)
            except (aiohttp.ClientError, TimeoutError) as err:
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    if not tries:
        raise BatchError(f"no time left for {url}: the reward functions before it took reward.timeout_s")
    raise BatchError(f"{url} failed {tries} times; last: {last}")


async def _post(session: Any, url: str, body: dict[str, Any], n: int, timeout: Any) -> list[Any]:
    async with session.post(url, json=body, timeout=timeout) as resp:
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
