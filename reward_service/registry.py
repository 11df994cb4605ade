"""Reward functions by name: the built-ins register here; anything else loads by import path.

A reward function scores a batch:

>>> def my_reward(prompts: list[str], completions: list[str], metadata: list[dict], **kwargs) -> list[float]:
...     return [1.0 if c.strip() == m["answer"] else 0.0 for c, m in zip(completions, metadata)]
>>> my_reward(["What is 2 + 2?", "What is 1 + 1?"], [" 4", " 3"], [{"answer": "4"}, {"answer": "2"}])
[1.0, 0.0]

``async def`` works the same way. ``kwargs`` holds the spec's ``kwargs`` from the config plus
``prompt_ids`` and ``completion_ids`` (lists of token-id lists) and ``finish_reasons``, so take
``**kwargs`` and ignore what you do not need. Return one entry per sample: a float, or a dict
with a ``"reward"`` key and any other float entries (logged as the reward's breakdown).

Use it with ``--reward.functions my_pkg.my_module:my_reward`` (the module must be importable by
the reward service: installed, or on ``PYTHONPATH``). Nothing else a config names is imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BatchFn = Callable[..., Any]
KwargsCheck = Callable[[dict[str, Any]], None]  # raises ValueError naming the bad kwarg


@dataclass(frozen=True)
class RewardFunction:
    name: str
    fn: BatchFn
    needs_text: bool = True  # False: scores token ids only (no tokenizer needed)
    check: KwargsCheck | None = None  # a built-in's own check of its kwargs, run before any scoring


_BUILTINS: dict[str, RewardFunction] = {}


def register(name: str, needs_text: bool = True, check: KwargsCheck | None = None) -> Callable[[BatchFn], BatchFn]:
    """Decorator: make ``fn`` a built-in reward function called ``name``; ``check`` refuses bad
    kwargs at start (a run then fails in seconds, not at its first score)."""

    def add(fn: BatchFn) -> BatchFn:
        _BUILTINS[name] = RewardFunction(name, fn, needs_text, check)
        return fn

    return add


def builtin_names() -> list[str]:
    _load_builtins()
    return sorted(_BUILTINS)


def resolve(name: str) -> RewardFunction:
    """A built-in by name, or a user function by ``pkg.module:fn``; a clear error otherwise."""
    _load_builtins()
    if ":" not in name:
        if name not in _BUILTINS:
            raise ValueError(
                f"reward.functions: unknown built-in {name!r}; choose one of {builtin_names()} "
                "or give a user function as 'pkg.module:fn'"
            )
        return _BUILTINS[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward.functions: cannot import {module_name!r} for {name!r} ({err}); install it or add its "
            "directory to PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.functions: {module_name!r} has no function {attr!r}")
    return RewardFunction(name, fn)


# what the reward service passes every call on its own: never a typo in a spec's kwargs
_PASSED = ("prompt_ids", "completion_ids", "finish_reasons", "max_tokens", "call_timeout_s")


def check_kwargs(fn: RewardFunction, kwargs: dict[str, Any]) -> None:
    """Refuse a spec's kwargs the function does not take (``bufer_tokens`` for ``buffer_tokens``
    was silently ignored by the built-ins, which take ``**_`` for what the service passes). A
    function whose ``**kwargs`` has a name of its own uses them (or passes them on): taken at its word."""
    params = list(inspect.signature(fn.fn).parameters.values())[3:]  # after prompts, completions, metadata
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if fn.check is not None:
        try:
            fn.check(kwargs)
        except ValueError as err:
            raise ValueError(f"reward function {fn.name!r}: {err} (reward.functions[].kwargs)") from None
    if any(p.kind is p.VAR_KEYWORD and p.name != "_" for p in params):
        return
    unknown = sorted(k for k in kwargs if k not in named and k not in _PASSED)
    if unknown:
        raise ValueError(
            f"reward function {fn.name!r} takes no argument {', '.join(map(repr, unknown))}: its arguments are "
            f"{named or 'none'} (reward.functions[].kwargs)"
        )


def _load_builtins() -> None:
    if not _BUILTINS:
        importlib.import_module("reward_service.builtins")
