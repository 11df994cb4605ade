"""Greedy decoding checked against a HF forward pass, up to ties."""

from __future__ import annotations

import numpy as np
import torch

# Two logits this close are a tie: vLLM's CPU kernels and HF's forward pass may break it either
# way (a tie of 6e-8 on the tiny model broke differently on one CI machine). A token that another
# policy chose misses by far more: the tests' policies differ in every weight.
GREEDY_TIE = 1e-3


def teacher_forced(model: torch.nn.Module, prompt: np.ndarray, response: np.ndarray) -> torch.Tensor:
    """Logits at every response position, given prompt + the response tokens before it."""
    ids = torch.tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def shortfall(logits: torch.Tensor, tokens: np.ndarray) -> np.ndarray:
    """How far below the best logit each chosen token's logit is (0 where it is the argmax)."""
    chosen = torch.tensor(tokens, dtype=torch.long)[:, None]
    return (logits.max(-1).values - logits.gather(1, chosen)[:, 0]).numpy()


def assert_greedy(logits: torch.Tensor, tokens: np.ndarray, where: np.ndarray, label: str) -> None:
    """Every token at ``where`` is ``label``'s greedy choice, up to a tie."""
    short = shortfall(logits, tokens)
    wrong = np.flatnonzero((short > GREEDY_TIE) & where)
    assert len(wrong) == 0, (
        f"tokens {wrong.tolist()} labelled {label} are not that policy's greedy choice "
        f"(their logits are {short[wrong].tolist()} below its best)"
    )
