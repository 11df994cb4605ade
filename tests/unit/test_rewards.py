"""Reward functions on known cases, the scorer's error handling, and remote endpoints that are
slow, down, flaky or answer garbage (a real HTTP server on a free port)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flywheel.wire import Score, pack_i32
from reward_service import builtins as b
from reward_service.registry import builtin_names, resolve
from reward_service.scoring import FunctionSpec, Item, Scorer

META = [{"answer": "8"}]


def test_arithmetic_takes_the_first_integer() -> None:
    got = b.arithmetic([""] * 4, [" 8", " 8 + 1 = 9", " 9, no 8", " eight"], META * 4)
    assert [g["reward"] for g in got] == [1.0, 1.0, 0.0, 0.0]
    assert [g["format"] for g in got] == [1.0, 1.0, 1.0, 0.0]
    # the first number is the whole number: " 7.5" is no 7; a full-width digit is no number here
    got = b.arithmetic([""] * 3, [" 7.5", " -7", " ７"], [{"answer": "7"}, {"answer": "-7"}, {"answer": "7"}])
    assert [(g["reward"], g["format"]) for g in got] == [(0.0, 1.0), (1.0, 1.0), (0.0, 0.0)]


def test_math_verifies_symbolically() -> None:
    completions = ["so $\\boxed{\\frac{1}{2}}$", "the answer is 0.5", "$\\boxed{0.25}$", "no idea"]
    assert b.math_answer([""] * 4, completions, [{"answer": "1/2"}] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert b.math_answer([""], ["$x^2+2x+1$"], [{"answer": "(x+1)^2"}]) == [1.0]


def test_math_takes_no_number_of_the_reasoning_for_the_answer() -> None:
    """Prose with no <answer> block and no </think> must state its answer (boxed, or "the answer
    is"): its last number may be a step of the reasoning (here 12 = 3 * 4)."""
    unstated = ["I will add 5 to 3 * 4 = 12", "Adding: $3 \\cdot 4 = 12$"]
    assert b.math_answer([""] * 2, unstated, [{"answer": "12"}] * 2) == [0.0, 0.0]
    stated = [
        "3 * 4 = 12, plus 5: $\\boxed{17}$",
        "so the final answer is 17",
        "<answer>17</answer>",
        "</think>17",
        " 17",
    ]
    assert b.math_answer([""] * 5, stated, [{"answer": "17"}] * 5) == [1.0] * 5


def test_math_reads_latex_references_and_the_stated_answer() -> None:
    """The reference is parsed as LaTeX in a box: bare, 3\\sqrt{2} read as 3 (a wrong \\boxed{3}
    scored 1) and \\sqrt{2} as nothing (a right answer scored 0). The answer is the last
    <answer> block or what follows </think>, not a number of the reasoning."""
    wrong = ["\\boxed{3}", "\\boxed{2}", "\\boxed{5}"]
    golds = [{"answer": "3\\sqrt{2}"}, {"answer": "2\\pi"}, {"answer": "5\\sqrt{2}+1"}]
    assert b.math_answer([""] * 3, wrong, golds) == [0.0, 0.0, 0.0]
    right = ["\\boxed{\\sqrt{2}}", "$\\boxed{\\frac{1}{2}}$", "\\boxed{(3, \\infty)}", "\\boxed{\\frac34}"]
    golds = [{"answer": "\\sqrt{2}"}, {"answer": "\\frac12"}, {"answer": "(3,\\infty)"}, {"answer": "$\\dfrac{3}{4}$"}]
    assert b.math_answer([""] * 4, right, golds) == [1.0, 1.0, 1.0, 1.0]
    tagged = [
        "<think>7</think>\n<answer>42</answer>",
        "<think>it's 42</think><answer>7</answer>",
        "<think>42</think> 7",
    ]
    assert b.math_answer([""] * 3, tagged, [{"answer": "42"}] * 3) == [1.0, 0.0, 0.0]
    # SIGALRM takes whole seconds: a float timeout made math-verify fail inside and score 0
    assert b.math_answer([""], ["\\boxed{0.5}"], [{"answer": "1/2"}], timeout_s=2.5) == [1.0]
    with pytest.raises(ValueError, match="does not parse"):
        b.math_answer([""], ["\\boxed{1}"], [{"answer": "}{"}])


def test_math_reads_the_answer_after_the_reasoning_only() -> None:
    """A tag inside <think> is reasoning, not the answer (it was taken before a boxed answer after
    </think>); what follows </think> is the answer's place, prose or not."""
    assert b.math_answer([""], ["<think>is it <answer>3</answer>?</think> So \\boxed{5}"], [{"answer": "5"}]) == [1.0]
    final = ["<think>7?</think>Therefore x = 42", "</think>The result is $42$.", "</think>So the answer is 42."]
    assert b.math_answer([""] * 3, final, [{"answer": "42"}] * 3) == [1.0] * 3


def test_exact_match_reads_the_last_number_in_one_pass() -> None:
    """A comma after the answer is punctuation (the default regex took "42," and scored 0), and a
    long run of digits and commas (a completion cut at its budget) is read in linear time (the
    regex's look-ahead backtracked: 1.3 s on 8,000 characters, past a reward timeout at 40,000)."""
    texts = ["The answer is 42, as required.", "it is 1,000, so", "3, then 4,", "none"]
    golds = [{"answer": "42"}, {"answer": "1000"}, {"answer": "4"}, {"answer": "0"}]
    assert b.exact_match([""] * 4, texts, golds) == [1.0, 1.0, 1.0, 0.0]
    assert b.exact_match([""], ["x 12"], [{"answer": "12."}]) == [1.0]
    assert b.exact_match([""], ["1_0"], [{"answer": "10"}], extract=None) == [0.0]  # no number to float()
    start = time.perf_counter()
    assert b.exact_match([""], ["1," * 40_000 + "a9"], [{"answer": "9"}]) == [1.0]
    assert time.perf_counter() - start < 1.0


def test_exact_match_regex_match_and_format() -> None:
    assert b.exact_match([""] * 3, ["it is 8", "8 or 9", "  8 "], META * 3) == [1.0, 0.0, 1.0]
    numbers = ["The answer is 1,000.", "1000", "42.0", "-3"]
    golds = [{"answer": "1000"}, {"answer": "1,000"}, {"answer": "42"}, {"answer": "-3"}]
    assert b.exact_match([""] * 4, numbers, golds) == [1.0, 1.0, 1.0, 1.0]  # (once "1,000" read as 000, 42.0 != 42)
    assert b.exact_match([""], ["no"], [{"answer": "yes"}], extract=r"(yes)|no") == [0.0]  # a group that did not match
    assert b.exact_match([""] * 2, ["Paris ", "paris"], [{"city": "Paris"}] * 2, answer_key="city", extract=None) == [
        1.0,
        0.0,
    ]
    assert b.exact_match([""], ["PARIS"], [{"a": "paris"}], answer_key="a", extract=None, ignore_case=True) == [1.0]
    assert b.regex_match([""] * 2, ["answer: yes", "maybe"], [{}] * 2, pattern=r"answer: (yes|no)") == [1.0, 0.0]
    assert b.regex_match([""] * 2, ["id 42", "id 43"], [{"rx": r"\b42\b"}] * 2, pattern_key="rx") == [1.0, 0.0]
    with pytest.raises(ValueError, match="exactly one"):
        b.regex_match([""], [""], [{}])
    assert b.format_reward([""] * 3, ["<think>a</think><answer>1</answer>", "<answer>1</answer>", "x"], [{}] * 3) == [
        1.0,
        0.0,
        0.0,
    ]


def test_format_wants_one_think_and_one_answer_and_allows_a_think_opened_by_the_template() -> None:
    texts = [
        "<think>a</think><answer>1</answer>",
        "a</think>\n<answer>1</answer>",  # <think> was in the prompt (Qwen3, R1-distill templates)
        "<think>a</think><answer>1</answer><answer>2</answer>",  # two answers
        "<think>a<think>b</think></think><answer>1</answer>",  # nested
    ]
    assert b.format_reward([""] * 4, texts, [{}] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_length_penalty_is_dapos_soft_overlong_penalty() -> None:
    ids = [[0] * n for n in (10, 80, 90, 100, 130)]
    got = b.length_penalty([""] * 5, [""] * 5, [{}] * 5, completion_ids=ids, max_tokens=100, buffer_tokens=20)
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer_tokens 200 is more than max_tokens 100"):
        b.length_penalty([""], [""], [{}], completion_ids=[[0]], max_tokens=100, buffer_tokens=200)
    assert b.length_fraction([""] * 2, [""] * 2, [{}] * 2, completion_ids=[[0] * 5, [0] * 50], max_tokens=10) == [
        0.5,
        1.0,
    ]


def test_registry_names_and_import_paths() -> None:
    assert {"arithmetic", "math", "exact_match", "regex_match", "format", "length_penalty", "remote"} <= set(
        builtin_names()
    )
    assert resolve("tests.integration.reward_fns:parity").fn([""], [""], [{}], completion_ids=[[1, 2]]) == [
        {"reward": 1.0, "pid": pytest.approx(float(__import__("os").getpid()))}
    ]
    with pytest.raises(ValueError, match="unknown built-in 'maths'"):
        resolve("maths")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.mod'"):
        resolve("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve("tests.integration.reward_fns:nope")


def items(lengths: list[int]) -> list[Item]:
    return [
        Item((0, i), pack_i32([5, 6]), pack_i32(range(7, 7 + n)), "stop", {"answer": "8"})
        for i, n in enumerate(lengths)
    ]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    from flywheel.tiny import build_tokenizer

    return str(build_tokenizer(tmp_path_factory.mktemp("tok")))


def scorer(tok: str, *specs: tuple[str, float, dict[str, Any]]) -> Scorer:
    return Scorer([FunctionSpec(*s) for s in specs], tok, {"max_tokens": 100})


def test_scorer_sums_weighted_rewards_with_a_breakdown(tok: str) -> None:
    s = scorer(tok, ("tests.integration.reward_fns:parity", 2.0, {}), ("length", 0.5, {"max_tokens": 10}))
    out = s.score(items([4, 5]))
    assert [o.reward for o in out] == [2.0 + 0.5 * 0.4, 0.5 * 0.5]
    assert set(out[0].breakdown) == {
        "tests.integration.reward_fns:parity",
        "tests.integration.reward_fns:parity/pid",
        "length",
    }
    assert all(o.error is None for o in out)
    twice = scorer(tok, ("length", 1.0, {"max_tokens": 10}), ("length", 2.0, {"max_tokens": 5})).score(items([4]))
    assert twice[0].breakdown == {"length": 0.4, "length#2": 0.8}  # the second no longer overwrote the first


def test_a_breakdown_name_the_hub_would_refuse_fails_its_sample_only(tok: str) -> None:
    """A term named past the wire's limit made the hub refuse the whole ScoreBatch frame, every
    score in it, again at each re-send: its group never became ready. Now that sample's reward
    fails with the reason, and the others' Scores pass the hub's check."""
    out = scorer(tok, ("tests.integration.reward_fns:long_term_names", 1.0, {})).score(items([4, 5]))
    assert out[0].error is None and out[0].reward == 1.0
    assert out[1].error is not None and out[1].error.startswith("bad_output: tests.integration.reward_fns:long_")
    assert "at most 256" in out[1].error and "shorter dict keys" in out[1].error
    for o in out:
        Score(worker_id="w", group_id=0, sample=0, reward=o.reward, breakdown=o.breakdown, error=o.error).check()


def test_scorer_isolates_a_raising_sample_and_flags_nan_and_bad_output(tok: str) -> None:
    out = scorer(tok, ("tests.integration.reward_fns:raises_on_some", 1.0, {})).score(items([4, 5, 6, 10]))
    assert [o.error is None for o in out] == [True, False, True, False]  # lengths 5 and 10 break it
    assert out[1].error is not None and out[1].error.startswith("exception: tests.integration.reward_fns:raises")
    assert "this sample breaks" in out[1].error and out[0].reward == 1.0
    out = scorer(tok, ("tests.integration.reward_fns:nan_on_some", 1.0, {})).score(items([4, 5]))
    assert out[0].error is None and out[1].error is not None and out[1].error.startswith("non_finite")
    bad = Scorer([FunctionSpec("length", 1.0, {})], None, {})  # max_tokens missing: a TypeError per sample
    assert all(o.error and "max_tokens" in o.error for o in bad.score(items([1, 2])))


def test_a_sum_past_a_float_is_an_error_not_a_reward(tok: str) -> None:
    """A value too large for a float crashed the worker (OverflowError); 1e308 twice summed to
    inf, which the hub's check then refused with the whole batch, every finite score in it too."""
    out = scorer(tok, ("tests.integration.reward_fns:huge", 2.0, {})).score(items([1, 2]))
    assert out[0].error is not None and out[0].error.startswith("bad_output") and "too large" in out[0].error
    assert out[1].error is not None and out[1].error.startswith("non_finite: the weighted sum")
    from flywheel.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weight"):
        load_config(["--reward.functions", "[{name: math, weight: .nan}]"])


def test_scorer_runs_async_functions(tok: str) -> None:
    out = scorer(tok, ("tests.integration.reward_fns:slow_parity", 1.0, {})).score(items([2, 3, 4]))
    assert [o.reward for o in out] == [1.0, 0.0, 1.0]


def test_scorer_needs_a_tokenizer_only_for_text(tok: str) -> None:
    with pytest.raises(ValueError, match=r"read text: set reward.tokenizer"):
        Scorer([FunctionSpec("arithmetic", 1.0, {})], None, {})
    assert Scorer([FunctionSpec("length_penalty", 1.0, {})], None, {}).decode is None
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(tok)
    hf_text = enc.batch_decode([enc.encode("What is 3 + 5? Answer: 8</s>")], skip_special_tokens=True)
    assert (
        Scorer([FunctionSpec("math", 1.0, {})], tok, {}).decode([enc.encode("What is 3 + 5? Answer: 8</s>")]) == hf_text
    )
    s = Scorer([FunctionSpec("arithmetic", 1.0, {}), FunctionSpec("math", 1.0, {})], tok, {})
    it = [
        Item(
            (0, 0), pack_i32(enc.encode("What is 3 + 5? Answer:")), pack_i32(enc.encode(" 8")), "stop", {"answer": "8"}
        )
    ]
    assert s.score(it)[0].reward == 2.0


def test_functions_get_the_prompts_text_when_it_came_and_the_tokens_decoded_when_not(tok: str) -> None:
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(tok)
    templated = pack_i32(enc.encode("<s>user: What is 3 + 5?\nassistant:"))  # the tiny template's text
    batch = scorer(tok, ("math", 1.0, {}))._batch(
        [
            Item((0, 0), templated, pack_i32(enc.encode(" 8")), "stop", {}, prompt_text="What is 3 + 5?"),
            Item((0, 1), pack_i32(enc.encode("What is 1 + 1?")), pack_i32(enc.encode(" 2")), "stop", {}),
            Item((0, 2), templated, pack_i32(enc.encode(" 8")), "stop", {}, prompt_text=""),
        ]
    )
    assert batch["prompts"] == ["What is 3 + 5?", "What is 1 + 1?", ""]


# --------------------------------------------------------------------------- remote endpoints


class Endpoint:
    """A real HTTP reward endpoint whose behaviour the test switches."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                endpoint.calls += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = len(body["completions"])
                status, payload = 200, json.dumps({"rewards": [float(len(c)) for c in body["completions"]]})
                if endpoint.mode == "slow":
                    time.sleep(1.0)
                elif endpoint.mode == "garbage":
                    payload = "<html>oops</html>"
                elif endpoint.mode == "wrong_length":
                    payload = json.dumps({"rewards": [1.0] * (n + 1)})
                elif endpoint.mode == "flaky" and endpoint.calls <= 2:
                    status, payload = 503, "busy"
                elif endpoint.mode == "nan":
                    payload = json.dumps({"rewards": [float("nan")] * n})  # Python's json writes NaN
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.close()


def remote_scorer(tok: str, url: str, **kwargs: Any) -> Scorer:
    return Scorer([FunctionSpec("remote", 1.0, {"url": url, "backoff_s": 0.05, **kwargs})], tok, {})


def test_remote_scores_a_batch_and_retries_a_flaky_endpoint(tok: str, endpoint: Endpoint) -> None:
    s = remote_scorer(tok, endpoint.url)
    batch = items([1, 3])
    out = s.score(batch)  # the endpoint's reward: the length of the decoded completion
    assert [o.reward for o in out] == [float(len(c)) for c in s._batch(batch)["completions"]]
    assert out[1].reward > out[0].reward > 0 and endpoint.calls == 1
    endpoint.mode, endpoint.calls = "flaky", 0
    out = s.score(items([1]))
    assert out[0].error is None and endpoint.calls == 3  # two 503s, then the answer


@pytest.mark.parametrize(
    ("mode", "expect"),
    [("slow", "TimeoutError"), ("garbage", "not JSON"), ("wrong_length", "must answer"), ("nan", "non_finite")],
)
def test_remote_failures_become_errors_not_hangs(tok: str, endpoint: Endpoint, mode: str, expect: str) -> None:
    endpoint.mode = mode
    start = time.monotonic()
    # Only the slow endpoint must run into the timeout. The others answer at once, but a loaded
    # CI machine once took over 0.3 s to: that answer timed out, was retried, and calls read 2.
    timeout_s = 0.3 if mode == "slow" else 3.0
    out = remote_scorer(tok, endpoint.url, timeout_s=timeout_s, retries=1).score(items([1, 2, 3]))
    assert time.monotonic() - start < 5
    assert all(o.error is not None and expect in o.error for o in out), out
    if mode in ("garbage", "wrong_length"):
        assert endpoint.calls == 1  # a malformed answer is not retried, nor split per sample


def test_remote_down_is_retried_then_reported(tok: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = remote_scorer(tok, f"http://127.0.0.1:{port}/score", retries=2).score(items([1, 2]))
    assert all(o.error is not None and "failed 3 times" in o.error for o in out)
    assert math.isfinite(out[0].reward)


def test_a_dead_endpoint_fails_the_batch_within_the_services_deadline(tok: str) -> None:
    """Retries and their back-off stop at 0.8 of reward.timeout_s: past that deadline the pool
    kills the worker and retries every sample alone, each waiting it out again."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)  # accepts, never answers
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/score"
        s = Scorer(
            [FunctionSpec("remote", 1.0, {"url": url, "backoff_s": 0.05, "timeout_s": 10.0, "retries": 3})],
            tok,
            {"call_timeout_s": 2.0},
        )
        started = time.monotonic()
        out = s.score(items([1, 2]))
        assert time.monotonic() - started < 2.0
    assert all(o.error is not None and "exception: remote" in o.error and "failed 1 times" in o.error for o in out)


def slow_first(prompts: list[str], completions: list[str], metadata: list[dict[str, Any]], **_: Any) -> list[float]:
    time.sleep(1.2)
    return [0.0] * len(completions)


def test_a_remote_after_a_slow_function_ends_within_the_batchs_deadline_not_its_own(tok: str) -> None:
    """The pool's deadline runs from the batch's start: a remote that took 0.8 of the whole
    reward.timeout_s from its own start would run past it, the worker killed mid-batch."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)  # accepts, never answers
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/score"
        s = Scorer(
            [
                FunctionSpec("tests.unit.test_rewards:slow_first", 1.0, {}),
                FunctionSpec("remote", 1.0, {"url": url, "backoff_s": 0.05, "timeout_s": 10.0, "retries": 3}),
            ],
            tok,
            {"call_timeout_s": 2.0},
        )
        started = time.monotonic()
        out = s.score(items([1, 2]))
        assert time.monotonic() - started < 2.0
    assert all(o.error is not None and "exception: remote" in o.error for o in out)
    s = Scorer(
        [FunctionSpec("tests.unit.test_rewards:slow_first", 1.0, {}), FunctionSpec("remote", 1.0, {"url": url})],
        tok,
        {"call_timeout_s": 1.0},
    )
    assert all(o.error is not None and "no time left for" in o.error for o in s.score(items([1])))


def test_docstring_examples_run() -> None:
    import doctest

    from reward_service import registry

    for module in (registry, b):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_the_config_knows_every_built_in_reward() -> None:
    """The config refuses an unknown built-in at once by its own list: it must be the registry's."""
    from flywheel.config import BUILTIN_REWARDS
    from reward_service.registry import builtin_names

    assert sorted(BUILTIN_REWARDS) == builtin_names()


def test_a_misspelled_reward_argument_is_refused_at_start() -> None:
    """`{name: length_penalty, kwargs: {bufer_tokens: 256}}` ran with the default buffer, in silence."""
    from reward_service.registry import check_kwargs, resolve

    with pytest.raises(ValueError, match="'length_penalty' takes no argument 'bufer_tokens'"):
        check_kwargs(resolve("length_penalty"), {"bufer_tokens": 256})
    check_kwargs(resolve("length_penalty"), {"buffer_tokens": 256})
    check_kwargs(resolve("reward_model"), {"url": "http://rm/score", "retries": 2})  # passed on to `remote`


@pytest.mark.parametrize(
    ("name", "kwargs", "said"),
    [
        ("regex_match", {}, "give exactly one of kwargs.pattern"),  # failed every group at its first score
        ("regex_match", {"pattern": "a", "pattern_key": "rx"}, "give exactly one of kwargs.pattern"),
        ("regex_match", {"pattern": "(yes"}, "kwargs.pattern '\\(yes' is not a regular expression"),
        ("format", {"pattern": "["}, "kwargs.pattern '\\[' is not a regular expression"),
        ("exact_match", {"extract": "(?P<"}, "kwargs.extract .* is not a regular expression"),
        ("remote", {"timeout_s": 5}, "kwargs.url is needed"),
    ],
)
def test_a_built_ins_bad_arguments_are_refused_at_start(name: str, kwargs: dict[str, Any], said: str) -> None:
    from reward_service.registry import check_kwargs, resolve

    with pytest.raises(ValueError, match=f"reward function '{name}': {said}"):
        check_kwargs(resolve(name), kwargs)
    check_kwargs(resolve("regex_match"), {"pattern_key": "rx"})
    check_kwargs(resolve("exact_match"), {"extract": None})


def test_what_a_function_does_wrong_fails_its_own_samples_as_text_the_hub_takes(tok: str) -> None:
    """A lone surrogate in an exception's message or a breakdown name: msgspec could not encode
    the answer, and the service died (every service the hub then sent the sample to, too). A dict
    reward whose keys do not sort together: the scorer's own message raised, and the worker died.
    A function that pops its metadata: its one-sample retries, and the functions after it, found
    the keys gone, and healthy samples failed."""
    from flywheel.wire import ScoreBatch, encode

    out = scorer(tok, ("tests.integration.reward_fns:surrogate_in_its_error", 1.0, {})).score(items([4, 5]))
    assert out[1].error is not None and "\\ud83d is not a number" in out[1].error
    assert "tests.integration.reward_fns:surrogate_in_its_error/term\\udc80" in out[0].breakdown
    scores = [Score(worker_id="w", group_id=0, sample=i, reward=o.reward, breakdown=o.breakdown, error=o.error)
              for i, o in enumerate(out)]  # fmt: skip
    encode(ScoreBatch(worker_id="w", scores=scores))  # no UnicodeEncodeError
    out = scorer(tok, ("tests.integration.reward_fns:odd_dict_rewards", 1.0, {})).score(items([4, 5]))
    assert out[0].reward == 1.0
    assert out[1].error is not None and "needs a 'reward' key, got ['0', 'score']" in out[1].error
    pops = ("tests.integration.reward_fns:pops_its_metadata", 1.0, {})
    out = scorer(tok, pops, pops).score(items([4, 5, 6]))
    assert [o.error is None for o in out] == [True, False, True], [o.error for o in out]
    assert [out[0].reward, out[2].reward] == [2.0, 2.0]


def test_a_function_may_run_processes(tok: str) -> None:
    """Workers were daemonic, and a daemonic process may start none: a reward running each check
    in a multiprocessing Process failed every sample."""
    from reward_service.pool import WorkerPool

    pool = WorkerPool(1, [FunctionSpec("tests.integration.reward_fns:runs_a_process", 1.0, {})], tok, {}, 30)
    try:
        results = run_batches(pool, [items([4, 5])])
        assert [[(o.reward, o.error) for o in r] for r in results] == [[(1.0, None), (1.0, None)]]
    finally:
        pool.close()


def test_a_child_a_function_forks_never_answers_for_the_worker(tok: str) -> None:
    """A forked child that fell back into the worker's loop answered on its pipe: the pool
    credited that answer to the next batch (its samples got another batch's rewards), then the
    service died on the lengths' mismatch."""
    from reward_service.pool import WorkerPool

    pool = WorkerPool(1, [FunctionSpec("tests.integration.reward_fns:forks_a_stray_child", 1.0, {})], tok, {}, 30)
    try:
        results = run_batches(pool, [items([5]), items([8])])
        assert [[(o.reward, o.error) for o in r] for r in results] == [[(5.0, None)], [(8.0, None)]]
        assert pool.restarts == 0
    finally:
        pool.close()


def test_a_worker_that_died_idle_is_replaced_though_a_child_holds_its_pipe(tok: str) -> None:
    """A worker killed between batches (the OOM killer) whose reward function had forked a child
    that still lives: the child holds the worker's end of the pipe, so no end-of-file said the
    worker was gone. It stayed idle and ready; the next batch was sent to it and waited out
    reward.timeout_s (a batch larger than the pipe's buffer blocked the service's loop for
    good). A dead worker is now seen as one."""
    import os
    import signal

    from reward_service.pool import WorkerPool

    pool = WorkerPool(1, [FunctionSpec("tests.integration.reward_fns:forks_a_lingering_child", 1.0, {})], tok, {}, 60)
    try:
        assert [[o.reward for o in r] for r in run_batches(pool, [items([4])])] == [[4.0]]
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pool.restarts == 0:
            assert pool.collect() == [], "an idle worker held no batch"
            assert time.monotonic() < deadline, "the dead worker was not replaced"
            time.sleep(0.05)
        assert [[o.reward for o in r] for r in run_batches(pool, [items([6])])] == [[6.0]]
    finally:
        pool.close()


def run_batches(pool: Any, batches: list[list[Item]]) -> list[Any]:
    """Each batch through the pool's one worker in turn; what came back for each."""
    deadline = time.monotonic() + 120
    while not pool.idle():
        pool.collect()
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    results = []
    for batch in batches:
        assert pool.submit(pool.idle()[0], batch)
        got: list[Any] = []
        while not got:
            got = pool.collect()
            assert time.monotonic() < deadline, "no answer"
            time.sleep(0.05)
        ((items_back, outcomes),) = got
        assert items_back == batch
        results.append(outcomes)
    time.sleep(1.0)  # whatever a stray child would send comes meanwhile
    assert pool.collect() == []
    return results


def test_what_a_function_started_dies_with_its_crashed_worker(tok: str) -> None:
    """A worker that died on its own left what its reward function had started running (by then
    reparented to init, no longer below the worker); a process group of its own holds them."""
    import psutil

    from reward_service.pool import WorkerPool
    from tests.integration.reward_fns import ORPHAN_MARKER

    def orphans() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if p.info["cmdline"] == ["sleep", ORPHAN_MARKER]:
                found.append(p)
        return found

    spec = [FunctionSpec("tests.integration.reward_fns:starts_a_process_then_crashes", 1.0, {})]
    pool = WorkerPool(1, spec, tok, {}, 30)
    try:
        deadline = time.monotonic() + 120
        while not pool.idle():
            pool.collect()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        assert pool.submit(pool.idle()[0], items([4]))
        got: list[Any] = []
        while not got:
            got = pool.collect()
            assert time.monotonic() < deadline, "the crash was not seen"
            time.sleep(0.05)
        assert str(got[0][1]).startswith("crash: worker exited with code -9"), got
        time.sleep(0.5)
        assert not orphans(), "the sleep the crashed worker's function started still runs"
    finally:
        pool.close()
        for p in orphans():
            p.kill()
