"""Scoring a batch of samples with the configured reward functions (inside a pool worker).

Every failure becomes a per-sample error, never an exception out of ``Scorer.score``:

- ``exception``: a function raised. A batch that raises is scored again one sample at a time,
  so one bad sample does not fail its neighbours (unless the function raised ``BatchError``).
- ``bad_output``: a function returned the wrong number of rewards or a non-number.
- ``non_finite``: a reward is NaN or infinite.

Timeouts and crashes are the pool's to detect: it kills the worker (``pool.py``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.wire import MAX_BREAKDOWN_NAME, unpack_i32
from reward_service.builtins import BatchError
from reward_service.registry import RewardFunction, resolve


@dataclass
class Item:
    """One sample to score, as a worker receives it."""

    key: tuple[int, int]  # (group id, sample index)
    # Packed int32, as they came off the wire: bytes pickle to the worker as one copy, where
    # lists of a few thousand ints cost the service process more than the scoring itself.
    prompt_tokens: bytes
    completion_tokens: bytes
    finish_reason: str
    metadata: dict[str, Any]
    prompt_text: str | None = None  # the prompt as the dataset gave it; None: decode the tokens

    @property
    def fingerprint(self) -> int:
        """What tells two requests under one (group, sample) apart: a re-send has the same, a
        new response (a restarted hub's, a new run's) another."""
        return hash((self.prompt_tokens, self.completion_tokens, self.finish_reason))


@dataclass
class Outcome:
    reward: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "<reason>: <function>: <detail>"


@dataclass(frozen=True)
class FunctionSpec:
    """A picklable copy of one ``reward.functions`` entry (workers are spawned processes)."""

    name: str
    weight: float
    kwargs: dict[str, Any]


class Scorer:
    def __init__(self, specs: list[FunctionSpec], tokenizer: str | None, context: dict[str, Any]) -> None:
        self.functions: list[tuple[RewardFunction, FunctionSpec]] = [(resolve(s.name), s) for s in specs]
        self.context = context  # kwargs every function gets unless its spec overrides them (max_tokens)
        # each function's name in the breakdown; a name used twice (two regex_match) gets #2, #3
        seen: dict[str, int] = {}
        self.labels = []
        for s in specs:
            seen[s.name] = seen.get(s.name, 0) + 1
            self.labels.append(s.name if seen[s.name] == 1 else f"{s.name}#{seen[s.name]}")
        needs_text = any(fn.needs_text for fn, _ in self.functions)
        if needs_text and tokenizer is None:
            names = [s.name for fn, s in self.functions if fn.needs_text]
            raise ValueError(f"reward functions {names} read text: set reward.tokenizer or data.tokenizer")
        self.decode: Any = load_decoder(tokenizer) if needs_text and tokenizer else None
        self._loop: asyncio.AbstractEventLoop | None = None

    def score(self, items: list[Item]) -> list[Outcome]:
        """Never raises: an exception out of here would end the worker, and each of its samples
        would then cost a worker's restart. Every text in an outcome is valid UTF-8 (the service
        must encode it for the hub)."""
        try:
            outcomes = self._score(items)
        except Exception as err:  # the scorer's own (a token array that does not unpack, say)
            outcomes = [Outcome(error=f"bad_input: {_describe(err)}") for _ in items]
        for out in outcomes:
            if out.error is not None:
                out.error = valid_utf8(out.error)
            out.breakdown = {valid_utf8(k): v for k, v in out.breakdown.items()}
        return outcomes

    def _score(self, items: list[Item]) -> list[Outcome]:
        outcomes = [Outcome() for _ in items]
        if not items:
            return outcomes
        started = time.monotonic()  # the pool's deadline for the batch runs from here
        batch = self._batch(items)
        for (fn, spec), label in zip(self.functions, self.labels, strict=True):
            rewards = self._call(fn, spec, batch, list(range(len(items))), started)
            for out, r in zip(outcomes, rewards, strict=True):
                if out.error is not None:
                    continue
                if isinstance(r, str):
                    out.error = r
                    continue
                value, parts = r
                names = {f"{label}/{k}": v for k, v in parts.items()}
                if (long := next((n for n in names if len(n) > MAX_BREAKDOWN_NAME), None)) is not None:
                    # the hub refuses the frame such a name is in, every score of it with this one
                    out.error = (
                        f"bad_output: {spec.name}: the breakdown name {long[:80]!r}... is {len(long)} characters, "
                        f"at most {MAX_BREAKDOWN_NAME}: return shorter dict keys"
                    )
                    continue
                out.reward += spec.weight * value
                out.breakdown[label] = value
                out.breakdown.update(names)
        for out in outcomes:  # finite terms can still sum past a float (1e308 twice)
            if out.error is None and not math.isfinite(out.reward):
                out.error = f"non_finite: the weighted sum is {out.reward!r}"
        return outcomes

    def _batch(self, items: list[Item]) -> dict[str, Any]:
        decode = self.decode or (lambda ids: [""] * len(ids))
        prompt_ids = [unpack_i32(it.prompt_tokens).tolist() for it in items]
        completion_ids = [unpack_i32(it.completion_tokens).tolist() for it in items]
        decoded = decode([ids for ids, it in zip(prompt_ids, items, strict=True) if it.prompt_text is None])
        given = iter(decoded)
        return {
            # as the dataset gave them: the tokens decoded would be the chat template's text with
            # its special markers cut out, which a reward model would then wrap in its own template
            "prompts": [it.prompt_text if it.prompt_text is not None else next(given) for it in items],
            "completions": decode(completion_ids),
            "metadata": [dict(it.metadata) for it in items],
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "finish_reasons": [it.finish_reason for it in items],
        }

    def _call(
        self, fn: RewardFunction, spec: FunctionSpec, batch: dict[str, Any], rows: list[int], started: float
    ) -> list[tuple[float, dict[str, float]] | str]:
        """Rewards for ``rows`` of the batch: (reward, breakdown) or an error string each."""
        # copies of their own: a function that changes its inputs (pops a metadata key, say)
        # changes them neither for its own one-sample retries nor for the functions after it
        sub = {k: [v[i] for i in rows] for k, v in batch.items()}
        sub["metadata"] = copy.deepcopy(sub["metadata"])
        for k in ("prompt_ids", "completion_ids"):
            sub[k] = [list(ids) for ids in sub[k]]
        kwargs = {**self.context, **spec.kwargs}
        if "call_timeout_s" in kwargs:  # what is left of it: the functions before took the rest
            kwargs["call_timeout_s"] = max(0.0, float(kwargs["call_timeout_s"]) - (time.monotonic() - started))
        for k in ("prompt_ids", "completion_ids", "finish_reasons"):
            kwargs[k] = sub[k]
        try:
            result = fn.fn(sub["prompts"], sub["completions"], sub["metadata"], **kwargs)
            if inspect.isawaitable(result):
                result = self._run(result)
        except BatchError as err:
            return [f"exception: {spec.name}: {_describe(err, named=False)}"] * len(rows)
        except Exception as err:
            if len(rows) > 1:  # find the sample(s) at fault; the others still get their rewards
                return [r for i in rows for r in self._call(fn, spec, batch, [i], started)]
            return [f"exception: {spec.name}: {_describe(err)}"]
        if not isinstance(result, list | tuple) or len(result) != len(rows):
            got = f"{len(result)} values" if isinstance(result, list | tuple) else type(result).__name__
            return [f"bad_output: {spec.name}: returned {got} for {len(rows)} samples"] * len(rows)
        out: list[tuple[float, dict[str, float]] | str] = []
        for r in result:
            try:
                out.append(_one(spec.name, r))
            except Exception as err:  # an odd object whose str, repr or float raises
                out.append(f"bad_output: {spec.name}: {_describe(err)}")
        return out

    def _run(self, awaitable: Any) -> Any:
        if self._loop is None:  # one loop for the worker's life: clients and sessions may cache it
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)


def load_decoder(path: str) -> Any:
    """ids lists -> texts, special tokens skipped. A local fast tokenizer loads with
    ``tokenizers`` alone (tens of milliseconds: workers restart after a timeout); anything else
    goes through transformers' AutoTokenizer (which imports torch: seconds)."""
    config_file, tokenizer_file = Path(path) / "tokenizer_config.json", Path(path) / "tokenizer.json"
    cleanup = config_file.is_file() and json.loads(config_file.read_text()).get("clean_up_tokenization_spaces")
    if tokenizer_file.is_file() and not cleanup:
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(tokenizer_file))
        return lambda ids: fast.decode_batch(ids, skip_special_tokens=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return lambda ids: tok.batch_decode(ids, skip_special_tokens=True)


def _describe(err: BaseException, named: bool = True) -> str:
    """``Type: message`` of an exception, even one whose ``__str__`` raises."""
    try:
        text = str(err)
    except Exception:
        text = "(its message could not be read)"
    return f"{type(err).__name__}: {text}" if named else text


def valid_utf8(text: str) -> str:
    """``text`` as valid UTF-8: a lone surrogate (JSON of a model's cut emoji, a path decoded with
    surrogateescape) would make the service's encoding of the answer fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _one(name: str, r: Any) -> tuple[float, dict[str, float]] | str:
    parts: dict[str, float] = {}
    if isinstance(r, dict):
        if "reward" not in r:
            return f"bad_output: {name}: a dict reward needs a 'reward' key, got {sorted(str(k) for k in r)}"
        parts = {str(k): v for k, v in r.items() if k != "reward"}
        r = r["reward"]
    values = [r, *parts.values()]
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
        return f"bad_output: {name}: rewards must be numbers, got {r!r}"
    try:
        floats = [float(v) for v in values]
    except OverflowError:  # an int past any float (10**400): math.isfinite would raise on it
        return f"bad_output: {name}: a reward too large for a float"
    if not all(math.isfinite(v) for v in floats):
        return f"non_finite: {name}: {r!r}"
    return floats[0], dict(zip(parts, floats[1:], strict=True))
