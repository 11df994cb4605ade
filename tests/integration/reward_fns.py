"""User reward functions loaded by import path (tests.integration.reward_fns:NAME) in the
reward-service tests: each misbehaves in one known way."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Any


def parity(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any) -> list[dict]:
    """1 when the completion has an even number of tokens; the worker's pid in the breakdown.
    Takes 2 ms a sample, so that parallel workers matter."""
    time.sleep(0.002 * len(completions))
    return [{"reward": float(len(ids) % 2 == 0), "pid": float(os.getpid())} for ids in kwargs["completion_ids"]]


async def slow_parity(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    await asyncio.sleep(0.01)
    return [float(len(ids) % 2 == 0) for ids in kwargs["completion_ids"]]


def _culprit(ids: list[int]) -> bool:
    return len(ids) % 5 == 0


def raises_on_some(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    if any(_culprit(ids) for ids in kwargs["completion_ids"]):
        raise RuntimeError("this sample breaks the reward function")
    return [1.0] * len(completions)


HUNG_CHILD_MARKER = "9871"  # the seconds of the sleep a hung reward function leaves behind


def hangs_on_some(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    if any(_culprit(ids) for ids in kwargs["completion_ids"]):
        # what it starts (a sandbox, say) must go with it: the test looks for this sleep after
        subprocess.Popen(["sleep", HUNG_CHILD_MARKER])
        while True:  # a pure-Python spin: no thread could stop it, only killing the worker does
            time.sleep(0)
    return [1.0] * len(completions)


def nan_on_some(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    return [float("nan") if _culprit(ids) else 1.0 for ids in kwargs["completion_ids"]]


def slow_batches(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """0.4 s a call, whatever its size: with one worker, requests wait in the service's queue
    past a short hub.score_timeout_s, and the hub sends them again."""
    time.sleep(0.4)
    return [1.0] * len(completions)


def long_term_names(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """A dict reward whose term is named by its test case's source: 300 characters on odd lengths."""
    return [{"reward": 1.0, ("x" * 300 if len(ids) % 2 else "case"): 1.0} for ids in kwargs["completion_ids"]]


def huge(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any) -> list[Any]:
    """Finite values that break a float: an int past any float, and 1e308 (twice it is inf)."""
    return [10**400 if len(ids) % 2 else 1e308 for ids in kwargs["completion_ids"]]


def prompt_is_the_question(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """1 when the prompt the function gets is the dataset's question itself (``metadata.prompt``),
    not the chat template's text around it."""
    return [
        {"reward": float(p == m.get("prompt")), "chars": float(len(p))} for p, m in zip(prompts, metadata, strict=True)
    ]


def length_slow_when_long(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """The length reward (len / 16), taking 2 s on a completion of 8 tokens or more: a newer
    request under the same key surely comes while such a one is being scored."""
    if any(len(ids) >= 8 for ids in kwargs["completion_ids"]):
        time.sleep(2.0)
    return [len(ids) / 16 for ids in kwargs["completion_ids"]]


def surrogate_in_its_error(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """Raises with a lone surrogate in its message (the JSON of a model's cut emoji), and names a
    breakdown term with one: text the service could not encode for the hub."""
    import json

    if any(_culprit(ids) for ids in kwargs["completion_ids"]):
        raise ValueError(f"answer {json.loads(chr(34) + chr(92) + 'ud83d' + chr(34))} is not a number")
    return [{"reward": 1.0, "term\udc80": 1.0} for _ in completions]


def pops_its_metadata(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """Takes the answer out of each sample's metadata (pop), then raises on the culprits."""
    answers = [m.pop("answer") for m in metadata]
    if any(_culprit(ids) for ids in kwargs["completion_ids"]):
        raise ValueError("cannot verify this one")
    return [float(a == "8") for a in answers]


def odd_dict_rewards(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """On the culprits, a dict without its 'reward' key whose keys cannot be sorted together."""
    return [{"score": 1.0, 0: 1.0} if _culprit(ids) else 1.0 for ids in kwargs["completion_ids"]]


def forks_a_stray_child(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """A naive sandbox on the culprits: the child it forks raises before its os._exit, and so
    returns into the worker's loop, where it would answer on the worker's pipe."""
    if any(_culprit(ids) for ids in kwargs["completion_ids"]):
        if os.fork() == 0:
            raise RuntimeError("the generated code failed in the sandbox child")
        time.sleep(0.5)  # the parent answers after the stray child would have
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def forks_a_lingering_child(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """Forks a child that outlives the batch (a pool or a server a sandbox keeps), holding every
    descriptor of the worker's, its end of the service's pipe among them."""
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def _exit_zero() -> None:
    os._exit(0)


def runs_a_process(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """Checks each answer in a multiprocessing Process with a timeout, as code-execution rewards do."""
    import multiprocessing as mp

    out = []
    for _ in completions:
        proc = mp.get_context("fork").Process(target=_exit_zero)
        proc.start()
        proc.join(10)
        out.append(float(proc.exitcode == 0))
    return out


ORPHAN_MARKER = "9872"  # the seconds of the sleep a crashed worker's reward function left behind


def starts_a_process_then_crashes(
    prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any
):
    """Starts a process (a sandbox), then its worker dies (a segfault in C code, the OOM killer)."""
    import signal

    subprocess.Popen(["sleep", ORPHAN_MARKER])
    os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)


SESSION_MARKER = "9873"  # the seconds of the sleep a reward function starts in a session of its own
_session_sleeper_started = False


def starts_a_session_sleeper(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **kwargs: Any):
    """Starts a process of its own session (a sandbox that isolates what it runs), once a worker."""
    global _session_sleeper_started
    if not _session_sleeper_started:
        _session_sleeper_started = True
        subprocess.Popen(["sleep", SESSION_MARKER], start_new_session=True)
    return [float(len(ids)) for ids in kwargs["completion_ids"]]
