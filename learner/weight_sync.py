"""Learner rank 0's side of the weight sync: who is in the group, and the broadcast itself.

Generators announce themselves with ``SyncJoin`` on the learner's ROUTER socket (every heartbeat).
A sync publishes ``WeightsReady`` on the PUB socket, builds the process group when its membership
changed (the learner hosts the rendezvous store), broadcasts the buckets and waits for every
member's ``WeightsAck`` until the deadline. A member that errs or misses the deadline is evicted
and the group is rebuilt at the next sync; the learner never waits past the deadline. A member
whose ranks never came to the group's rendezvous (hung, or unable to reach the learner's store)
would fail every sync it is in, the whole fleet's with it: it is left out of syncs for a while
(``Quarantine``), longer at each repeat, while the others go on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import zmq

from flywheel.config import SecurityConfig, SyncConfig
from flywheel.netsec import curve_server
from flywheel.weights import (
    RanksLeft,
    RanksMissing,
    WeightGroup,
    WeightSyncError,
    host_store,
    join_group,
    plan_buckets,
    send,
)
from flywheel.weights_ipc import sync_prefix
from flywheel.wire import Decoder, Rejections, SyncJoin, ToLearner, WeightsAck, WeightsReady, WireError, encode

log = logging.getLogger(__name__)

MAX_JOIN_BYTES = 1 << 20  # a SyncJoin or WeightsAck is a few hundred bytes (an error message at most)


@dataclass
class Member:
    workers: int
    version: int
    last_seen: float
    joined: float = 0.0  # when its first SyncJoin (since it last left) arrived
    needs_weights: bool = False  # it holds no usable policy weights (SyncJoin.needs_weights)
    incarnation: str = ""  # its process's (SyncJoin.incarnation)


# A generator's SUB socket (re)subscribes when it (re)connects, at the same moment its DEALER
# sends the SyncJoin; a WeightsReady published before the subscription reaches the PUB is lost
# (a restarted learner's first sync would then wait out its deadline for nothing). A member takes
# part in syncs only once it has been joined this long.
JOIN_SETTLE_S = 1.0

QUARANTINE_MAX_S = 600.0
"""The longest a generator that never came to a rendezvous is left out of syncs."""

FAILED_SYNCS_BEFORE_QUARANTINE = 2
"""Syncs in a row a generator may fail (an error ack) while others took the same weights,
before it is left out: each failure closes the group, which the whole fleet then
builds again at the next sync (an NCCL rendezvous, with every engine paused); one failure may
be a hiccup."""


@dataclass
class Quarantine:
    """Generators left out of syncs: those whose ranks never came to a group's rendezvous, and
    those that failed ``FAILED_SYNCS_BEFORE_QUARANTINE`` syncs in a row that others took. Each
    repeat doubles the time out (from the sync timeout up to ``QUARANTINE_MAX_S``); a sync it acks
    clears its record."""

    base_s: float
    until: dict[str, float] = field(default_factory=dict)  # generator -> monotonic end of its time out
    strikes: dict[str, int] = field(default_factory=dict)
    # generator -> (syncs failed since its last ack, monotonic time of the last)
    failed_in_a_row: dict[str, tuple[int, float]] = field(default_factory=dict)

    def add(self, gen_id: str, why: str, check: str = "that it reaches the learner's sync.host and its ports") -> None:
        strikes = self.strikes.get(gen_id, 0) + 1
        self.strikes[gen_id] = strikes
        seconds = min(self.base_s * 2 ** (strikes - 1), QUARANTINE_MAX_S)
        self.until[gen_id] = time.monotonic() + seconds
        log.warning(
            "generator %s %s: left out of weight syncs for %.0fs (time %d); check %s",
            gen_id,
            why,
            seconds,
            strikes,
            check,
        )

    def failed_sync(self, gen_id: str, why: str) -> None:
        """``gen_id`` failed a sync that other generators took: a failure of its own."""
        failed = self.failed_in_a_row.get(gen_id, (0, 0.0))[0] + 1
        self.failed_in_a_row[gen_id] = (failed, time.monotonic())
        if failed >= FAILED_SYNCS_BEFORE_QUARANTINE:
            self.add(gen_id, f"failed {failed} weight syncs in a row that the others took (last: {why})", "its log")

    def holds(self, gen_id: str, now: float) -> bool:
        return now < self.until.get(gen_id, 0.0)

    def forget_gone(self, present: set[str], now: float) -> None:
        """Drop the records of generators no longer heard from whose time out is over (an id
        evicted at its failed sync and never back: a restart under a fresh id leaves one)."""
        for gen_id in [g for g, until in self.until.items() if g not in present and until <= now]:
            self.clear(gen_id)
        # (an evicted generator is away until its next SyncJoin, a second or so: its count stays)
        for gen_id in [g for g, (_, at) in self.failed_in_a_row.items() if g not in present and now - at > self.base_s]:
            self.clear(gen_id)

    def clear(self, gen_id: str) -> None:
        self.until.pop(gen_id, None)
        self.strikes.pop(gen_id, None)
        self.failed_in_a_row.pop(gen_id, None)


@dataclass
class SyncReport:
    """What one sync did (logged by the learner, asserted by tests, measured by benchmarks)."""

    version: int
    members: list[str] = field(default_factory=list)  # generators the weights were sent to
    acked: list[str] = field(default_factory=list)  # ... that confirmed they serve `version`
    evicted: dict[str, str] = field(default_factory=dict)  # generator -> why
    nbytes: int = 0
    buckets: int = 0
    rebuilt_group: bool = False
    join_s: float = 0.0  # building the group (only when rebuilt)
    broadcast_s: float = 0.0  # sending every bucket
    total_s: float = 0.0  # announce -> last ack


class WeightBroadcaster:
    def __init__(
        self,
        cfg: SyncConfig,
        device: torch.device | str = "cpu",
        bind_host: str | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.transport = (
            cfg.transport if cfg.transport != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        )
        if self.transport in ("nccl", "ipc") and self.device.type != "cuda":
            raise ValueError(
                f"sync.transport {self.transport} needs the learner on a CUDA GPU (it is on {self.device}): "
                "use --sync.transport gloo, or auto"
            )
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        bind = bind_host or cfg.host
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        curve_server(self.pub, security)  # security.curve: only authorised generators hear or join
        self.pub.bind(f"tcp://{bind}:{cfg.announce_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a generator back under its id takes it over (hub.py)
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_JOIN_BYTES)  # far over the checked limit: ZMQ drops it
        curve_server(self.router, security)
        self.router.bind(f"tcp://{bind}:{cfg.join_port}")
        self.decoder = Decoder(ToLearner, max_bytes=MAX_JOIN_BYTES)
        self.members: dict[str, Member] = {}
        self.group: WeightGroup | None = None
        self.group_workers: dict[str, int] = {}  # each member's ranks in the group, in rank order
        # Group names start from the clock: a restarted learner must never announce an epoch a
        # generator still holds a (dead) group for, or that generator would reuse it and hang.
        self.epoch = time.time_ns() // 1_000_000
        self.rejects = Rejections(log)  # what arrived on the join socket and was refused, by reason
        self._acks: dict[str, WeightsAck] = {}
        self._restarted: set[str] = set()  # members whose process was replaced since the sync started
        # members of the current group that left the sync since it was built (_forget_member)
        self._left_group: set[str] = set()
        self._store_port = 0  # rendezvous port of the current group
        self.quarantine = Quarantine(base_s=max(cfg.timeout_s, 10.0))

    # ------------------------------------------------------------------ membership

    def poll(self, timeout_ms: int = 0) -> None:
        """Take in every SyncJoin and WeightsAck that arrived (waiting at most ``timeout_ms``)."""
        if not self.router.poll(timeout_ms, zmq.POLLIN):
            return
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:  # a peer that does not speak our protocol
                self.rejects.reject("malformed", f"expected 2 frames, got {len(frames)}", frames[0])
                continue
            identity, payload = frames
            try:
                msg = self.decoder.decode(payload)
            except WireError as err:
                self.rejects.reject(err.reason, err, identity)
                continue
            assert isinstance(msg, SyncJoin | WeightsAck)
            if identity != msg.generator_id.encode():  # generators connect with their id as identity
                self.rejects.reject("identity_mismatch", f"{type(msg).__name__} for {msg.generator_id!r}", identity)
                continue
            now = time.monotonic()
            if isinstance(msg, SyncJoin) and msg.leaving:
                if msg.generator_id in self.members:
                    log.info("generator %s stops: leaves the weight sync", msg.generator_id)
                self._forget_member(msg.generator_id)
            elif isinstance(msg, SyncJoin):
                if msg.generator_id not in self.members:
                    log.info(
                        "generator %s joins the weight sync (v%d, %d workers)",
                        msg.generator_id,
                        msg.version,
                        msg.workers,
                    )
                old = self.members.get(msg.generator_id)
                another = bool(old and old.incarnation and msg.incarnation and msg.incarnation != old.incarnation)
                if old is not None and (msg.version < old.version or another):
                    # A new process under a known id (restarted, or a spare that took its place):
                    # it holds none of what the old one was sent, and a sync waiting for the old
                    # one's ack would wait for its deadline. It joins afresh (JOIN_SETTLE_S).
                    log.info("generator %s is back (v%d, was v%d)", msg.generator_id, msg.version, old.version)
                    self._restarted.add(msg.generator_id)
                    self.quarantine.clear(msg.generator_id)  # a new process: a fresh start
                    old = None
                self.members[msg.generator_id] = Member(
                    msg.workers, msg.version, now, old.joined if old else now, msg.needs_weights, msg.incarnation
                )
            elif isinstance(msg, WeightsAck):
                self._acks[msg.generator_id] = msg
                member = self.members.get(msg.generator_id)
                if member is not None:
                    member.last_seen = now
                    if msg.error is None:
                        member.version = msg.version
                        member.needs_weights = False

    def _forget_member(self, gen_id: str) -> None:
        """A generator left (it said so, or went silent). A process that joins later under its id
        joins afresh, and holds none of the group this one was in: were the group kept, the next
        sync would see the same membership and broadcast on it, to ranks that are gone."""
        self.members.pop(gen_id, None)
        self.quarantine.clear(gen_id)  # (a generator gone for good leaves no record behind)
        if gen_id in self.group_workers:
            self._left_group.add(gen_id)

    def last_ack(self, generator_id: str) -> WeightsAck | None:
        """The latest WeightsAck from a generator since the last sync started."""
        return self._acks.get(generator_id)

    def live_members(self) -> dict[str, Member]:
        now = time.monotonic()
        for gen_id in [g for g, m in self.members.items() if now - m.last_seen > self.cfg.member_timeout_s]:
            log.warning("generator %s silent for %.0fs: leaves the weight sync", gen_id, self.cfg.member_timeout_s)
            self._forget_member(gen_id)
        self.quarantine.forget_gone(set(self.members), now)
        return {
            g: m
            for g, m in self.members.items()
            if now - m.joined >= JOIN_SETTLE_S and not self.quarantine.holds(g, now)
        }

    def _await_settling(self) -> None:
        """Wait (at most JOIN_SETTLE_S) for members that joined moments ago rather than skip them:
        one skipped at a restarted learner's first sync would wait for the next (at η = 0 the
        learner may wait for that generator's batch first)."""
        newest = max((m.joined for m in self.members.values()), default=0.0)
        wait = newest + JOIN_SETTLE_S - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, JOIN_SETTLE_S))
            self.poll()

    def behind(self, version: int) -> list[str]:
        """Live members that do not serve ``version``'s weights: joined after the last sync (a
        restarted or added generator, one that loaded the base model while the warm start ran) or
        left with half-loaded weights by a failed update. The learner, waiting for a batch only they
        could make, sends them the current weights rather than wait for its next step's sync."""
        self.poll()
        return sorted(g for g, m in self.live_members().items() if m.version < version or m.needs_weights)

    def wait_for_members(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.live_members()) < n:
            if time.monotonic() > deadline:
                return False
            self.poll(50)
        return True

    # ------------------------------------------------------------------ the sync

    def sync(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Broadcast ``named_tensors`` as ``version`` to every live member. Returns within the deadline."""
        started = time.perf_counter()
        self.poll()
        self._await_settling()
        members = self.live_members()
        report = SyncReport(version=version)
        if not members:
            return report
        tensors = dict(named_tensors)
        buckets = plan_buckets(tensors.items(), int(self.cfg.bucket_mb * (1 << 20)))
        report.buckets, report.nbytes = len(buckets), sum(b.nbytes for b in buckets)
        store = None
        # The group is built again when its members or their worker counts changed, or when a
        # member's process was replaced since it was built (restarted, or a spare under its id),
        # or left the sync and joined again: the new process holds none of the old group.
        workers = {gen_id: members[gen_id].workers for gen_id in sorted(members)}
        replaced = (self._restarted | self._left_group) & set(self.group_workers)
        if self.group is None or workers != self.group_workers or replaced:
            self._close_group()
            self.epoch += 1
            self.group_workers = workers
            self._left_group.clear()
            store = host_store(self.cfg.host, self.cfg.timeout_s)
            report.rebuilt_group = True
        report.members = sorted(self.group_workers)
        announced_at = time.time()
        deadline = announced_at + self.cfg.timeout_s
        world = 1 + sum(self.group_workers.values())
        ready = WeightsReady(
            version=version,
            buckets=buckets,
            transport=self.transport,
            deadline=deadline,
            announced_at=announced_at,
            epoch=self.epoch,
            master_addr=self.cfg.host,
            master_port=store.port if store is not None else self._store_port,
            world_size=world,
            ranks=self.group_ranks(),
        )
        self._acks.clear()
        self._restarted.clear()
        self.pub.send(encode(ready))
        try:
            if store is not None:
                t0 = time.perf_counter()
                self.group = join_group(
                    self.transport,
                    self.cfg.host,
                    store.port,
                    0,
                    world,
                    self.epoch,
                    self.cfg.timeout_s,
                    store,
                    self.device,
                    ranks_left=self._ranks_that_left,
                )
                self._store_port = store.port
                report.join_s = time.perf_counter() - t0
            assert self.group is not None
            self.group.op_timeout_s = max(deadline - time.time(), 0.1)  # no broadcast outlives the deadline...
            self.group.deadline = deadline  # ...nor do all of them together
            self.group.sync_prefix = sync_prefix(version, ready.sync_stamp)  # (ipc: this sync's keys)
            report.broadcast_s = send(self.group, buckets, tensors)
        except RanksLeft as err:  # not a failure of anybody's: the others get it at the next sync
            log.info("weight sync v%d given up: %s", version, err)
            self._close_group()
        except WeightSyncError as err:
            log.error("weight sync v%d failed: %s; the group is rebuilt at the next sync", version, err)
            if isinstance(err, RanksMissing):
                self._quarantine_absent(err.missing)
            self._close_group()
        self._collect_acks(version, deadline, report)
        report.total_s = time.perf_counter() - started
        return report

    def _collect_acks(self, version: int, deadline: float, report: SyncReport) -> None:
        waiting = set(report.members)
        first = True  # acks that came in time are read even when the send ended past the deadline
        while waiting and (first or time.time() < deadline):
            first = False
            self.poll(int(min(50, max(1, (deadline - time.time()) * 1000))))
            for gen_id in list(waiting):
                if gen_id in self._restarted:  # the process the weights went to is gone
                    waiting.discard(gen_id)
                    report.evicted[gen_id] = "restarted during the sync"
                    continue
                ack = self._acks.get(gen_id)
                if ack is None or ack.epoch != self.epoch:
                    if gen_id not in self.members:  # it said it stops: no ack will come
                        waiting.discard(gen_id)
                        report.evicted[gen_id] = "left the sync"
                    continue
                waiting.discard(gen_id)
                if ack.error is None and ack.version == version:
                    report.acked.append(gen_id)
                    self.quarantine.clear(gen_id)
                else:
                    report.evicted[gen_id] = ack.error or f"acked version {ack.version}"
        for gen_id in waiting:
            report.evicted[gen_id] = "missed the deadline"
        if report.evicted:
            log.warning("weight sync v%d: evicted %s", version, report.evicted)
            if report.acked:  # others took these weights: a member that failed them failed on its own
                for gen_id, why in report.evicted.items():
                    # its own error; a missed deadline may be a slower host's, or the learner's own
                    # send that used up the deadline: not counted
                    if why not in ("restarted during the sync", "left the sync", "missed the deadline"):
                        self.quarantine.failed_sync(gen_id, why)
            for gen_id in report.evicted:
                if gen_id not in self._restarted:  # (a restarted one has joined afresh already)
                    self.members.pop(gen_id, None)  # it rejoins with its next SyncJoin
            self._close_group()

    def _ranks_that_left(self) -> list[int]:
        """The ranks of the group being built whose generator has left the sync since (it said
        it stops, ``SyncJoin.leaving``): they will never come to its rendezvous."""
        self.poll()
        return [
            rank
            for gen_id, first in self.group_ranks().items()
            if gen_id not in self.members
            for rank in range(first, first + self.group_workers[gen_id])
        ]

    def _quarantine_absent(self, missing: list[int]) -> None:
        for gen_id, first in self.group_ranks().items():
            ranks = range(first, first + self.group_workers[gen_id])
            absent = [r for r in ranks if r in missing]
            if absent:
                self.quarantine.add(gen_id, f"never came to the weight group's rendezvous (ranks {absent})")

    def group_ranks(self) -> dict[str, int]:
        """Each member's first rank in the group (rank 0 is this learner)."""
        ranks, rank = {}, 1
        for gen_id, n in self.group_workers.items():
            ranks[gen_id], rank = rank, rank + n
        return ranks

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self.group_workers = {}

    def close(self) -> None:
        self._close_group()
        with contextlib.suppress(zmq.ZMQError):
            self.pub.close(linger=0)
            self.router.close(linger=0)


class OverlappedSync:
    """``WeightBroadcaster.sync`` in a background thread, so the learner trains its next step while
    the weights go out and the generators load them (``sync.overlap``).

    One sync in flight: ``start`` first waits for the previous one. The thread gets a copy of the
    weights, since the next optimizer step changes them in place. A failure in the thread is raised
    in the learner's loop at the next ``start`` or ``wait``; nothing else touches the broadcaster
    while a sync is in flight (it is only used through here).
    """

    def __init__(self, broadcaster: WeightBroadcaster, on_report: Callable[[SyncReport], None], wait_s: float) -> None:
        self.broadcaster, self.on_report, self.wait_s = broadcaster, on_report, wait_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.wait()
        snapshot = {name: t.detach().clone() for name, t in weights.items()}
        self._thread = threading.Thread(
            target=self._run, args=(version, snapshot), name=f"weight-sync-v{version}", daemon=True
        )
        self._thread.start()

    def _run(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        try:
            self.on_report(self.broadcaster.sync(version, snapshot.items()))
        except BaseException as err:  # handed to the learner's loop by wait()
            self._error = err

    def wait(self) -> None:
        """Until the sync in flight (if any) is done; raises what it raised."""
        if self._thread is not None:
            self._thread.join(timeout=self.wait_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the weight sync thread is still running after {self.wait_s:g}s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"weight sync failed: {type(err).__name__}: {err}") from err
