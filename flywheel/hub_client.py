"""The learner's side of the hub: publish the policy version, claim batches of scored groups.

Claims run as one Lua script inside Redis, so a group is served exactly once even when several
learners (or a restarted one) race. Group data is then read straight from Redis: the hub is not
on the learner's data path.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np
import redis

from flywheel.staleness import StalenessPolicy
from flywheel.store import (
    CLAIM_SCRIPT,
    FINISH_SCRIPT,
    FINISHED_SCRIPT,
    HANDED_BACK,
    KEEP_PROMPT_SCRIPT,
    META,
    RELEASE_UNTRAINED_SCRIPT,
    VERSIONS_WITHOUT_BATCH_SCRIPT,
    GroupMeta,
    RunKeys,
    SampleDone,
    StoredScore,
    assemble,
    chunks_by_sample,
    sample_field,
    score_field,
    unpack,
)
from flywheel.wire import unpack_f32, unpack_i32

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RolloutSample:
    tokens: np.ndarray  # [T] int32 response token ids
    logprobs: np.ndarray  # [T] float32 behaviour log-probabilities
    versions: np.ndarray  # [T] int32 policy version of each token
    finish_reason: str
    reward: float
    reward_breakdown: dict[str, float]
    reward_error: str | None

    @property
    def version(self) -> int:
        """A sample's version is the oldest version among its tokens."""
        return int(self.versions.min()) if len(self.versions) else 0


@dataclass
class RolloutGroup:
    group_id: int
    version: int  # oldest token version in the group
    staleness: int  # learner version at claim time minus ``version``
    prompt_index: int  # row of the prompt source
    prompt_tokens: np.ndarray  # [P] int32
    metadata: dict[str, object]
    samples: list[RolloutSample]


@dataclass
class Batch:
    learner_version: int
    groups: list[RolloutGroup]
    dropped: int  # groups dropped as too stale while claiming
    wait_s: float  # how long the learner waited for it
    staleness: list[int] = field(default_factory=list)


LOAD_GROUPS_PER_CALL = 4
# How long a claim's reply (and a finished batch's marker) is kept for the call's retries: far
# longer than any Redis outage a call waits through (``redis_outage_s``).
RECEIPT_TTL_S = 3600


class BatchTimeout(TimeoutError):
    pass


def request_finish(client: redis.Redis, run: str, at_step: int = 0) -> int:
    """Ask the run's learner to end training at ``at_step`` (0: as soon as it safely can) as it
    would at ``train.total_steps``: checkpoint, export, last weight sync. Returns the step it
    will end at, at least two past the version it has published (``FINISH_SCRIPT``)."""
    keys = RunKeys(run)
    return int(client.register_script(FINISH_SCRIPT)(keys=[keys.version, keys.finish_at], args=[at_step]))


def cancel_finish(client: redis.Redis, run: str) -> bool:
    """Forget a finish request (to train a finished run on); whether there was one."""
    return bool(client.delete(RunKeys(run).finish_at))


class BatchClient:
    """Claims batches for a learner at a known version. One per learner process."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        policy: StalenessPolicy,
        claims_log: str | None = None,
        redis_outage_s: float = 60.0,
        owner: str = "0",
    ) -> None:
        self.redis = client
        self.keys = RunKeys(run)
        self.policy = policy
        self._claimed = self.keys.claimed(owner)  # ``owner``: the learner rank; a restart takes its place
        self._claim = client.register_script(CLAIM_SCRIPT)
        self._finished = client.register_script(FINISHED_SCRIPT)
        self._keep_prompt = client.register_script(KEEP_PROMPT_SCRIPT)
        # Calls that change state are retried (Redis restarting, redis-py's own retry): each
        # carries an id, the same for every retry of one call, that the scripts make idempotent.
        self._call_ids = itertools.count()
        self._client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._release_untrained = client.register_script(RELEASE_UNTRAINED_SCRIPT)
        self._versions_without_batch = client.register_script(VERSIONS_WITHOUT_BATCH_SCRIPT)
        # Every group id this client claimed, one line per claim, written unbuffered before the
        # data is read: an audit (tests/chaos) checks no group was ever served twice.
        self._claims_log = os.open(claims_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if claims_log else None
        self.redis_outage_s = redis_outage_s  # how long a restarting Redis is waited for

    def set_version(self, version: int) -> None:
        """Publish the learner's policy version (after each optimizer step)."""
        self._retry(lambda: self.redis.set(self.keys.version, version), "publishing the version")

    def finish_step(self) -> int | None:
        """The step a finish request ends training at (``request_finish``), or None."""
        raw = self._retry(lambda: self.redis.get(self.keys.finish_at), "reading the finish step")
        return int(raw) if raw is not None else None

    def _retry(self, call: Callable[[], T], what: str) -> T:
        """``call``, again while Redis is unreachable (restarting from its AOF), for at most
        ``redis_outage_s``; then the connection error is raised."""
        deadline = time.monotonic() + self.redis_outage_s
        warned = False
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError) as err:
                if time.monotonic() > deadline:
                    raise
                if not warned:
                    log.warning("redis unreachable while %s (%s): retrying for %.0fs", what, err, self.redis_outage_s)
                    warned = True
                time.sleep(0.2)

    def _call_id(self) -> str:
        return f"{self._client_id}-{next(self._call_ids)}"

    def note_finished(self, group_ids: Sequence[int], trained: bool = True) -> None:
        """The learner is done with the groups it claimed, ``group_ids``: their prompts no longer
        go back to the hub at a restart (``release_claimed``). Groups it could not train on (a
        step whose every group was filtered out: no version bump) are released to admission too,
        counted as dropped, or each such step would shrink the admission window for good.
        Counted once however often it is retried (``FINISHED_SCRIPT``)."""
        gids = list(group_ids)
        self._retry(lambda: self._forget_claims(gids), "forgetting the groups trained on")
        keys = [self.keys.counters, self.keys.claim_done(self._call_id())]
        args = [len(gids), int(trained), RECEIPT_TTL_S]
        self._retry(lambda: self._finished(keys=keys, args=args), "counting the groups trained on")

    def _forget_claims(self, gids: list[int]) -> None:
        """Each command repeats harmlessly, and the keys lie in different slots: no transaction."""
        if not gids:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(self._claimed, *gids)
        pipe.unlink(*[self.keys.group(gid) for gid in gids])  # what is left of them: their prompt
        pipe.execute()

    def release_untrained(self) -> int:
        """At a learner's (re)start: release to admission every group claimed before and never
        trained on (``RELEASE_UNTRAINED_SCRIPT``); returns how many."""
        return int(self._retry(lambda: self._release_untrained(keys=[self.keys.counters]), "releasing lost claims"))

    def count_versions_without_batch(self, version: int) -> int:
        """At a learner's (re)start, after ``release_untrained``: record how many versions up to
        ``version`` hold no trained batch, which the hub's admission takes off the version
        (``VERSIONS_WITHOUT_BATCH_SCRIPT``); returns it."""
        args = [version, self.policy.groups_per_step]
        return int(
            self._retry(
                lambda: self._versions_without_batch(keys=[self.keys.counters], args=args), "counting trained versions"
            )
        )

    def release_claimed_of_ranks_gone(self, world_size: int) -> int:
        """Rank 0's, at a start with fewer ranks than the last: ``release_claimed`` for each rank
        that no longer exists (its claims would otherwise stay in Redis, their prompts lost)."""
        prefix = self.keys.claimed("")  # (run names hold no glob character: config.RunConfig)

        def owners() -> list[str]:
            return [key.decode()[len(prefix) :] for key in self.redis.scan_iter(match=prefix + "*", count=1000)]

        gone = [o for o in self._retry(owners, "listing the ranks' claims") if o.isdigit() and int(o) >= world_size]
        return sum(self._hand_back(self.keys.claimed(o)) for o in gone)

    def release_claimed(self) -> int:
        """At a learner rank's (re)start, before its first claim: hand the hub every group this
        rank claimed before and never trained on (a learner killed with its batch and the one it
        claimed ahead, read or not). The hub removes what is left of them and, with
        ``async.requeue_stale``, issues their prompts again, as for groups dropped too stale
        (``Hub._reap_dropped``; a claimed group keeps its prompt in Redis until it is trained on).
        Returns how many."""

        return self._hand_back(self._claimed)

    def _hand_back(self, claimed: str) -> int:
        def release() -> int:
            gids = sorted(int(g) for g in self.redis.smembers(claimed))
            if gids:
                pipe = self.redis.pipeline(transaction=True)  # (run-level keys: one slot)
                pipe.rpush(self.keys.dropped, *(f"{gid}:{HANDED_BACK}" for gid in gids))
                pipe.delete(claimed)
                pipe.execute()
            return len(gids)

        n = self._retry(release, "handing back claims never trained on")
        if n:
            log.warning("%d groups claimed before this start were never trained on: handed back to the hub", n)
        return n

    def data_done(self) -> bool:
        """The hub says no more groups will come: its prompts are spent (data.epochs), no group
        is open, and none the learner dropped waits for it (a re-queue would bring more)."""

        def read() -> bool:
            pipe = self.redis.pipeline(transaction=True)
            pipe.get(self.keys.data_done)
            pipe.llen(self.keys.dropped)
            flag, dropped = pipe.execute()
            return flag is not None and int(dropped) == 0

        return self._retry(read, "reading whether the data is spent")

    def get_version(self) -> int:
        raw = self._retry(lambda: self.redis.get(self.keys.version), "reading the version")
        return int(raw) if raw is not None else 0

    def try_claim(
        self, n_groups: int, learner_version: int, claim_id: str | None = None
    ) -> tuple[list[tuple[int, int]], int]:
        """One atomic claim: ([(group id, version)], dropped count); empty if fewer than n ready.
        Made again with the same ``claim_id`` after it popped groups, it returns the same ones."""
        k = self.keys
        receipt = k.claim_receipt(claim_id or self._call_id())
        dropped, popped = self._claim(
            keys=[k.ready, k.counters, k.consumed, k.staleness, k.dropped, k.claim_floor, receipt, self._claimed],
            args=[n_groups, learner_version, self.policy.max_staleness, RECEIPT_TTL_S],
        )
        pairs = [(int(popped[i]), int(float(popped[i + 1]))) for i in range(0, len(popped), 2)]
        return pairs, int(dropped)

    def claim(self, n_groups: int, learner_version: int, timeout_s: float, poll_s: float = 0.005) -> Batch:
        """Wait up to ``timeout_s`` for ``n_groups`` fresh-enough scored groups and load them."""
        start = time.monotonic()
        dropped_total = 0
        claim_id = self._call_id()  # a receipt is stored only by the attempt that pops groups
        while True:
            pairs, dropped = self._retry(
                lambda: self.try_claim(n_groups, learner_version, claim_id), "claiming a batch"
            )
            dropped_total += dropped
            if pairs:
                if self._claims_log is not None:
                    os.write(self._claims_log, (" ".join(str(gid) for gid, _ in pairs) + "\n").encode())
                break
            if time.monotonic() - start > timeout_s:
                ready = self._retry(lambda: self.redis.zcard(self.keys.ready), "counting the ready groups")
                raise BatchTimeout(
                    f"no batch of {n_groups} groups within {timeout_s:.1f}s ({ready} ready); is the hub running and are generators connected?"
                )
            time.sleep(poll_s)
        groups = self._load(pairs, learner_version, claim_id)
        return Batch(learner_version, groups, dropped_total, time.monotonic() - start, [g.staleness for g in groups])

    def _load(
        self, pairs: list[tuple[int, int]], learner_version: int, claim_id: str | None = None
    ) -> list[RolloutGroup]:
        """Read the claimed groups, then remove them: in two steps, each retried alone, so that a
        retry never reads what its first attempt already removed."""
        raw_groups = self._retry(lambda: self._read_groups(pairs), "loading a claimed batch")
        self._retry(lambda: self._take_groups([gid for gid, _ in pairs], claim_id), "removing a loaded batch")
        return self._decode_groups(pairs, raw_groups, learner_version)

    def _read_groups(self, pairs: list[tuple[int, int]]) -> list[dict[bytes, bytes]]:
        raw_groups: list[dict[bytes, bytes]] = []
        # A few groups per round trip: one huge reply would stall Redis (single-threaded) and
        # with it the hub's writes.
        for i in range(0, len(pairs), LOAD_GROUPS_PER_CALL):
            pipe = self.redis.pipeline(transaction=False)
            for gid, _ in pairs[i : i + LOAD_GROUPS_PER_CALL]:
                pipe.hgetall(self.keys.group(gid))
            raw_groups += pipe.execute()
        return raw_groups

    def _take_groups(self, gids: list[int], claim_id: str | None) -> None:
        """Consumed: the data is the learner's now, and goes; each group keeps its prompt until
        it is trained on (``KEEP_PROMPT_SCRIPT``). Each command repeats harmlessly, and the keys
        lie in different slots: no transaction."""
        pipe = self.redis.pipeline(transaction=False)
        for gid in gids:
            self._keep_prompt(keys=[self.keys.group(gid)], client=pipe)
        if claim_id is not None:
            pipe.unlink(self.keys.claim_receipt(claim_id))
        if len(pipe):
            pipe.execute()

    def _decode_groups(
        self, pairs: list[tuple[int, int]], raw_groups: list[dict[bytes, bytes]], learner_version: int
    ) -> list[RolloutGroup]:
        out = []
        for (gid, version), raw in zip(pairs, raw_groups, strict=True):
            assert META in raw, f"group {gid} was ready but has no data"
            meta = unpack(GroupMeta, raw[META])
            dones = [unpack(SampleDone, raw[sample_field(s)]) for s in range(meta.n_samples)]
            chunks = chunks_by_sample(raw, {s: done.lease_id for s, done in enumerate(dones)})
            samples = []
            for s, done in enumerate(dones):
                parts = assemble({q: c for q, c in chunks.get(s, {}).items() if q < done.n_chunks}, done.n_chunks)
                assert len(parts.tokens) == 4 * done.n_tokens, (
                    f"group {gid} sample {s}: stored tokens do not match its record"
                )
                score = unpack(StoredScore, raw[score_field(s)])
                samples.append(
                    RolloutSample(
                        tokens=unpack_i32(parts.tokens),
                        logprobs=unpack_f32(parts.logprobs),
                        versions=unpack_i32(parts.versions),
                        finish_reason=done.finish_reason,
                        reward=score.reward,
                        reward_breakdown=score.breakdown,
                        reward_error=score.error,
                    )
                )
            out.append(
                RolloutGroup(
                    gid,
                    version,
                    learner_version - version,
                    meta.prompt_index,
                    unpack_i32(meta.prompt_tokens),
                    dict(meta.metadata),
                    samples,
                )
            )
        return out

    def staleness_histogram(self) -> dict[int, int]:
        raw = self._retry(lambda: self.redis.hgetall(self.keys.staleness), "reading the staleness histogram")
        return {int(k): int(v) for k, v in raw.items()}

    def counters(self) -> dict[str, int]:
        raw = self._retry(lambda: self.redis.hgetall(self.keys.counters), "reading the counters")
        return {k.decode(): int(v) for k, v in raw.items()}


class ClaimsAhead:
    """A learner's claims, the next one made on a thread while the current step trains.

    Loading a batch (Redis round trips, unpacking every sample) then overlaps the optimizer step
    instead of adding to it. Only at η >= 1: at η = 0 the next batch needs the weights this step
    makes. A claim made ahead for a version is kept until the learner reaches that version (a
    step whose groups were all filtered out does not advance it), so nothing claimed is dropped.
    """

    def __init__(self, client: BatchClient, n_groups: int, timeout_s: float) -> None:
        self.client, self.n_groups, self.timeout_s = client, n_groups, timeout_s
        self._ahead: tuple[int, Future[Batch]] | None = None

    def claim(self, version: int, wait_s: float | None = None) -> Batch:
        """The batch for ``version``: the one claimed ahead, or a claim now. Raises BatchTimeout
        after ``wait_s`` (default: ``timeout_s``); a claim made ahead is kept for the next call."""
        wait_s = self.timeout_s if wait_s is None else wait_s
        if self._ahead is not None and self._ahead[0] == version:
            future = self._ahead[1]
            try:
                # Raises FutureTimeout when the wait ends first, and also the claim's own
                # BatchTimeout (it gives up after timeout_s): a TimeoutError too, from Python 3.11
                # on, so the two are told apart by whether the claim is done.
                future.result(timeout=wait_s)
            except FutureTimeout:
                if not future.done():
                    # kept: its groups are consumed in Redis, and only the next call can still
                    # hand them to the learner
                    raise BatchTimeout(
                        f"the batch claimed ahead for v{version} is not ready after {wait_s:.1f}s"
                    ) from None
            except BaseException:
                if not future.done():  # the wait was interrupted (Ctrl-C), not the claim: kept
                    raise
            self._ahead = None  # done: its batch, or its failure (the next call claims afresh)
            failure = future.exception()
            if failure is not None:
                raise failure
            return future.result()
        return self.client.claim(self.n_groups, version, wait_s)

    def take_landed(self, version: int) -> Batch | None:
        """For a learner ending out of data at ``version``: the batch claimed ahead for a later
        version, if it is in, as this version's (it meets this version's bound: its claim's floor
        was higher), else None. Its groups are consumed in Redis: left here, they would end the
        run untrained (a step whose groups were all filtered out leaves one claimed ahead)."""
        if self._ahead is None or not self._ahead[1].done() or self._ahead[1].exception() is not None:
            return None
        batch = self._ahead[1].result()
        self._ahead = None
        groups = [replace(g, staleness=version - g.version) for g in batch.groups]
        return replace(batch, learner_version=version, groups=groups, staleness=[g.staleness for g in groups])

    def ahead_version(self) -> int | None:
        """The version a claim was made ahead for (its claim raised the hub's floor to it - η)."""
        return None if self._ahead is None else self._ahead[0]

    def claim_ahead(self, version: int) -> None:
        """Start claiming the batch for ``version`` (not at η = 0, nor when one is already coming)."""
        if self.client.policy.max_staleness < 1 or self._ahead is not None:
            return
        future: Future[Batch] = Future()

        def run() -> None:
            try:
                future.set_result(self.client.claim(self.n_groups, version, self.timeout_s))
            except BaseException as err:  # handed to whoever takes the batch
                future.set_exception(err)

        # A daemon thread: a learner stopping (Ctrl-C, a failure) must not wait for a claim that
        # may never be served; groups it claimed are lost with it, as any batch in flight is.
        threading.Thread(target=run, name="claim-ahead", daemon=True).start()
        self._ahead = (version, future)

    def close(self) -> None:
        self._ahead = None


def hub_metrics(host: str, port: int, timeout_s: float = 2.0) -> dict[str, float]:
    """The hub's Prometheus gauges and counters (``flywheel_hub_`` and ``_total`` stripped); empty
    when the hub does not answer (not started yet, or restarting)."""
    try:
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s).read().decode()
    except OSError:
        return {}
    out = {}
    for line in body.splitlines():
        if line.startswith("flywheel_hub_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("flywheel_hub_").removesuffix("_total")] = float(value)
    return out
