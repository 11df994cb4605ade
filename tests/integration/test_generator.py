"""The vLLM generator service against a real hub, a real reward worker and the learner's real
weight broadcaster: log-probabilities, in-flight weight updates, crashes and bad syncs."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import msgspec
import numpy as np
import pytest
import redis
import torch

from flywheel.config import SyncConfig
from flywheel.hub_client import Batch, BatchClient, RolloutSample
from flywheel.redis_server import free_port
from flywheel.staleness import StalenessPolicy
from flywheel.store import RunKeys
from flywheel.weights import host_store
from flywheel.wire import BucketLayout, WeightsReady, encode
from learner.weight_sync import WeightBroadcaster
from tests.conftest import ENGINE_START_S, Cluster, wait_started, wait_until
from tests.integration.greedy import assert_greedy, teacher_forced

STALENESS = 100  # these tests drive versions by hand; admission must not get in the way


@pytest.fixture
def broadcaster() -> Iterator[WeightBroadcaster]:
    wb = WeightBroadcaster(SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=20))
    yield wb
    wb.close()


def sync_ports(wb: WeightBroadcaster) -> tuple[int, int]:
    return wb.cfg.announce_port, wb.cfg.join_port


def start_hub(cluster: Cluster, *overrides: str) -> None:
    cluster.start_hub(
        "--async.max_staleness",
        str(STALENESS),
        "--async.groups_per_step",
        "2",
        "--data.n_samples_per_prompt",
        "2",
        *overrides,
    )
    cluster.start_reward()


def client(cluster: Cluster) -> BatchClient:
    return BatchClient(redis.Redis.from_url(cluster.redis.url), "flywheel", StalenessPolicy(STALENESS, 2))


def claim(c: BatchClient, n: int, timeout_s: float = 120.0) -> Batch:
    return c.claim(n, c.get_version(), timeout_s=timeout_s)


def hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A different policy: every weight moved by noise (what a few optimizer steps would do)."""
    import copy

    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
    return new


def tokens_in_flight(cluster: Cluster) -> bool:
    r = redis.Redis.from_url(cluster.redis.url)
    return any(
        k.startswith(b"c:")
        for gid in r.smembers(RunKeys("flywheel").open)
        for k in r.hkeys(RunKeys("flywheel").group(int(gid)))
    )


def test_streamed_logprobs_match_a_hf_forward_pass(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster
) -> None:
    start_hub(cluster, "--rollout.max_tokens", "24", "--rollout.temperature", "0.8")
    wait_started(cluster.start_generator("g0", checkpoint_dir, sync_ports(broadcaster)), broadcaster)
    batch = claim(client(cluster), 4)
    model = hf(checkpoint_dir)
    n_tokens = 0
    for group in batch.groups:
        for s in group.samples:
            assert len(s.tokens) > 0 and (s.versions == 0).all()
            assert s.finish_reason in ("stop", "length")
            logits = teacher_forced(model, group.prompt_tokens, s.tokens)
            expected = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(s.tokens, dtype=torch.long)[:, None])
            np.testing.assert_allclose(s.logprobs, expected[:, 0].numpy(), atol=2e-3)
            n_tokens += len(s.tokens)
    assert n_tokens >= 8 * 2


def check_versions_and_tokens(sample: RolloutSample, prompt: np.ndarray, models: dict[int, torch.nn.Module]) -> None:
    """Greedy tokens must be the argmax, up to a tie, of the policy version each one is labelled with."""
    assert (np.diff(sample.versions) >= 0).all(), f"versions go backwards: {sample.versions}"
    for version, model in models.items():
        mask = sample.versions == version
        if mask.any():
            assert_greedy(teacher_forced(model, prompt, sample.tokens), sample.tokens, mask, f"v{version}")


@pytest.mark.parametrize("policy", ["keep", "interrupt"])
def test_update_mid_generation_switches_versions_inside_a_sample(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster, policy: str
) -> None:
    # samples of up to 400 tokens: long enough to be mid-way when the sync lands, which takes
    # seconds when the machine is busy (at 200, a CI run once saw the first wave end before it)
    start_hub(cluster, "--rollout.max_tokens", "400", "--rollout.temperature", "0")
    gen = cluster.start_generator("g0", checkpoint_dir, sync_ports(broadcaster), "--async.partial_rollout", policy)
    wait_started(gen, broadcaster)
    v0 = hf(checkpoint_dir)
    v1 = perturbed(v0, seed=1)
    # Only then look for samples in flight, and sync at once: built after the check, v1 came too
    # late on a fast machine (the first wave of samples had finished, none spanned the update).
    wait_until(lambda: tokens_in_flight(cluster), 60, "tokens streaming into the hub")
    report = broadcaster.sync(1, v1.state_dict().items())
    assert report.acked == ["g0"], report
    c = client(cluster)
    c.set_version(1)
    mixed = only_new = 0
    deadline = time.monotonic() + 180
    while (mixed == 0 or only_new == 0) and time.monotonic() < deadline:
        batch = claim(c, 1)
        for group in batch.groups:
            for s in group.samples:
                check_versions_and_tokens(s, group.prompt_tokens, {0: v0, 1: v1})
                mixed += int(s.versions[0] == 0 and s.versions[-1] == 1)
                only_new += int(s.versions[0] == 1)
    assert mixed > 0, "no sample spanned the update"
    assert only_new > 0, "no sample was generated entirely by the new weights"


def test_killed_generator_lease_is_reissued_and_completed_by_another(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster
) -> None:
    start_hub(cluster, "--rollout.max_tokens", "300", "--hub.generator_timeout_s", "3", "--hub.lease_timeout_s", "30")
    doomed = cluster.start_generator("doomed", checkpoint_dir, sync_ports(broadcaster), "--generator.capacity", "64")
    wait_until(lambda: tokens_in_flight(cluster), ENGINE_START_S, "the first generator streaming")
    doomed.kill9()
    c = client(cluster)
    held = c.counters()["groups_issued"]  # the only generator held every group issued so far
    cluster.start_generator("rescuer", checkpoint_dir, sync_ports(broadcaster))
    batch = claim(c, 4, timeout_s=ENGINE_START_S + 60)  # the rescuer's engine starts first
    assert all(g.group_id < held for g in batch.groups), "completed groups should be the dead one's, re-issued"
    counters = c.counters()
    assert counters.get("leases_reissued", 0) >= 1, counters
    for group in batch.groups:
        for s in group.samples:
            assert s.finish_reason in ("stop", "length") and len(s.tokens) > 0


def test_bad_syncs_late_weights_and_drain(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster
) -> None:
    """Garbage and a broadcast that never comes cost a generator nothing; weights too old for
    the staleness bound get it no lease until a sync; SIGTERM drains it."""
    cluster.start_hub("--async.max_staleness", "0", "--async.groups_per_step", "2", "--rollout.max_tokens", "16")
    cluster.start_reward()
    gen = cluster.start_generator("g0", checkpoint_dir, sync_ports(broadcaster))
    wait_started(gen, broadcaster)
    # 1. garbage and a malformed WeightsReady on the announce socket: rejected, nothing else happens
    broadcaster.pub.send(b"\x00garbage")
    bad = msgspec.msgpack.decode(encode(_ready(1, 1234, deadline=time.time() + 30)))
    bad["world_size"] = -3
    broadcaster.pub.send(msgspec.msgpack.encode(bad))
    # 2. a valid announcement whose broadcast never comes: the generator gives up at the deadline
    store = host_store("127.0.0.1", 30)
    started = time.monotonic()
    broadcaster.pub.send(encode(_ready(1, store.port, deadline=time.time() + 3)))
    ack = wait_for_ack(broadcaster, "g0", timeout_s=30)
    assert ack.error is not None and ack.version == 1, ack
    assert time.monotonic() - started < 3 + 10, "the generator waited far past the deadline"
    assert gen.alive()
    # 3. the learner moves to v2 with eta = 0: weights v0 are too old, so no new lease until a sync
    c = BatchClient(redis.Redis.from_url(cluster.redis.url), "flywheel", StalenessPolicy(0, 2))
    c.set_version(2)
    issued = c.counters().get("groups_issued", 0)
    time.sleep(2.0)
    assert c.counters().get("groups_issued", 0) == issued, "a generator with stale weights got new work"
    model = perturbed(hf(checkpoint_dir), seed=2)
    assert broadcaster.wait_for_members(1, timeout_s=30)
    # ... and the sync comes from a learner whose clock is 1000 s behind the generator's host:
    # timed on the generator's own clock from its receipt, it is taken all the same (compared
    # with the learner's deadline, it had passed 940 s before it was sent)
    real_time = time.time
    with mock.patch("time.time", lambda: real_time() - 1000.0):
        report = broadcaster.sync(2, model.state_dict().items())
    assert report.acked == ["g0"], report
    batch = c.claim(2, 2, timeout_s=120)
    for group in batch.groups:
        for s in group.samples:
            assert (s.versions == 2).all(), s.versions
    # 4. weights vLLM's own loader refuses (a name it does not know, sent first): the error is
    # acked, and the engine, whose layers that loader had moved to the meta device, still works
    bogus = {"model.layers.0.bogus.weight": torch.zeros(4), **model.state_dict()}
    assert broadcaster.wait_for_members(1, timeout_s=30)
    broadcaster.cfg.bucket_mb = 1 / 16  # many buckets: the loader fails on the first of them
    report = broadcaster.sync(3, bogus.items())
    broadcaster.cfg.bucket_mb = 256.0
    assert report.acked == [] and "bogus" in report.evicted.get("g0", ""), report
    # ...and the generator took the rest of the broadcast all the same: a rank that stopped would
    # fail the sync of every other generator in the group
    assert report.broadcast_s > 0, report
    assert broadcaster.wait_for_members(1, timeout_s=30)
    report = broadcaster.sync(4, perturbed(hf(checkpoint_dir), seed=3).state_dict().items())
    assert report.acked == ["g0"], report
    c.set_version(4)
    batch = c.claim(2, 4, timeout_s=120)
    versions = [s.versions.tolist() for group in batch.groups for s in group.samples]
    assert all(set(v) == {4} for v in versions), versions
    assert "rejected malformed from 'announce'" in gen.log_path.read_text()
    assert "RotaryEmbedding: Failed to load weights" not in gen.log_path.read_text()  # vLLM's noise at every sync
    # 5. SIGTERM: it stops taking leases, finishes or returns what it holds, and exits cleanly
    gen.proc.send_signal(signal.SIGTERM)
    assert gen.proc.wait(timeout=60) == 0
    assert "draining" in gen.log_path.read_text()
    assert "AsyncLLM.__del__" not in gen.log_path.read_text(), "vLLM's second shutdown, at interpreter exit"


def test_a_prompt_vllm_refuses_ends_its_samples_and_a_sync_that_never_came_keeps_the_leases(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster, tmp_path: Path
) -> None:
    """A prompt with a token id outside the model's vocabulary (a data.tokenizer with tokens
    added) made vLLM raise, which failed the generator, and then each generator the hub
    re-issued the lease to. Now its samples end as abort, scored, and the generator goes on.
    A sync that failed before touching the weights gave every lease back, to be leased straight
    back to this same generator and generated again from the start: now they go on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint_dir)
    extra = [f"<added_{i}>" for i in range(512 - len(tok))] + ["<not_in_the_model>"]
    tok.add_tokens(extra)  # the last one's id is past the model's 512 embeddings
    assert tok.convert_tokens_to_ids("<not_in_the_model>") == 512
    tok.save_pretrained(tmp_path / "tokenizer")
    rows = [{"prompt": f"What is {a} + 1? Answer:"} for a in range(6)]
    rows.insert(1, {"prompt": "What is <not_in_the_model> + 1? Answer:"})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    start_hub(
        cluster,
        "--data.path", str(tmp_path / "prompts.jsonl"), "--data.tokenizer", str(tmp_path / "tokenizer"),
        "--data.shuffle", "false", "--data.epochs", "100", "--rollout.max_tokens", "300",
    )  # fmt: skip
    gen = cluster.start_generator("g0", checkpoint_dir, sync_ports(broadcaster), "--generator.capacity", "2")
    wait_until(lambda: "engine_refused_request" in gen.log_path.read_text(), ENGINE_START_S, "the refused prompt")
    assert "out of vocabulary" in gen.log_path.read_text()
    wait_until(lambda: tokens_in_flight(cluster), 60, "the next leases streaming")
    store = host_store("127.0.0.1", 30)
    broadcaster.pub.send(encode(_ready(1, store.port, deadline=time.time() + 2)))
    ack = wait_for_ack(broadcaster, "g0", timeout_s=30)
    assert ack.error is not None
    c = client(cluster)
    served = [g for _ in range(3) for g in claim(c, 2).groups]
    refused = [g for g in served if g.prompt_index == 1]
    assert refused and all(s.finish_reason == "abort" and len(s.tokens) == 0 for s in refused[0].samples)
    assert gen.alive()
    hub_log = cluster.hub.log_path.read_text()
    assert "generator g0 released" not in hub_log, "an untouched failed sync gave its leases back"
    assert c.counters().get("leases_reissued", 0) == 0


def _ready(version: int, port: int, deadline: float) -> WeightsReady:
    return WeightsReady(
        version=version,
        buckets=[BucketLayout(names=["lm_head.weight"], shapes=[[512, 128]], dtypes=["float32"], nbytes=512 * 128 * 4)],
        transport="gloo",
        deadline=deadline,
        epoch=1000 + version,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=2,
        ranks={"g0": 1},
    )


def wait_for_ack(wb: WeightBroadcaster, gen_id: str, timeout_s: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        wb.poll(50)
        ack = wb.last_ack(gen_id)
        if ack is not None:
            return ack
    raise AssertionError(f"no WeightsAck from {gen_id} within {timeout_s}s")


def engine_core(generator_pid: int):  # type: ignore[no-untyped-def]
    """The vLLM engine-core process under a generator (it runs the model; the generator's own
    process streams its outputs)."""
    import psutil

    for child in psutil.Process(generator_pid).children(recursive=True):
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no engine-core process under {generator_pid}")


def test_a_wedged_engine_fails_the_generator_instead_of_holding_its_leases(
    cluster: Cluster, checkpoint_dir: Path, broadcaster: WeightBroadcaster
) -> None:
    """An engine that gives no token (here its process frozen with SIGSTOP, as a hung kernel
    would leave it) while the generator's loop heartbeats on: the hub extended every lease it
    held for good, and admission stayed short of them. The generator now exits for a restart."""
    start_hub(cluster, "--rollout.max_tokens", "300")
    gen = cluster.start_generator(
        "g0", checkpoint_dir, sync_ports(broadcaster), "--generator.stall_timeout_s", "15", "--generator.capacity", "2"
    )
    wait_until(lambda: tokens_in_flight(cluster), ENGINE_START_S, "tokens streaming")
    core = engine_core(gen.pid)
    core.suspend()
    try:
        wait_until(lambda: not gen.alive(), 60, "the generator's exit")
        assert gen.returncode not in (0, None)
        assert "the engine gave no token for" in gen.log_path.read_text()
    finally:
        with contextlib.suppress(Exception):  # gone with its generator
            core.kill()
