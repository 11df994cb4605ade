"""Reward functions: pure functions of a sample, chosen by ``reward.function``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from flywheel.wire import ScoreRequest, unpack_i32

RewardFn = Callable[[ScoreRequest], tuple[float, dict[str, float]]]


def length_reward(max_tokens: int) -> RewardFn:
    """Fraction of the token budget used: a smooth, model-free signal for demos and benchmarks."""

    def score(req: ScoreRequest) -> tuple[float, dict[str, float]]:
        n = len(req.response_tokens) // 4
        return min(n / max_tokens, 1.0), {"tokens": float(n)}

    return score


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match_reward(tokenizer: Any) -> RewardFn:
    """1 if the last number in the decoded response equals metadata['answer'], else 0."""

    def score(req: ScoreRequest) -> tuple[float, dict[str, float]]:
        answer = req.metadata.get("answer")
        if answer is None:
            raise ValueError("exact_match needs metadata 'answer': add it to data.metadata_keys")
        text = tokenizer.decode(np.asarray(unpack_i32(req.response_tokens)).tolist(), skip_special_tokens=True)
        numbers = _NUMBER.findall(text)
        hit = bool(numbers) and numbers[-1].strip() == str(answer).strip()
        return float(hit), {"format": float(bool(numbers))}

    return score
