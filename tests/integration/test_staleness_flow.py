"""Admission and consumption under the staleness bound, with real generators and a learner loop."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.hub_client import Batch, BatchClient, BatchTimeout, ClaimsAhead, request_finish
from flywheel.redis_server import RedisServer
from flywheel.staleness import StalenessPolicy
from flywheel.store import META, GroupMeta, RunKeys, unpack
from tests.conftest import ROOT, Cluster, wait_until
from tests.integration.handgen import HandGenerator, make_chunk
from tests.integration.test_hub_protocol import pump_until, rejected

GPS = 2  # groups per step


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_admission_bounds_staleness(cluster: Cluster, eta: int) -> None:
    cluster.start_hub(
        "--async.max_staleness",
        str(eta),
        "--async.groups_per_step",
        str(GPS),
        "--data.n_samples_per_prompt",
        "2",
        "--data.epochs",
        "10",
    )
    for i in range(2):
        cluster.start_simgen(
            f"sim{i}",
            "--min-len",
            "8",
            "--max-len",
            "40",
            "--tokens-per-s",
            "4000",
            "--capacity",
            "4",
            "--seed",
            str(i),
        )
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(eta, GPS))
    claims = ClaimsAhead(client, GPS, timeout_s=30)  # as the learner claims: the next one ahead
    staleness: list[int] = []
    served: list[int] = []
    for v in range(8):
        batch = claim_in_slices(claims, v)
        if v + 1 < 8:  # the learner claims no batch past its last step
            claims.claim_ahead(v + 1)  # at η = 0 a no-op: the next batch needs this step's weights
        assert len(batch.groups) == GPS
        served += [g.group_id for g in batch.groups]
        for g in batch.groups:
            staleness.append(g.staleness)
            token_versions = {int(x) for s in g.samples for x in s.versions}
            assert all(v - eta <= tv <= v for tv in token_versions), (v, token_versions)
            if eta == 0:
                assert token_versions == {v}, "η = 0 must be strictly on-policy"
        c = client.counters()
        # admission: never more than (v + η + 1) steps of groups issued net of drops
        assert c["groups_issued"] - c.get("groups_dropped", 0) <= (v + eta + 1) * GPS
        time.sleep(0.4)  # a slow learner: generation may run ahead, by at most η
        client.set_version(v + 1)
    claims.close()
    assert max(staleness) <= eta
    assert len(set(served)) == len(served), "a group was served twice"
    if eta == 0:
        assert set(staleness) == {0}
    else:
        assert max(staleness) >= 1, f"with η = {eta} and a slow learner, generation should run ahead: {staleness}"
    hist = client.staleness_histogram()
    assert sum(hist.values()) == 8 * GPS and max(hist) <= eta


def claim_in_slices(claims: ClaimsAhead, version: int, timeout_s: float = 60) -> Batch:
    """As the learner waits: in short slices (between them it looks for generators that lack its
    weights); a batch claimed ahead is kept across them."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return claims.claim(version, wait_s=0.05)
        except BatchTimeout:
            assert time.monotonic() < deadline, f"no batch for v{version} within {timeout_s}s"


@pytest.mark.parametrize("requeue", [True, False])
def test_too_stale_groups_are_dropped_and_requeued(cluster: Cluster, requeue: bool) -> None:
    cluster.start_hub(
        "--async.max_staleness",
        "1",
        "--async.groups_per_step",
        str(GPS),
        "--data.n_samples_per_prompt",
        "2",
        "--async.requeue_stale",
        str(requeue).lower(),
        "--data.shuffle",
        "false",
    )
    sim = cluster.start_simgen("sim", "--min-len", "8", "--max-len", "16", "--tokens-per-s", "20000", "--capacity", "8")
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, GPS))
    r = client.redis
    # v = 0, η = 1: two steps of groups are admitted; let them all become ready
    wait_until(lambda: r.zcard(client.keys.ready) == 2 * GPS, 30, "4 ready groups")
    ready = [int(g) for g in r.zrange(client.keys.ready, 0, -1)]
    prompts = sorted(unpack(GroupMeta, r.hget(client.keys.group(g), META)).prompt_index for g in ready)  # type: ignore[arg-type]
    sim.stop()  # nothing new gets generated: what follows is the hub's bookkeeping alone
    # the learner jumps to v = 5: every ready group (version 0) is now too stale
    pairs, dropped = client.try_claim(GPS, 5)
    assert pairs == [] and dropped == 2 * GPS
    assert client.counters()["groups_dropped"] == 2 * GPS
    assert client.staleness_histogram() == {}  # nothing was served
    # the hub cleans the dropped groups up ...
    wait_until(lambda: all(not r.exists(client.keys.group(g)) for g in ready), 10, "dropped group data deleted")

    # ... and re-queues their prompts when configured: they wait in the re-queue list or have
    # already gone out again as new groups, ahead of any prompt not yet issued
    if requeue:
        wait_until(lambda: set(prompts) <= requeued(client), 10, f"prompts {prompts} re-queued")
    else:
        time.sleep(1.0)  # many reap periods
        assert not set(prompts) & requeued(client), (prompts, sorted(requeued(client)))


def requeued(client: BatchClient, old_groups: frozenset[int] = frozenset()) -> set[int]:
    """Prompts re-queued: waiting in the re-queue list, or gone out again as new groups (any
    group but ``old_groups``)."""
    r = client.redis
    found = {int(i.partition(b":")[0]) for i in r.lrange(client.keys.requeue, 0, -1)}
    for key in r.scan_iter(match=f"fw:{client.keys.run}:g:*"):
        raw = r.hget(key, META)
        if raw is not None and (meta := unpack(GroupMeta, raw)).group_id not in old_groups:
            found.add(meta.prompt_index)
    return found


def test_the_prompts_of_claims_a_dead_learner_never_trained_on_are_requeued(cluster: Cluster) -> None:
    """A learner killed with its batch read and the next one claimed ahead: at its restart the
    hub issues their prompts again (async.requeue_stale), as it does for groups dropped too stale.
    Before, the prompts of the batch it had read went with its data: lost for the epoch."""
    cluster.start_hub(
        "--async.max_staleness", "1",
        "--async.groups_per_step", str(GPS),
        "--data.n_samples_per_prompt", "2",
        "--async.requeue_stale", "true",
        "--data.shuffle", "false",
    )  # fmt: skip
    sim = cluster.start_simgen("sim", "--min-len", "8", "--max-len", "16", "--tokens-per-s", "20000", "--capacity", "8")
    cluster.start_reward()
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, GPS))
    r = client.redis
    wait_until(lambda: r.zcard(client.keys.ready) == 2 * GPS, 30, "4 ready groups")
    sim.stop()
    read = client.claim(GPS, 0, timeout_s=10)  # read: this step trains on it ...
    ahead, _ = client.try_claim(GPS, 1)  # ... while the next is claimed ahead; the learner dies
    assert len(ahead) == GPS
    gids = frozenset([g.group_id for g in read.groups] + [gid for gid, _ in ahead])
    prompts = {g.prompt_index for g in read.groups}
    prompts |= {unpack(GroupMeta, r.hget(client.keys.group(gid), META)).prompt_index for gid, _ in ahead}  # type: ignore[arg-type]
    assert not prompts & requeued(client, gids)
    restarted = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, GPS))
    assert restarted.release_claimed() == 2 * GPS
    wait_until(lambda: prompts <= requeued(client, gids), 10, f"prompts {sorted(prompts)} re-queued")
    wait_until(lambda: not any(r.exists(client.keys.group(g)) for g in gids), 10, "the lost groups' keys removed")
    # at the attempt they had: the learner's death says nothing about the prompts, and must not
    # bring them closer to async.max_requeues (before, each went out again as attempt 1)
    assert sorted(r.lrange(client.keys.requeue, 0, -1)) == sorted(f"{p}:0".encode() for p in prompts)
    log_text = cluster.hub.log_path.read_text()  # type: ignore[union-attr]
    assert "groups handed back by a restarted learner" in log_text and "too stale" not in log_text


def test_a_prompt_dropped_more_than_max_requeues_times_is_abandoned(cluster: Cluster) -> None:
    """async.max_requeues 1: a prompt dropped as too stale goes out once more (attempt 1); dropped
    again, it is skipped and counted, not issued for good."""
    cluster.start_hub(
        *("--async.max_staleness", "1", "--async.groups_per_step", str(GPS), "--data.n_samples_per_prompt", "2"),
        *("--async.max_requeues", "1", "--data.shuffle", "false"),
    )
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, GPS))
    r = client.redis

    def ready_metas() -> list[GroupMeta]:
        raws = [r.hget(client.keys.group(int(g)), META) for g in r.zrange(client.keys.ready, 0, -1)]
        return [unpack(GroupMeta, raw) for raw in raws if raw is not None]

    sim = cluster.start_simgen("sim", "--min-len", "8", "--max-len", "16", "--tokens-per-s", "20000", "--capacity", "8")
    cluster.start_reward()
    wait_until(lambda: len(ready_metas()) == 2 * GPS, 30, "4 ready groups")
    first = {m.prompt_index for m in ready_metas()}
    sim.stop()
    assert client.try_claim(GPS, 5)[1] == 2 * GPS  # every ready group is too stale at v5: dropped
    wait_until(lambda: r.llen(client.keys.requeue) == 2 * GPS, 10, "the 4 prompts re-queued")
    assert sorted(r.lrange(client.keys.requeue, 0, -1)) == sorted(f"{p}:1".encode() for p in first)

    sim = cluster.start_simgen(
        "sim2", "--min-len", "8", "--max-len", "16", "--tokens-per-s", "20000", "--capacity", "8"
    )
    wait_until(
        lambda: first <= {m.prompt_index for m in ready_metas() if m.attempt == 1}, 30, "the re-queued prompts ready"
    )
    sim.stop()
    dropped = client.try_claim(GPS, 10)[1]  # all too stale again, the second time for the first four
    assert dropped >= 2 * GPS
    wait_until(lambda: int(r.hget(client.keys.counters, "prompts_abandoned") or 0) == 2 * GPS, 10, "4 abandoned")
    time.sleep(0.5)  # many reap periods: nothing of the first four comes back
    again = {int(e.partition(b":")[0]) for e in r.lrange(client.keys.requeue, 0, -1)}
    assert not first & again, (first, again)


@pytest.mark.parametrize("revoke", [True, False])
def test_a_group_too_stale_while_generating_is_dropped_and_its_lease_revoked(cluster: Cluster, revoke: bool) -> None:
    """η = 1: a group holding a v0 token can never be trained on once the learner is at v2. With
    async.revoke_stale the hub drops it then, revokes its lease, refuses (quietly) what the
    generator still sends for it, and leases its prompt again; without, it generates on."""
    cluster.start_hub(
        "--async.max_staleness", "1",
        "--async.groups_per_step", "1",
        "--data.n_samples_per_prompt", "2",
        "--data.shuffle", "false",
        "--async.revoke_stale", str(revoke).lower(),
    )  # fmt: skip
    gen = HandGenerator(cluster.gen_address, "hand")
    gen.register(version=0)
    lease = gen.wait_lease()
    gen.send(make_chunk(lease, 0, 0, version=0, final=False))
    pump_until(gen, lambda: gen.acked == 1, "the first chunk acknowledged")
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, 1))
    client.set_version(2)  # oldest usable version: 1
    if not revoke:
        gen.pump(1.0)  # many housekeeping periods
        assert lease.lease_id not in gen.revoked
        assert client.counters().get("groups_dropped", 0) == 0
        return
    pump_until(gen, lambda: lease.lease_id in gen.revoked, "the doomed group's lease revoked")
    counters = client.counters()
    assert counters["groups_dropped"] == 1 and counters["groups_dropped_generating"] == 1, counters
    assert not client.redis.exists(client.keys.group(lease.group_id))
    assert not client.redis.sismember(client.keys.open, lease.group_id)
    # what the generator still sends for it is refused without being stored (nor logged)
    gen.send(make_chunk(lease, 1, 0, version=0, final=True))
    pump_until(gen, lambda: gen.rejected == 1, "the revoked lease's chunk refused")
    assert rejected(cluster, "revoked_lease") == 1
    assert "rejected revoked_lease" not in cluster.hub.log_path.read_text()  # type: ignore[union-attr]
    # with weights the bound accepts, the generator gets the same prompt again, as a new group
    gen.link.set_weight_version(2)
    again = gen.wait_lease()
    assert again.group_id != lease.group_id and again.prompt_tokens == lease.prompt_tokens


def test_a_claim_made_ahead_dooms_what_it_could_not_take(cluster: Cluster) -> None:
    """η = 1, learner at v1: a group holding a v0 token may still be trained at v1. Once the
    learner claims its v2 batch ahead (while it still publishes v1), nothing older than v1 can be
    claimed again: the hub drops the group then, a step before the learner publishes v2."""
    cluster.start_hub(
        "--async.max_staleness", "1",
        "--async.groups_per_step", "1",
        "--data.n_samples_per_prompt", "2",
    )  # fmt: skip
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(1, 1))
    client.set_version(1)
    gen = HandGenerator(cluster.gen_address, "hand")
    gen.register(version=0)
    lease = gen.wait_lease()
    gen.send(make_chunk(lease, 0, 0, version=0, final=False))
    pump_until(gen, lambda: gen.acked == 1, "the first chunk acknowledged")
    assert client.try_claim(1, 1) == ([], 0)  # a claim for v1 still accepts it
    gen.pump(0.5)  # many housekeeping periods
    assert lease.lease_id not in gen.revoked
    assert client.try_claim(1, 2) == ([], 0)  # the claim ahead for v2: nothing ready yet
    pump_until(gen, lambda: lease.lease_id in gen.revoked, "the group the claim ahead dooms revoked")
    assert client.get_version() == 1
    assert client.counters()["groups_dropped_generating"] == 1


def test_claims_a_dead_learner_never_trained_on_go_back_to_admission(redis_server: RedisServer) -> None:
    """A learner killed after claiming its batch and the next one ahead loses both; a step whose
    groups were all filtered out trains on none. Neither may shrink the admission window for
    good (η = 2 admits three steps ahead: three such losses used to stop the run)."""
    gps, eta = 4, 2
    policy = StalenessPolicy(eta, gps)
    client = BatchClient(redis_server.client(), "lost", policy)
    keys = client.keys
    client.redis.zadd(keys.ready, {str(g): 0 for g in range(5 * gps)})
    issued = 5 * gps
    assert client.redis.hset(keys.counters, "groups_issued", issued) == 1
    first, _ = client.try_claim(gps, 0)
    client.note_finished([gid for gid, _ in first])  # trained: version 1
    client.try_claim(gps, 1)  # the batch for v1 and the one claimed ahead for v2: the learner dies
    client.try_claim(gps, 2)
    counters = client.counters()
    assert counters["groups_consumed"] == 3 * gps and counters.get("groups_dropped", 0) == 0
    assert not policy.may_issue(issued, 0, 1), "the window is full of groups nobody will train on"

    restarted = BatchClient(redis_server.client(), "lost", policy)
    assert restarted.release_untrained() == 2 * gps
    assert restarted.release_untrained() == 0, "released once"
    counters = restarted.counters()
    assert counters["groups_dropped"] == counters["groups_lost_with_learner"] == 2 * gps
    assert policy.may_issue(issued, counters["groups_dropped"], 1)

    filtered, _ = restarted.try_claim(gps, 1)
    restarted.note_finished([gid for gid, _ in filtered], trained=False)  # no signal: no step, still at v1
    counters = restarted.counters()
    assert counters["groups_filtered_out"] == gps and counters["groups_dropped"] == 3 * gps
    assert counters["groups_finished"] == counters["groups_consumed"] == 4 * gps
    assert restarted.release_untrained() == 0


def test_a_finish_request_lands_past_every_rank_s_next_step_and_never_postpones(redis_server: RedisServer) -> None:
    """``flywheel finish``: the step stored is at least the published version + 2 (no learner
    rank can have begun it); an earlier request stands, an earlier one still replaces it."""
    client = BatchClient(redis_server.client(), "finish", StalenessPolicy(1, 2))
    assert client.finish_step() is None
    assert request_finish(client.redis, "finish", 0) == 2, "at version 0, as soon as possible: step 2"
    client.set_version(5)
    assert request_finish(client.redis, "finish", 0) == 2, "an earlier finish stands"
    client.redis.delete(client.keys.finish_at)
    assert request_finish(client.redis, "finish", 3) == 7, "step 3 is too soon at version 5"
    assert request_finish(client.redis, "finish", 40) == 7, "a later request does not postpone it"
    client.redis.delete(client.keys.finish_at)
    assert request_finish(client.redis, "finish", 40) == 40
    assert request_finish(client.redis, "finish", 20) == 20, "an earlier request wins"
    assert client.finish_step() == 20


def test_flywheel_finish_names_what_is_missing_and_stores_the_step(redis_server: RedisServer, tmp_path: Path) -> None:
    def finish(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "flywheel.cli", "finish", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)

    out = finish(str(tmp_path))
    assert out.returncode == 2 and "not the directory of a running `flywheel run`" in out.stderr, out.stderr
    out = finish("--at-step", "3")
    assert out.returncode == 2 and "--redis.url and --run.name" in out.stderr, out.stderr
    redis_server.client().hset(RunKeys("other").settings, "groups_per_step", 2)
    out = finish("--redis.url", redis_server.url, "--run.name", "cli", "--at-step", "9")
    # no such run: a finish stored for it would stop a later run of that name at its step 2
    assert out.returncode == 2 and "no run 'cli' in this Redis (runs here: other)" in out.stderr, out.stderr
    assert redis_server.client().get(RunKeys("cli").finish_at) is None
    redis_server.client().set(RunKeys("cli").version, 0)  # the run's learner has started
    out = finish("--redis.url", redis_server.url, "--run.name", "cli", "--at-step", "9")
    assert out.returncode == 0 and out.stdout.strip() == "training ends at step 9", out.stdout + out.stderr
    assert redis_server.client().get(RunKeys("cli").finish_at) == b"9"

    (tmp_path / "services.json").write_text(json.dumps({"pids": {}, "redis_url": redis_server.url}))
    (tmp_path / "config.yaml").write_text("run:\n  name: local\n")
    redis_server.client().hset(RunKeys("local").settings, "groups_per_step", 2)  # its hub has started
    out = finish(str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "training ends at step 2", out.stdout + out.stderr
    out = finish(str(tmp_path), "--cancel")
    assert out.returncode == 0 and out.stdout.strip() == "finish request forgotten", out.stdout + out.stderr
    assert redis_server.client().get(RunKeys("local").finish_at) is None
    out = finish(str(tmp_path), "--cancel")
    assert out.stdout.strip() == "no finish was requested", out.stdout + out.stderr


def test_versions_that_trained_no_batch_do_not_widen_admission(redis_server: RedisServer) -> None:
    """Admission's (v + η + 1) · groups_per_step assumes v batches trained. A learner resumed
    behind the published version continues one past it, and one resumed on a Redis that lost the
    run starts at its checkpoint's version with none trained: each kept one more batch in flight
    for the rest of the run (at η = 0, a batch always generated to be dropped)."""
    gps = 2
    policy = StalenessPolicy(0, gps)
    client = BatchClient(redis_server.client(), "jump", policy)
    for v in range(3):  # three steps trained and published
        client.redis.zadd(client.keys.ready, {str(v * gps + g): v for g in range(gps)})
        batch, _ = client.try_claim(gps, v)
        assert len(batch) == gps
        client.set_version(v + 1)
        client.note_finished([gid for gid, _ in batch])
    assert client.count_versions_without_batch(3) == 0
    # the learner dies; its last checkpoint is v1, so the next continues as v4 (v2, v3 named the lost weights)
    restarted = BatchClient(redis_server.client(), "jump", policy)
    assert restarted.release_untrained() == 0
    assert restarted.count_versions_without_batch(4) == 1
    skipped = int(restarted.redis.hget(restarted.keys.counters, "versions_without_batch") or 0)
    assert policy.admission_limit(4, skipped) == policy.admission_limit(3) == 8  # not 10
    # a checkpoint at v5 resumed on a Redis that holds nothing of the run
    fresh = BatchClient(redis_server.client(), "fresh-redis", policy)
    assert fresh.count_versions_without_batch(5) == 5
    assert policy.admission_limit(5, 5) == gps, "one step of groups before the first update, as at the start"


def test_the_hub_takes_versions_without_a_batch_off_admission(cluster: Cluster) -> None:
    """The hub reads the count the learner records and admits by it: at v3 with three versions
    that trained nothing, η = 0 admits one step of groups, not four."""
    client = BatchClient(cluster.redis.client(), "flywheel", StalenessPolicy(0, 1))
    client.set_version(3)
    client.redis.hset(client.keys.counters, "versions_without_batch", 3)
    cluster.start_hub("--async.max_staleness", "0", "--async.groups_per_step", "1", "--data.n_samples_per_prompt", "2")
    gen = HandGenerator(cluster.gen_address, "hand", capacity=8)
    gen.register(version=3)
    gen.wait_lease()
    gen.pump(1.0)  # many turns: any lease admission allows has come
    assert len({lease.group_id for lease in gen.leases}) == 1
