"""The reward service as real processes against a real hub fed by simulated generators: user
functions by import path, parallel services and workers, functions that raise, return NaN or
hang, and the reward-model server."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from flywheel.hub_client import BatchClient, RolloutGroup
from flywheel.procs import Service, wait_for_state_file
from flywheel.staleness import StalenessPolicy
from flywheel.tiny import build_reward_model
from tests.conftest import ROOT, Cluster, wait_until

FNS = "tests.integration.reward_fns"


HUB = ("--data.n_samples_per_prompt", "4", "--async.groups_per_step", "4", "--hub.score_timeout_s", "60")


def start_hub_and_generator(cluster: Cluster, *overrides: str) -> None:
    cluster.start_hub(*HUB, *overrides)  # a score_timeout_s that long: a lost score would show as a resend
    cluster.start_simgen("sim0", "--min-len", "4", "--max-len", "40", "--capacity", "4")


def settle(cluster: Cluster, timeout_s: float = 60) -> dict[str, float]:
    """Wait until every completed sample has been answered; return the hub's metrics."""

    def done() -> dict[str, float] | None:
        m = cluster.metrics()
        done = m["flywheel_hub_samples_completed_total"] > 0 and m["flywheel_hub_scores_pending"] == 0
        return m if done else None

    return wait_until(done, timeout_s, "every completed sample scored", poll_s=0.2)


def claim_all(cluster: Cluster) -> list[RolloutGroup]:
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(100, 1))
    n = client.redis.zcard(client.keys.ready)
    return client.claim(n, 0, timeout_s=5).groups if n else []


def test_parallel_services_and_workers_score_every_sample_exactly_once(cluster: Cluster) -> None:
    cluster.start_hub(*HUB, "--async.max_staleness", "12", "--data.epochs", "1")
    for _ in range(2):
        cluster.start_reward("--reward.functions", f"{FNS}:parity", "--reward.workers", "2", "--reward.batch_size", "4")
    wait_until(lambda: cluster.metrics()["flywheel_hub_reward_workers"] == 2, 60, "both services registered")
    time.sleep(1)  # their second workers too
    for i in range(2):
        cluster.start_simgen(f"sim{i}", "--min-len", "4", "--max-len", "40", "--capacity", "4", "--seed", str(i))
    # 52 groups of 4 (the staleness bound at version 0) ... then generation stops
    wait_until(lambda: cluster.metrics()["flywheel_hub_groups_ready_total"] >= 52, 120, "52 groups ready", poll_s=0.3)
    m = settle(cluster)
    assert m["flywheel_hub_scores_in_total"] == m["flywheel_hub_samples_completed_total"] == 52 * 4
    assert m.get('flywheel_hub_rejected_total{reason="unexpected_score"}', 0) == 0  # nothing scored twice
    assert m["flywheel_hub_score_resends_total"] == 0  # nothing lost and re-sent
    assert m["flywheel_hub_reward_workers"] == 2
    groups = claim_all(cluster)
    assert len(groups) == 52
    pids = set()
    for g in groups:
        for s in g.samples:
            assert s.reward_error is None and s.reward == float(len(s.tokens) % 2 == 0)
            pids.add(s.reward_breakdown[f"{FNS}:parity/pid"])
    assert len(pids) >= 3, f"work spread over the 4 worker processes of 2 services, got {len(pids)}"


def test_reward_functions_get_the_prompt_as_the_dataset_gave_it_not_its_chat_template(cluster: Cluster) -> None:
    # the tokens decoded would be "user: What is ...\nassistant:" (the template's <s> cut out),
    # which a reward model with a chat template of its own would wrap a second time
    start_hub_and_generator(cluster, "--data.apply_chat_template", "true", "--data.metadata_keys", "[prompt, answer]")
    cluster.start_reward("--reward.functions", f"{FNS}:prompt_is_the_question")
    wait_until(lambda: cluster.metrics()["flywheel_hub_groups_ready_total"] >= 2, 60, "2 groups ready")
    samples = [s for g in claim_all(cluster) for s in g.samples]
    assert samples
    assert all(s.reward_error is None and s.reward == 1.0 for s in samples), [s.reward_breakdown for s in samples]


def test_raising_and_nan_rewards_are_errors_with_the_fixed_reward(cluster: Cluster) -> None:
    start_hub_and_generator(cluster, "--reward.on_error", "assign", "--reward.error_reward", "-1")
    cluster.start_reward(
        "--reward.functions",
        f"[{FNS}:raises_on_some, {FNS}:nan_on_some]",
        "--reward.on_error",
        "assign",
        "--reward.error_reward",
        "-1",
    )
    wait_until(lambda: cluster.metrics()["flywheel_hub_groups_ready_total"] >= 4, 60, "4 groups ready")
    m = settle(cluster)
    assert m["flywheel_hub_scores_in_total"] == m["flywheel_hub_samples_completed_total"]
    assert m['flywheel_hub_reward_errors_total{reason="exception"}'] >= 1
    samples = [s for g in claim_all(cluster) for s in g.samples]
    for s in samples:
        culprit = len(s.tokens) % 5 == 0
        assert (s.reward_error is not None) == culprit
        assert s.reward == (-1.0 if culprit else 2.0)
        if culprit:
            assert s.reward_error.startswith("exception: ") and "breaks the reward" in s.reward_error
    assert any(len(s.tokens) % 5 == 0 for s in samples), "no culprit sample: nothing was tested"


def hung_children() -> list[int]:
    import psutil

    from tests.integration.reward_fns import HUNG_CHILD_MARKER

    return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", HUNG_CHILD_MARKER]]


def test_a_hanging_function_is_killed_and_only_its_groups_are_dropped(cluster: Cluster) -> None:
    start_hub_and_generator(cluster, "--async.max_staleness", "1")
    reward = cluster.start_reward(
        "--reward.functions",
        f"{FNS}:hangs_on_some",
        "--reward.workers",
        "2",
        "--reward.batch_size",
        "8",
        "--reward.timeout_s",
        "2",
    )

    def progress() -> bool:
        m = cluster.metrics()
        return m["flywheel_hub_groups_ready_total"] >= 4 and m["flywheel_hub_groups_dropped_reward_total"] >= 2

    wait_until(progress, 120, "4 groups ready and 2 dropped for a hung reward", poll_s=0.3)
    cluster.services[1].stop()  # the generator: what it finished must now all be answered
    m = settle(cluster, timeout_s=60)
    # the process each hung call started went with its killed worker (it outlived it, and the
    # run). Looked for once every sample is answered: while samples came, a worker could be hung
    # at any moment, its child alive until the worker's deadline
    wait_until(lambda: not hung_children(), 10, "no child of a killed worker left running")
    assert m["flywheel_hub_scores_in_total"] == m["flywheel_hub_samples_completed_total"]
    assert m['flywheel_hub_reward_errors_total{reason="timeout"}'] >= 2
    assert m.get('flywheel_hub_reward_errors_total{reason="exception"}', 0) == 0
    dropped, ready = m["flywheel_hub_groups_dropped_reward_total"], m["flywheel_hub_groups_ready_total"]
    # a dropped group frees its place under the staleness bound: nothing is stuck or lost
    assert ready + dropped + m["flywheel_hub_open_groups"] == m["flywheel_hub_groups_issued_total"]
    groups = claim_all(cluster)
    assert len(groups) == ready
    assert all(s.reward_error is None and s.reward == 1.0 for g in groups for s in g.samples)
    assert reward.alive() and "restarting it" in reward.log_path.read_text()


def test_a_request_sent_again_while_the_service_holds_it_is_scored_once(cluster: Cluster) -> None:
    # The hub sends a request again when it had no answer within score_timeout_s; here every
    # request waits longer than that in the service's queue (one slow worker, batches of 2).
    cluster.start_hub(*HUB[:4], "--hub.score_timeout_s", "0.5", "--async.max_staleness", "1")
    cluster.start_simgen("sim0", "--min-len", "4", "--max-len", "40", "--capacity", "4")
    reward = cluster.start_reward(
        "--reward.functions", f"{FNS}:slow_batches", "--reward.workers", "1", "--reward.batch_size", "2"
    )
    wait_until(lambda: cluster.metrics()["flywheel_hub_groups_ready_total"] >= 8, 120, "8 groups ready", poll_s=0.3)
    cluster.services[1].stop()  # the generator
    m = settle(cluster, timeout_s=90)
    assert m["flywheel_hub_score_resends_total"] > 0, "nothing was sent again: the test tested nothing"
    assert m["flywheel_hub_scores_in_total"] == m["flywheel_hub_samples_completed_total"]
    assert m.get('flywheel_hub_rejected_total{reason="unexpected_score"}', 0) == 0  # no copy was scored
    reward.stop()
    log = reward.log_path.read_text()
    scored = re.findall(r"scored (\d+) \|", log)
    assert scored and int(scored[-1]) == m["flywheel_hub_samples_completed_total"], (m, reward.tail(20))


def test_late_and_repeated_answers_to_re_sent_requests_are_taken_once(cluster: Cluster) -> None:
    """A service answering the first send after the hub has sent the request again (both copies
    are then answered: the re-send crossed the answer on the wire) is no fault: the first answer
    is the sample's score, the second is counted as a duplicate, and nothing is called
    unexpected. Here a hand-driven worker holds every request until it has seen it twice."""
    import zmq

    from flywheel.wire import Decoder, RewardRegister, Score, ScoreBatch, ScoreRequest, encode

    cluster.start_hub(*HUB[:4], "--hub.score_timeout_s", "0.3", "--async.max_staleness", "1")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.reward_address)
    decoder = Decoder(ScoreRequest)
    seen: dict[tuple[int, int], int] = {}
    answered: set[tuple[int, int]] = set()
    gen = None
    try:
        deadline, last_hello = time.monotonic() + 120, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - last_hello > 0.5:
                last_hello = time.monotonic()
                sock.send(encode(RewardRegister(worker_id="hand", capacity=64)))
            if gen is None and cluster.metrics()["flywheel_hub_reward_workers"] == 1:
                gen = cluster.start_simgen("sim0", "--min-len", "4", "--max-len", "40", "--capacity", "4")
            if sock.poll(100):
                req = decoder.decode(sock.recv())
                assert isinstance(req, ScoreRequest)
                key = (req.group_id, req.sample)
                seen[key] = seen.get(key, 0) + 1
            twice = [k for k, n in seen.items() if n >= 2 and k not in answered]
            if twice:
                scores = [Score(worker_id="hand", group_id=g, sample=i, reward=1.0) for g, i in twice]
                sock.send(encode(ScoreBatch(worker_id="hand", scores=scores)))  # the late answer
                sock.send(encode(ScoreBatch(worker_id="hand", scores=scores)))  # and the re-send's
                answered.update(twice)
            if len(answered) >= 16:
                break
        assert len(answered) >= 16, f"only {len(answered)} samples seen twice: {seen}"
        assert gen is not None
        gen.stop()
        m = wait_until(
            lambda: (m := cluster.metrics())["flywheel_hub_scores_in_total"] >= len(answered) and m,
            30,
            "the answers taken",
        )
        assert m.get('flywheel_hub_rejected_total{reason="unexpected_score"}', 0) == 0, m
        assert m["flywheel_hub_scores_in_total"] == len(answered)
        assert m['flywheel_hub_rejected_total{reason="duplicate_score"}'] == len(answered)
    finally:
        sock.close()


def test_a_score_the_hub_refuses_fails_its_sample_not_the_frame_it_came_in(cluster: Cluster) -> None:
    """One score in a ScoreBatch that fails its check (a breakdown name past the limit) made the
    hub refuse the whole frame: every score in it came again only after score_timeout_s, and the
    culprit was refused at each re-send, its group never ready. Now the others are taken at once
    and the culprit fails its sample's reward (reward.on_error drop_group: its group is dropped)."""
    import zmq

    from flywheel.wire import Decoder, RewardRegister, Score, ScoreBatch, ScoreRequest, encode

    cluster.start_hub(*HUB, "--async.max_staleness", "1")  # score_timeout_s 60: a re-send would show
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.reward_address)
    decoder = Decoder(ScoreRequest)
    pending: list[tuple[int, int]] = []
    answered: list[tuple[int, int]] = []
    culprit: tuple[int, int] | None = None
    gen = None
    try:
        deadline, last_hello = time.monotonic() + 120, 0.0
        while time.monotonic() < deadline and len(answered) < 16:
            if time.monotonic() - last_hello > 0.5:
                last_hello = time.monotonic()
                sock.send(encode(RewardRegister(worker_id="hand", capacity=64)))
            if gen is None and cluster.metrics()["flywheel_hub_reward_workers"] == 1:
                gen = cluster.start_simgen("sim0", "--min-len", "4", "--max-len", "40", "--capacity", "4")
            while sock.poll(100):
                req = decoder.decode(sock.recv())
                assert isinstance(req, ScoreRequest)
                pending.append((req.group_id, req.sample))
            if len(pending) >= 2:
                scores = [Score(worker_id="hand", group_id=g, sample=i, reward=1.0) for g, i in pending]
                if culprit is None:
                    culprit = pending[0]
                    scores[0] = Score(worker_id="hand", group_id=culprit[0], sample=culprit[1], reward=1.0,
                                      breakdown={"x" * 300: 1.0})  # fmt: skip
                sock.send(encode(ScoreBatch(worker_id="hand", scores=scores)))
                answered += pending
                pending = []
        assert culprit is not None and len(answered) >= 16, answered
        assert gen is not None
        gen.stop()
        m = wait_until(
            lambda: (m := cluster.metrics())["flywheel_hub_scores_in_total"] >= len(answered) and m,
            30,
            "every answer taken, the refused one as a failed reward",
        )
        assert m["flywheel_hub_scores_in_total"] == len(answered)
        assert m['flywheel_hub_rejected_total{reason="invalid_field"}'] == 1
        assert m['flywheel_hub_reward_errors_total{reason="bad_score"}'] == 1
        assert m["flywheel_hub_score_resends_total"] == 0
        assert m["flywheel_hub_groups_dropped_reward_total"] == 1
        served = {(g.group_id, i) for g in claim_all(cluster) for i in range(len(g.samples))}
        assert culprit[0] not in {g for g, _ in served}
        assert "breakdown" in cluster.hub.log_path.read_text()  # the rejection names the field
    finally:
        sock.close()


def test_a_request_sent_again_after_its_answer_is_answered_again_not_scored_again(tmp_path: Path) -> None:
    """The hub's re-send can arrive just after the service answered (or the answer was lost on
    the way): the service sends its answer again rather than scoring the sample a second time.
    A different request under the same (group, sample) is scored afresh."""
    import zmq

    from flywheel.config import RewardConfig
    from flywheel.redis_server import free_port
    from flywheel.tiny import build_tokenizer
    from flywheel.wire import Decoder, RewardRegister, Score, ScoreBatch, ScoreRequest, ToHub, encode, pack_i32
    from reward_service.pool import WorkerPool
    from reward_service.scoring import FunctionSpec
    from reward_service.service import RewardService

    port = free_port()
    hub = zmq.Context.instance().socket(zmq.ROUTER)
    hub.setsockopt(zmq.LINGER, 0)
    hub.bind(f"tcp://127.0.0.1:{port}")
    # the length reward, slow on long responses: the superseded request is surely still held
    spec = [FunctionSpec("tests.integration.reward_fns:length_slow_when_long", 1.0, {})]
    pool = WorkerPool(1, spec, str(build_tokenizer(tmp_path / "tok")), {"max_tokens": 16}, timeout_s=30)
    service = RewardService(RewardConfig(hub_address=f"tcp://127.0.0.1:{port}"), "svc", pool)
    loop = threading.Thread(target=service.run, kwargs={"max_seconds": 180}, daemon=True)
    loop.start()
    decoder = Decoder(ToHub)

    def receive() -> object:
        return decoder.decode(hub.recv_multipart()[1]) if hub.poll(200) else None

    def answer() -> Score:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = receive()
            if isinstance(msg, ScoreBatch):
                (msg,) = msg.scores
            if isinstance(msg, Score):
                return msg
        raise AssertionError("no answer within 120s")

    def request(response: list[int]) -> None:
        req = ScoreRequest(
            group_id=3,
            sample=1,
            prompt_tokens=pack_i32([1, 2]),
            response_tokens=pack_i32(response),
            finish_reason="stop",
        )
        hub.send_multipart([b"svc", encode(req)])

    try:
        wait_until(lambda: isinstance(receive(), RewardRegister), 120, "the service registered")
        request([3, 4, 5])
        first = answer()
        request([3, 4, 5])  # the re-send, after the answer
        again = answer()
        assert (again.group_id, again.sample, again.reward) == (first.group_id, first.sample, first.reward)
        assert service.scored == 1 and service.answered_again == 1
        request([3])
        assert answer().reward != first.reward  # scored afresh: not the remembered answer
        assert service.scored == 2
        # A new request under a key still being scored (a restarted hub's, a new run's): it
        # supersedes that one, whose answer is not sent. (It was dropped as a re-send, and the
        # old response's reward went back for it.)
        request([3, 4, 5, 6, 7, 8, 9, 10])
        request([3, 4])
        latest = answer()
        assert latest.reward == pytest.approx(2 / 16), latest  # the length reward of the newer response
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # and no second answer, however late
            assert not isinstance(receive(), (Score, ScoreBatch))
        assert service.superseded == 1
    finally:
        service.stop()
        loop.join(timeout=30)
        service.close()
        hub.close()


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm"))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def test_reward_model_server_batches_and_serves_the_reward_service(cluster: Cluster, reward_model_dir: Path) -> None:
    state = cluster.tmp / "rm.json"
    rm = Service(
        "rm",
        "reward_service.rm_server",
        [
            "--rm.model",
            str(reward_model_dir),
            "--rm.port",
            "0",
            "--rm.state_file",
            str(state),
            "--rm.batch_wait_ms",
            "300",
        ],
        cluster.tmp,
        env={"PYTHONPATH": str(ROOT)},
    )
    cluster.services.append(rm)
    url = f"http://127.0.0.1:{wait_for_state_file(state, rm, timeout_s=90)['port']}"

    # a padded batch scores each text as it would alone
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = ["What is 3 + 5? Answer:", "What is 1 + 1? Answer:", "What is 9 + 9? Answer:"]
    completions = [" 8", " 2. Let me think step by step: 1 + 1 = 2.", " 17"]
    got = post(f"{url}/score", {"prompts": prompts, "completions": completions})["rewards"]
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.inference_mode():
        want = [
            model(**tok(p + c, return_tensors="pt")).logits[0, 0].item()
            for p, c in zip(prompts, completions, strict=True)
        ]
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(got)) == 3

    # concurrent requests share forward passes
    before = json.loads(urllib.request.urlopen(f"{url}/health", timeout=5).read())
    threads = [
        threading.Thread(target=post, args=(f"{url}/score", {"prompts": prompts, "completions": completions}))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    after = json.loads(urllib.request.urlopen(f"{url}/health", timeout=5).read())
    assert after["sequences"] - before["sequences"] == 12
    assert after["forwards"] - before["forwards"] < 4
    with pytest.raises(urllib.error.HTTPError, match="400"):
        post(f"{url}/score", {"prompts": ["a"], "completions": [1]})

    # the reward service scores through it (the remote protocol)
    start_hub_and_generator(cluster)
    cluster.start_reward("--reward.functions", f"[{{name: reward_model, kwargs: {{url: {url}/score}}}}]")
    wait_until(lambda: cluster.metrics()["flywheel_hub_groups_ready_total"] >= 2, 60, "2 groups ready")
    samples = [s for g in claim_all(cluster) for s in g.samples]
    assert samples and all(s.reward_error is None and "reward_model" in s.reward_breakdown for s in samples)
    assert len({s.reward for s in samples}) > 1


def test_a_worker_killed_while_idle_costs_no_sample_its_error() -> None:
    """A worker killed between batches (the OOM killer): the batch meant for it goes to its
    replacement, scored as if nothing happened, and the service keeps running."""
    import os
    import signal

    from flywheel.config import RewardConfig
    from flywheel.redis_server import free_port
    from flywheel.wire import pack_i32
    from reward_service.pool import WorkerPool
    from reward_service.scoring import FunctionSpec, Item
    from reward_service.service import RewardService

    pool = WorkerPool(1, [FunctionSpec("length", 1.0, {})], None, {"max_tokens": 16}, timeout_s=10)
    service = RewardService(RewardConfig(hub_address=f"tcp://127.0.0.1:{free_port()}"), "svc", pool)
    try:
        wait_until(lambda: pool.collect() == [] and pool.ready_count() == 1, 120, "the worker ready")
        worker = pool.workers[0]
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(timeout=10)
        item = Item((7, 0), pack_i32([1, 2]), pack_i32([3, 4, 5]), "stop", {})
        service.held[(7, 0)] = item.fingerprint
        service.queue.append(item)
        service._dispatch()  # the send to the dead worker fails: the item stays queued
        assert len(service.queue) == 1 and pool.busy_count() == 0

        def scored() -> bool:
            for items, result in pool.collect():
                service._answer(items, result)
            service._dispatch()
            return service.scored == 1

        wait_until(scored, 120, "the sample scored by the replacement worker")
        assert pool.restarts == 1 and not service.errors and not service.held
    finally:
        service.close()


def test_a_replacement_worker_that_fails_to_start_is_started_again_not_the_services_end(tmp_path: Path) -> None:
    """A worker killed (the OOM killer), and its replacement failing to start while the cause
    lasts (here its tokenizer is away for a moment): the pool raised, and the whole service
    exited. A replacement is now started again, up to REPLACEMENT_STARTS times in a row; a first
    start that fails still fails the pool, at once (the config is wrong)."""
    import os
    import shutil
    import signal

    from flywheel.tiny import build_tokenizer
    from reward_service.pool import PoolError, WorkerPool
    from reward_service.scoring import FunctionSpec

    tok = build_tokenizer(tmp_path / "tok")
    spec = [FunctionSpec("tests.integration.reward_fns:parity", 1.0, {})]  # reads text: loads the tokenizer
    with pytest.raises(PoolError, match="failed to start"):
        broken = WorkerPool(1, spec, str(tmp_path / "nowhere"), {"max_tokens": 16}, timeout_s=10)
        try:
            wait_until(lambda: broken.collect() == [] and False, 60, "the first start's failure")
        finally:
            broken.close()
    pool = WorkerPool(1, spec, str(tok), {"max_tokens": 16}, timeout_s=10)
    try:
        wait_until(lambda: pool.collect() == [] and pool.ready_count() == 1, 120, "the worker ready")
        shutil.move(tok, tmp_path / "away")
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
        pool.workers[0].proc.join(timeout=10)
        wait_until(lambda: pool.collect() == [] and pool.restarts >= 2, 120, "a replacement that failed to start")
        shutil.move(tmp_path / "away", tok)
        wait_until(lambda: pool.collect() == [] and pool.ready_count() == 1, 120, "a replacement ready")
        assert pool.workers[0].failed_starts == 0
    finally:
        pool.close()


def test_the_service_never_blocks_on_a_hub_that_is_away() -> None:
    """With the hub away, the socket's queue fills (a heartbeat a second: about 17 minutes); a
    blocking send would then stop the loop. What cannot be queued is dropped and counted."""
    from flywheel.config import RewardConfig
    from flywheel.redis_server import free_port
    from reward_service.pool import WorkerPool
    from reward_service.service import RewardService

    pool = WorkerPool(0, [], None, {}, timeout_s=10)
    service = RewardService(RewardConfig(hub_address=f"tcp://127.0.0.1:{free_port()}"), "svc", pool)
    try:
        started = time.monotonic()
        for _ in range(3000):  # ZMQ's default send high-water mark is 1000 messages
            service._send(b"x" * 100)
        assert time.monotonic() - started < 10 and service.unsent >= 1000
    finally:
        service.close()


def test_rewards_that_fail_on_every_group_are_said_loudly(cluster: Cluster) -> None:
    """A reward configuration that cannot score the data (here: `arithmetic` with the answers left
    out of data.metadata_keys) dropped every group with a warning each: the run spent its prompts
    and ended having trained nothing. The hub now says, once and as an error, that no group has
    survived its rewards, with the first error and what to check."""
    start_hub_and_generator(
        cluster, "--async.max_staleness", "16", "--data.metadata_keys", "[]", "--async.max_requeues", "1"
    )
    cluster.start_reward("--reward.functions", "arithmetic")
    wait_until(
        lambda: cluster.metrics()["flywheel_hub_groups_dropped_reward_total"] >= 9,
        120,
        "groups dropped for failed rewards",
        poll_s=0.3,
    )
    # each dropped group's prompt is issued again (a failed reward service would spend it), up
    # to async.max_requeues times: these always fail, and are then skipped
    wait_until(lambda: cluster.metrics()["flywheel_hub_prompts_abandoned_total"] >= 1, 60, "a prompt abandoned")
    log = cluster.hub.log_path.read_text()
    assert "dropped for failed rewards 2 times: skipped (async.max_requeues 1)" in log
    assert "every group scored so far (8) failed its rewards, first error: exception: arithmetic: ValueError" in log
    assert "metadata has no 'answer'" in log and "check reward.functions" in log
    assert log.count("every group scored so far") == 1  # said once


def test_what_reward_functions_started_goes_with_a_killed_service(cluster: Cluster) -> None:
    """The launcher kills a service that did not stop in time with its process group; the reward
    service's workers lead groups of their own, and a process a reward function starts in a
    session of its own (a sandbox) is in neither. The workers died with the service (they ask
    for it), what they had started ran on. The launcher now kills everything below the service."""
    import psutil

    from tests.integration.reward_fns import SESSION_MARKER

    def sleepers() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", SESSION_MARKER]]

    start_hub_and_generator(cluster)
    svc = cluster.start_reward("--reward.functions", f"{FNS}:starts_a_session_sleeper")
    try:
        wait_until(lambda: len(sleepers()) == 1, 120, "the reward function's sleeper started")
        svc.kill9()
        wait_until(lambda: not sleepers(), 10, "the sleeper gone with the service")
    finally:
        for p in sleepers():
            p.kill()
