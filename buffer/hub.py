"""The rollout hub: leases prompts to generators, persists their chunks, gets samples scored,
and publishes ready groups for learners.

One thread, one loop. Each turn drains the sockets, applies every accepted message to the
in-memory mirror, writes the whole turn to Redis in one MULTI/EXEC pipeline, and only then
acknowledges chunks and sends leases. Redis is the truth: a restarted hub rebuilds its mirror
from it (``buffer.recovery``), and generators resend whatever was not acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict, deque

import numpy as np
import redis
import zmq

from buffer.prompts import Prompt, PromptSource
from buffer.state import ActiveLease, GeneratorInfo, OpenGroup, RewardWorker, SampleAssembly
from buffer.stats import HubStats, RateMeter, RejectLog, SnapshotExchange, start_metrics_server
from buffer.turn_write import TurnWrite
from flywheel.config import FlywheelConfig
from flywheel.files import write_atomically
from flywheel.netsec import curve_server, refused_peers
from flywheel.staleness import GroupState, StalenessPolicy
from flywheel.store import (
    META,
    GeneratorRecord,
    GroupMeta,
    LeaseRecord,
    RunKeys,
    StoredScore,
    chunk_blob_field,
    dropped_entry,
    pack,
    sample_field,
    score_field,
    unpack,
)
from flywheel.watchdog import WATCHDOG
from flywheel.wire import (
    Chunk,
    ChunkAck,
    ChunkBatch,
    ChunkRejection,
    Decoder,
    Heartbeat,
    Lease,
    Message,
    Register,
    RegisterAgain,
    Release,
    Revoke,
    RewardRegister,
    SamplingParams,
    Score,
    ScoreBatch,
    ScoreRequest,
    ToHub,
    WireError,
    clip_error,
    encode,
    encode_list,
    pack_i32,
    pack_i64,
)

log = logging.getLogger(__name__)

TICK_S = 0.005  # housekeeping period: expiry, dispatch
ALL_FAILED_GROUPS = 8  # groups dropped for failed rewards, none ever ready: the reward configuration is wrong
SKIPS_PER_ISSUE = 64  # over-long prompts skipped in one try to issue a group (the next turn goes on)
REFRESH_S = 0.05  # at most this long between reads of the learner's version / drops
# Between scans for lapsed leases, silent generators and unanswered scores: each scan walks all
# of them, and their timeouts are seconds, so scanning at every tick was pure cost at scale.
EXPIRY_S = 0.1
# A lease its generator's heartbeats have not listed this long after its message went, with no
# chunk of it come either, is taken for lost and sent again (at most LEASE_RESENDS times): a ROUTER
# drops what it cannot deliver, e.g. to a generator reconnecting, and the lease would otherwise
# hold its slot until hub.lease_timeout_s. A message only late costs a duplicate the generator
# ignores.
LEASE_LOST_S = 2.0
LEASE_RESENDS = 3


class Hub:
    def __init__(self, cfg: FlywheelConfig, source: PromptSource, client: redis.Redis) -> None:
        self.cfg = cfg
        self.hcfg = cfg.hub
        self.source = source
        self.redis = client
        self.keys = RunKeys(cfg.run.name)
        self.policy = StalenessPolicy(cfg.async_.max_staleness, cfg.async_.groups_per_step)
        self.sampling = SamplingParams(
            max_tokens=cfg.rollout.max_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            seed=cfg.rollout.seed,
        )
        groups = len(source) * cfg.data.epochs
        wanted = cfg.train.total_steps * cfg.async_.groups_per_step
        if groups < wanted:
            log.warning(
                "%d prompts x data.epochs %d make %d groups, fewer than train.total_steps %d x async.groups_per_step "
                "%d = %d: training will end at about step %d, when they are spent (raise --data.epochs)",
                len(source), cfg.data.epochs, groups, cfg.train.total_steps, cfg.async_.groups_per_step, wanted,
                groups // cfg.async_.groups_per_step,
            )  # fmt: skip
        self.stats = HubStats()
        self.snapshots = SnapshotExchange(self.snapshot)  # /metrics reads the stats through the loop
        self.stats.watch_gc()
        self.rejects = RejectLog(self.stats, self.hcfg.reject_log_interval_s)
        self.decoder = Decoder(ToHub, max_bytes=self.hcfg.max_message_bytes)

        # mirror of durable state (filled by recovery.load)
        self.learner_version = 0
        self.groups_issued = 0
        self.groups_dropped = 0
        self.versions_without_batch = 0  # versions that trained no batch: admission takes them off v
        self._data_done: bool | None = None  # what keys.data_done says (None: not written yet)
        self.claim_floor = -1  # the oldest version the learner's newest claim accepted (flywheel.store)
        self._admission_said_no = False
        self._blocked_at: float | None = None
        self.next_lease_id = 0
        self.epoch = 0
        self.cursor = 0
        self.requeued_prompts: deque[tuple[int, int]] = deque()  # (prompt index, attempt)
        self.groups: dict[int, OpenGroup] = {}
        self.leases: dict[int, ActiveLease] = {}
        self.unassigned: deque[int] = deque()  # lease ids re-issued, waiting for a generator
        self.generators: dict[str, GeneratorInfo] = {}
        self.score_queue: deque[tuple[int, int]] = deque()
        self.score_sent: dict[tuple[int, int], tuple[bytes, float]] = {}
        # every sample sent to a reward service and not yet scored: an answer to a request that
        # timed out (and waits to be sent again) is as good as any; an answer never asked for is not
        self.score_asked: set[tuple[int, int]] = set()
        self.reward_workers: dict[bytes, RewardWorker] = {}

        # per-turn output, flushed after the Redis write
        self._pipe = TurnWrite(client)
        # group id -> the chunks it accepted this turn; at flush each group writes them as one blob
        self._turn_chunks: dict[int, list[Chunk]] = defaultdict(list)
        # per peer: flat [group, sample, seq, group, sample, seq, ...] acknowledged this turn
        self._acks: dict[bytes, list[int]] = defaultdict(list)
        self._rejections: dict[bytes, list[ChunkRejection]] = defaultdict(list)
        self._outbox: list[tuple[zmq.Socket, bytes, bytes]] = []
        self._turn_started = 0.0

        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.gen_sock = self._router(self.hcfg.generator_port)
        self.reward_sock = self._router(self.hcfg.reward_port)
        self.ports = {
            "generator_port": _port_of(self.gen_sock),
            "reward_port": _port_of(self.reward_sock),
            "metrics_port": None,
        }
        self._stopping = False
        self._turn_items = 0
        self._refreshed = 0.0
        self._last_reap = 0.0
        self._to_reap = 0  # groups learners dropped and the hub has not cleaned up (LLEN, read with each write)
        self._last_expiry = 0.0
        self._behind_since: float | None = None  # turns have ended with input still unread since
        self._doom_floor = 0  # the oldest version a group may hold, when groups were last checked
        self._late_doomed: set[int] = set()  # groups whose first token came in since, already below it
        # leases revoked with their doomed group, and those groups: what their generators and
        # reward workers still send for them is expected, counted quietly and not stored
        self._revoked_leases: set[int] = set()
        self._dropped_groups: set[int] = set()
        # groups whose every sample has its score: a late answer to a re-sent request is a duplicate
        self._scored_groups: set[int] = set()
        # groups this process dropped for failed rewards (stats' count is the run's, restored at a
        # restart; groups_ready counts this process only)
        self._reward_drops_here = 0
        self._rates = RateMeter()
        self.ingest_rates = {"tokens": 0.0, "chunks": 0.0}  # per second, over the last stats interval
        self._last_stats = time.monotonic()

    # ------------------------------------------------------------------ setup

    def _router(self, port: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hcfg.sndhwm)
        sock.setsockopt(zmq.RCVHWM, self.hcfg.rcvhwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: an error we count, not a silent drop
        # A peer connecting under an id the socket still holds (its old process frozen, or its TCP
        # connection half-open) takes the id over; without it, a generator back under its id (a
        # restart, a spare) would be ignored until the old connection timed out.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Memory guard well above the checked limit: bigger frames are refused by ZMQ itself.
        sock.setsockopt(zmq.MAXMSGSIZE, self.hcfg.max_message_bytes * 4)
        curve_server(sock, self.cfg.security)  # security.curve: only authorised clients get through
        host = self.hcfg.host
        if port == 0:
            sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        return sock

    def start_metrics(self) -> None:
        if self.hcfg.metrics_port is not None:
            self.ports["metrics_port"] = start_metrics_server(self.hcfg.metrics_port, self.hcfg.host, self.snapshots)

    def write_state_file(self) -> None:
        if self.hcfg.state_file:
            write_atomically(self.hcfg.state_file, json.dumps(self.ports))

    # ------------------------------------------------------------------ main loop

    def stop(self) -> None:
        self._stopping = True

    def run(self, max_seconds: float | None = None) -> None:
        """Serve until ``stop()`` (or for ``max_seconds``)."""
        poller = zmq.Poller()
        poller.register(self.gen_sock, zmq.POLLIN)
        poller.register(self.reward_sock, zmq.POLLIN)
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        next_tick = 0.0
        started = time.monotonic()
        for peer in self._peers():
            peer.last_seen = started  # the time recovery took is no silence of theirs
        while not self._stopping and (deadline is None or time.monotonic() < deadline):
            ready = dict(poller.poll(timeout=int(TICK_S * 1000)))
            self._turn_started = time.monotonic()
            self._excuse_own_stall(self._turn_started - started)
            started = self._turn_started
            self._turn_items = 0
            if self.reward_sock in ready:  # scores first: small, and they make groups ready
                self._drain(self.reward_sock)
            if self.gen_sock in ready:
                self._drain(self.gen_sock)
            if self._turn_started >= next_tick:
                self._housekeeping()
                next_tick = self._turn_started + TICK_S
            self._dispatch_leases()
            self._dispatch_scores(self._turn_started)
            self._flush()
            self.snapshots.serve()  # a scrape waiting for the stats: taken here, not on its thread

    def _drain(self, sock: zmq.Socket) -> None:
        while self._turn_items < self.hcfg.max_turn_items:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._turn_items += 1  # (counted once it came: an empty read is no item of the turn)
            if len(frames) != 2:
                self.rejects.reject("malformed", f"expected 2 frames, got {len(frames)}", frames[0])
                continue
            identity, payload = frames
            try:
                msg = self.decoder.decode(payload)
            except WireError as err:
                if sock is self.reward_sock and err.reason == "invalid_field" and err.field.startswith("scores["):
                    self._on_partly_bad_scores(identity, payload)
                else:
                    self.rejects.reject(err.reason, str(err), identity)
                continue
            self._handle(sock, identity, msg)

    def _handle(self, sock: zmq.Socket, identity: bytes, msg: Message) -> None:
        from_generator = sock is self.gen_sock
        if isinstance(msg, ChunkBatch) and from_generator:
            self._turn_items += len(msg.chunks)
            self._on_chunks(identity, msg.chunks)
        elif isinstance(msg, Chunk) and from_generator:
            self._on_chunks(identity, [msg])
        elif isinstance(msg, Heartbeat) and from_generator:
            self._on_heartbeat(identity, msg)
        elif isinstance(msg, Register) and from_generator:
            self._on_register(identity, msg)
        elif isinstance(msg, Release) and from_generator:
            self._on_release(identity, msg)
        elif isinstance(msg, ScoreBatch) and not from_generator:
            self._turn_items += len(msg.scores)
            for score in msg.scores:
                self._on_score(identity, score)
        elif isinstance(msg, Score) and not from_generator:
            self._on_score(identity, msg)
        elif isinstance(msg, RewardRegister) and not from_generator:
            self._on_reward_register(identity, msg)
        else:
            self.rejects.reject("wrong_socket", f"{type(msg).__name__} is not accepted on this port", identity)

    def _flush(self) -> None:
        """Make this turn durable, then tell peers: acks only ever follow the Redis write."""
        self._write_chunk_blobs()
        if len(self._pipe):
            # The learner's version and drop count ride along with the turn's write.
            self._read_learner_state(self._pipe)
            write_started = time.monotonic()
            with WATCHDOG.wait("hub write to Redis", self.cfg.run.watchdog_s):
                *_, version, dropped, claim_floor, to_reap, without_batch = self._pipe.execute()
            self._note_learner_state(version, dropped, claim_floor, to_reap, without_batch)
            self._refreshed = self._turn_started
            if self._acks:
                now = time.monotonic()
                chunks = sum(len(acked) for acked in self._acks.values()) // 3
                self.stats.note_durable(now - self._turn_started, now - write_started, chunks)
        for identity, acked in self._acks.items():
            arr = np.array(acked, dtype=np.int64).reshape(-1, 3)
            msg = ChunkAck(
                group_ids=pack_i64(arr[:, 0]),
                samples=pack_i32(arr[:, 1]),
                seqs=pack_i32(arr[:, 2]),
                rejected=self._rejections.pop(identity, []),
            )
            self._send(self.gen_sock, identity, msg)
        for identity, rejected in self._rejections.items():
            self._send(self.gen_sock, identity, ChunkAck(group_ids=b"", samples=b"", seqs=b"", rejected=rejected))
        self._acks.clear()
        self._rejections.clear()
        for sock, identity, payload in self._outbox:
            self._send_raw(sock, identity, payload)
        self._outbox.clear()

    def _write_chunk_blobs(self) -> None:
        # One blob per group a turn, whatever its samples: a generator's frame holds one chunk
        # of each sample it streams, so blobs per sample cost a name, an encoding and a field per
        # chunk (in-process, a tenth of the hub's time per chunk).
        persisted = 0
        for gid, chunks in self._turn_chunks.items():
            persisted += len(chunks)
            first = chunks[0]
            self._pipe.hset_field(
                self.keys.group_bytes(gid),
                chunk_blob_field(first.lease_id, first.sample, first.seq),
                encode_list(chunks),
            )
        self._turn_chunks.clear()
        if persisted:
            # In the same transaction as the chunks: an audit (tests/chaos) compares it with the
            # acks generators received; a write Redis lost would show as more acks than chunks.
            self._pipe.hincrby(self.keys.counters, "chunks_persisted", persisted)

    def _send(self, sock: zmq.Socket, identity: bytes, msg: Message) -> None:
        self._send_raw(sock, identity, encode(msg))

    def _send_raw(self, sock: zmq.Socket, identity: bytes, payload: bytes) -> None:
        try:
            sock.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError as err:  # peer gone or at its high-water mark: it will resend / expire
            self.stats.rejected[f"send_failed_{err.errno}"] += 1

    def _after_flush(self, sock: zmq.Socket, identity: bytes, msg: Message) -> None:
        self._outbox.append((sock, identity, encode(msg)))

    # ------------------------------------------------------------------ generators

    def _on_register(self, identity: bytes, msg: Register) -> None:
        if identity != msg.generator_id.encode():
            self.rejects.reject(
                "identity_mismatch", f"socket identity {identity!r} != generator_id {msg.generator_id!r}", identity
            )
            return
        now = time.monotonic()
        old = self.generators.get(msg.generator_id)
        if old is None and len(self.generators) >= self.hcfg.max_generators:  # the registry is bounded
            self.rejects.reject(
                "too_many_generators", f"{msg.generator_id!r}: hub.max_generators are registered", identity
            )
            return
        if old is not None:
            # A registration from a known id means the generator restarted: its leases are gone.
            log.info("generator %s re-registered; re-issuing its %d leases", msg.generator_id, len(old.leases))
            for lease_id in list(old.leases):
                self._expire_lease(lease_id, notify=False)
        record = GeneratorRecord(
            generator_id=msg.generator_id, model=msg.model, capacity=msg.capacity, weight_version=msg.weight_version
        )
        # a draining generator registering again (the hub forgot it) gets no lease in the turns
        # before its next heartbeat says it drains
        self.generators[msg.generator_id] = GeneratorInfo(record, identity, now, draining=msg.draining)
        self.stats.registrations += 1
        self._pipe.hset(self.keys.generators, msg.generator_id, pack(record))
        log.info(
            "generator %s registered (capacity %d, weights v%d)", msg.generator_id, msg.capacity, msg.weight_version
        )

    def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        gen = self.generators.get(msg.generator_id)
        if gen is None or gen.identity != identity:
            self.rejects.reject(
                "unregistered_generator", f"heartbeat from {msg.generator_id!r} before Register", identity
            )
            if identity == msg.generator_id.encode():  # e.g. evicted while frozen: let it come back
                again = RegisterAgain(generator_id=msg.generator_id, registration=msg.registration)
                self._after_flush(self.gen_sock, identity, again)
            return
        now = time.monotonic()
        gen.last_seen = now
        if msg.draining and not gen.draining:
            log.info("generator %s is draining: no new leases for it", msg.generator_id)
        gen.draining = msg.draining
        if msg.weight_version != gen.record.weight_version:
            gen.record.weight_version = msg.weight_version
            self._pipe.hset(self.keys.generators, msg.generator_id, pack(gen.record))
        for lease_id in msg.lease_ids:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.record.generator_id == msg.generator_id:
                lease.record.deadline = time.time() + self.hcfg.lease_timeout_s
                lease.confirmed = True
        if gen.leases:
            self._resend_lost_leases(gen, msg.lease_ids, now)

    def _resend_lost_leases(self, gen: GeneratorInfo, listed: list[int], now: float) -> None:
        """Send again the leases of ``gen`` its heartbeat does not list, ``LEASE_LOST_S`` after
        their message went, of which no chunk came: their message was lost on the way."""
        held = set(listed)
        for lease_id in gen.leases:
            lease = self.leases.get(lease_id)
            if lease_id in held or lease is None or lease.confirmed or now - lease.sent_at < LEASE_LOST_S:
                continue
            group = self.groups.get(lease.record.group_id)
            if group is None or any(
                group.samples[s].lease_id == lease_id and (group.samples[s].chunks or group.samples[s].done is not None)
                for s in lease.record.samples
            ):
                lease.confirmed = True  # its chunks came: the generator has it (and has finished it)
                continue
            if lease.resends >= LEASE_RESENDS:
                continue  # lease_timeout_s re-issues it
            lease.resends += 1
            lease.sent_at = now
            # (recovered from Redis, it knows no floor of its own: the one in force now)
            lease.min_version = max(lease.min_version, self.policy.doom_floor(self.learner_version, self.claim_floor))
            self.stats.leases_resent += 1
            log.info("lease %d never reached generator %s: sent again", lease_id, gen.record.generator_id)
            self._after_flush(self.gen_sock, gen.identity, self._lease_message(lease))

    def _on_release(self, identity: bytes, msg: Release) -> None:
        """A generator gave leases back unfinished: re-issue their unfinished samples now."""
        gen = self.generators.get(msg.generator_id)
        if gen is None or gen.identity != identity:
            self.rejects.reject(
                "unregistered_generator", f"release from {msg.generator_id!r} before Register", identity
            )
            return
        released = [i for i in msg.lease_ids if i in gen.leases]
        for lease_id in released:
            self._expire_lease(lease_id, notify=False)
        self.stats.leases_released += len(released)
        log.info("generator %s released %d leases", msg.generator_id, len(released))

    def _on_chunks(self, identity: bytes, chunks: list[Chunk]) -> None:
        """Accept new chunks into the turn's write buffer; ack duplicates; reject strays.

        The hot path of the hub: locals and one pass, no per-chunk Redis call.
        """
        acks = self._acks[identity]
        gen = self.generators.get(identity.decode(errors="replace"))
        if gen is not None and gen.identity == identity:
            gen.last_seen = time.monotonic()  # chunks say it is alive as well as a heartbeat does
        leases, groups, turn_chunks = self.leases, self.groups, self._turn_chunks
        deadline = time.time() + self.hcfg.lease_timeout_s
        stats = self.stats
        max_tokens = self.sampling.max_tokens
        for c in chunks:
            lease = leases.get(c.lease_id)
            if lease is None and c.lease_id in self._revoked_leases:
                self._reject_chunk(identity, c, "revoked_lease", quiet=True)
                continue
            if lease is None or lease.record.group_id != c.group_id or c.sample not in lease.record.samples:
                self._reject_chunk(identity, c, "unknown_lease")
                continue
            if lease.owner != identity:
                self._reject_chunk(identity, c, "not_lease_owner")
                continue
            group = groups[c.group_id]
            sample = group.samples[c.sample]
            seq = c.seq
            if seq in sample.chunks or (sample.done is not None and seq <= (sample.final_seq or 0)):
                stats.duplicates += 1
                acks += (c.group_id, c.sample, seq)  # already durable: the first ack was lost
                continue
            if sample.lease_id != c.lease_id:
                self._reject_chunk(identity, c, "stale_lease")
                continue
            if sample.done is not None:
                self._reject_chunk(identity, c, "seq_after_final")
                continue
            n = len(c.tokens) >> 2
            if sample.tokens + n > max_tokens:  # a generator past its lease: bounded, as all a peer sends
                self._reject_chunk(identity, c, "over_max_tokens")
                continue
            if c.finish_reason is not None or sample.final_seq is not None:
                reason = self._final_chunk_conflict(sample, c)
                if reason:
                    self._reject_chunk(identity, c, reason)
                    continue
            sample.chunks[seq] = c
            sample.tokens += n
            if sample.oldest is None:
                sample.note_chunk_version(c.versions)
                if sample.oldest is not None and sample.oldest < self._doom_floor:
                    self._late_doomed.add(c.group_id)  # leased before the floor rose, its first token after
            turn_chunks[c.group_id].append(c)
            acks += (c.group_id, c.sample, seq)
            stats.chunks_in += 1
            stats.tokens_in += n
            lease.record.deadline = deadline
            if group.state is GroupState.ISSUED:
                group.move(GroupState.GENERATING)
            if c.finish_reason is not None:
                sample.final_seq = seq
            if sample.final_seq is not None and sample.is_complete():
                self._complete_sample(group, c.sample, lease)

    @staticmethod
    def _final_chunk_conflict(sample: SampleAssembly, c: Chunk) -> str | None:
        if c.finish_reason is not None and sample.final_seq is not None:
            return "second_final_chunk"
        if sample.final_seq is not None and c.seq > sample.final_seq:
            return "seq_after_final"
        if c.finish_reason is not None and any(s > c.seq for s in sample.chunks):
            return "seq_after_final"
        return None

    def _reject_chunk(self, identity: bytes, c: Chunk, reason: str, quiet: bool = False) -> None:
        if quiet:  # expected (a revoked lease's last chunks): counted, not logged
            self.stats.rejected[reason] += 1
        else:
            self.rejects.reject(
                reason, f"chunk (group {c.group_id}, sample {c.sample}, seq {c.seq}, lease {c.lease_id})", identity
            )
        self._rejections[identity].append(
            ChunkRejection(group_id=c.group_id, sample=c.sample, seq=c.seq, reason=reason, lease_id=c.lease_id)
        )

    def _complete_sample(self, group: OpenGroup, index: int, lease: ActiveLease) -> None:
        sample = group.samples[index]
        done = sample.complete()
        self._pipe.hset(self.keys.group(group.meta.group_id), sample_field(index), pack(done))
        self.stats.samples_completed += 1
        self.score_queue.append((group.meta.group_id, index))
        if all(group.samples[s].done is not None for s in lease.record.samples):
            self._finish_lease(lease)
        if group.all_done():
            group.move(GroupState.COMPLETE)

    def _finish_lease(self, lease: ActiveLease) -> None:
        del self.leases[lease.lease_id]
        self._pipe.hdel(self.keys.leases, lease.lease_id)
        gen = self.generators.get(lease.record.generator_id or "")
        if gen is not None:
            gen.leases.discard(lease.lease_id)

    # ------------------------------------------------------------------ rewards

    def _on_reward_register(self, identity: bytes, msg: RewardRegister) -> None:
        worker = self.reward_workers.get(identity)
        if worker is None:
            log.info("reward worker %s connected (capacity %d)", msg.worker_id, msg.capacity)
            self.stats.reward_registrations += 1
            self.reward_workers[identity] = RewardWorker(identity, msg.capacity, time.monotonic())
        else:
            worker.capacity, worker.last_seen = msg.capacity, time.monotonic()

    def _on_score(self, identity: bytes, msg: Score) -> None:
        key = (msg.group_id, msg.sample)
        if (worker := self.reward_workers.get(identity)) is not None:
            worker.last_seen = time.monotonic()
        group = self.groups.get(msg.group_id)
        if group is None and msg.group_id in self._dropped_groups:
            self.stats.rejected["score_for_dropped_group"] += 1  # expected: scored while it was dropped
            return
        if (group is None and msg.group_id in self._scored_groups) or (
            group is not None and msg.sample < len(group.samples) and group.samples[msg.sample].score is not None
        ):
            # expected after a re-send: the first answer came late, or a service answered twice
            self.stats.rejected["duplicate_score"] += 1
            return
        if group is None or key not in self.score_asked:
            self.rejects.reject(
                "unexpected_score",
                f"score for (group {msg.group_id}, sample {msg.sample}), which was never asked for",
                identity,
            )
            return
        # An answer to a request that timed out (re-queued, or sent again) is as good as any: the
        # re-queued request is skipped once the sample holds its score, and the credit frees on
        # both the worker answering and the one a re-send went to.
        self.score_asked.discard(key)
        sent = self.score_sent.pop(key, None)
        for holder in {identity, sent[0] if sent is not None else identity}:
            if (owner := self.reward_workers.get(holder)) is not None:
                owner.inflight.discard(key)
        score = StoredScore(reward=msg.reward, breakdown=msg.breakdown, error=msg.error)
        group.samples[msg.sample].score = score
        group.samples[msg.sample].response = None  # scored: the hub no longer needs the tokens
        self.stats.scores_in += 1
        if msg.error is not None:
            self.stats.reward_errors[msg.error.split(":", 1)[0][:32]] += 1
        gid = group.meta.group_id
        self._pipe.hset(self.keys.group(gid), score_field(msg.sample), pack(score))
        if group.all_scored():
            self._group_scored(group)

    def _on_partly_bad_scores(self, identity: bytes, payload: bytes) -> None:
        """A ScoreBatch with a score that fails its check (a breakdown name too long, say): the
        others are taken, and a refused one fails its sample's reward. Refusing the frame would
        refuse every score in it, and the same answer again at each re-send: its group would
        never be ready."""
        msg = self.decoder.decode(payload, check=False)
        assert isinstance(msg, ScoreBatch)
        self._turn_items += len(msg.scores)
        good, bad = msg.split_valid()
        for score in good:
            self._on_score(identity, score)
        for score, err in bad:
            self.rejects.reject(
                err.reason, f"score for (group {score.group_id}, sample {score.sample}): {err}", identity
            )
            if (score.group_id, score.sample) in self.score_asked:
                failed = f"bad_score: the hub refused the reward service's score: {err}"
                self._on_score(
                    identity,
                    Score(
                        worker_id=score.worker_id,
                        group_id=score.group_id,
                        sample=score.sample,
                        reward=self.cfg.reward.error_reward,
                        error=clip_error(failed),
                    ),
                )

    def _group_scored(self, group: OpenGroup) -> None:
        """Every sample has its Score: the group is ready, or dropped when a score failed and
        reward.on_error is drop_group (a failed reward must not train as a real one)."""
        failed = [s.score.error for s in group.samples if s.score is not None and s.score.error is not None]
        self._scored_groups.add(group.meta.group_id)
        if len(self._scored_groups) > 100_000:  # bounded memory: late answers for these are long gone
            self._scored_groups.clear()
        if not failed or self.cfg.reward.on_error == "assign":
            self._mark_ready(group)
            return
        gid = group.meta.group_id
        group.move(GroupState.SCORED)
        group.move(GroupState.DROPPED)
        self._pipe.unlink(self.keys.group(gid))
        self._pipe.srem(self.keys.open, gid)
        self._pipe.hincrby(self.keys.counters, "groups_dropped", 1)  # frees its slot under the staleness bound
        self._pipe.hincrby(self.keys.counters, "groups_dropped_reward", 1)
        self.groups_dropped += 1
        self.stats.groups_dropped_reward += 1
        # issued again, as a stale group's: a failure of the reward service (a worker killed, a
        # reward model restarting) would otherwise spend the prompt for the epoch
        self._requeue(group.meta, "for failed rewards")
        del self.groups[gid]
        log.warning("group %d dropped: %d failed scores (first: %s)", gid, len(failed), failed[0])
        self._reward_drops_here += 1
        if self.stats.groups_ready == 0 and self._reward_drops_here == ALL_FAILED_GROUPS:
            # Said once, loudly: a run whose rewards cannot score its data otherwise spends every
            # prompt and ends having trained nothing, with warnings only.
            log.error(
                "every group scored so far (%d) failed its rewards, first error: %s. The reward functions cannot "
                "score this data: check reward.functions (and their kwargs) against data.metadata_keys and the "
                "dataset's fields",
                ALL_FAILED_GROUPS,
                failed[0],
            )

    def _mark_ready(self, group: OpenGroup) -> None:
        gid = group.meta.group_id
        group.move(GroupState.SCORED)
        group.move(GroupState.READY)
        self._pipe.zadd(self.keys.ready, {str(gid): group.version})
        self._pipe.srem(self.keys.open, gid)
        del self.groups[gid]
        self.stats.groups_ready += 1

    def _expire_scores(self, now: float) -> None:
        for identity, worker in list(self.reward_workers.items()):
            if now - worker.last_seen > self.hcfg.generator_timeout_s:
                log.warning(
                    "reward worker %r silent for %.1fs: dropped, %d samples re-queued",
                    identity,
                    now - worker.last_seen,
                    len(worker.inflight),
                )
                for key in worker.inflight:
                    self.score_sent.pop(key, None)
                    self.score_queue.appendleft(key)
                del self.reward_workers[identity]
        for key, (identity, sent_at) in list(self.score_sent.items()):
            if now - sent_at > self.hcfg.score_timeout_s:
                del self.score_sent[key]
                owner = self.reward_workers.get(identity)
                if owner is not None:
                    owner.inflight.discard(key)
                self.score_queue.appendleft(key)
                self.stats.score_resends += 1

    def _dispatch_scores(self, now: float) -> None:
        # round-robin over the services with credit left, so a burst spreads over all of them
        open_credit = [w for w in self.reward_workers.values() if len(w.inflight) < w.capacity]
        while self.score_queue and open_credit:
            for worker in list(open_credit):
                if not self.score_queue:
                    break
                if len(worker.inflight) >= worker.capacity:
                    open_credit.remove(worker)
                    continue
                gid, index = self.score_queue.popleft()
                group = self.groups.get(gid)
                if group is None or group.samples[index].score is not None:
                    continue
                sample = group.samples[index]
                assert sample.done is not None and sample.response is not None
                req = ScoreRequest(
                    group_id=gid,
                    sample=index,
                    prompt_tokens=group.meta.prompt_tokens,
                    response_tokens=sample.response,
                    finish_reason=sample.done.finish_reason,
                    metadata=group.meta.metadata,
                    prompt_text=group.meta.prompt_text or None,
                )
                worker.inflight.add((gid, index))
                self.score_sent[(gid, index)] = (worker.identity, now)
                self.score_asked.add((gid, index))
                self._after_flush(self.reward_sock, worker.identity, req)

    # ------------------------------------------------------------------ housekeeping

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._refreshed > REFRESH_S:  # idle turns: no write carried the refresh
            self._refresh_learner_state()
        if self._to_reap and now - self._last_reap > REFRESH_S:  # no round trip when none were dropped
            self._last_reap = now
            self._reap_dropped()
        if self.cfg.async_.revoke_stale:
            self._drop_doomed()
        self._note_data_done()
        if now - self._last_expiry >= EXPIRY_S and not self._deaf(now):
            self._last_expiry = now
            self._expire(now)
            self._expire_scores(now)
        if now - self._last_stats >= self.hcfg.stats_interval_s:
            self._last_stats = now
            self._log_stats()

    def _excuse_own_stall(self, since_last_turn: float) -> None:
        """A turn that came long after the last (this process stopped, a Redis call that blocked
        for seconds) heard nobody meanwhile: that time is the hub's silence, not its peers', and
        counts against no one's heartbeat timeout. Only a stall of half a timeout or more: turns
        merely slow (each well under it) must not keep a dead peer's silence from adding up."""
        stalled = since_last_turn - TICK_S
        if stalled >= self.hcfg.generator_timeout_s / 2:
            now = time.monotonic()
            for peer in self._peers():
                peer.last_seen = min(now, peer.last_seen + stalled)

    def _peers(self) -> list[GeneratorInfo | RewardWorker]:
        return [*self.generators.values(), *self.reward_workers.values()]

    def _deaf(self, now: float) -> bool:
        """Whether input is still unread (after a stall, or under a burst): a peer's heartbeat may
        wait in it, and its silence is then the hub's own. Expiry waits for the hub to catch up,
        but no longer than a generator timeout."""
        unread = any(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN for sock in (self.gen_sock, self.reward_sock))
        if not unread:
            self._behind_since = None
            return False
        if self._behind_since is None:
            self._behind_since = now
        return now - self._behind_since < self.hcfg.generator_timeout_s

    def _note_data_done(self) -> None:
        """Tell the learner when nothing more will come: the prompts are spent and no group is
        open (a learner short of a batch then ends its training instead of waiting for good).
        In the turn's transaction, with the reap that may re-queue prompts and so undo it."""
        done = self.source.exhausted(self.epoch) and not self.requeued_prompts and not self.groups
        if done != self._data_done:
            self._data_done = done
            if done:
                self._pipe.set(self.keys.data_done, 1)
                log.info("the prompts are spent (data.epochs %d) and every group issued is done", self.cfg.data.epochs)
            else:
                self._pipe.unlink(self.keys.data_done)

    def _refresh_learner_state(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._read_learner_state(pipe)
        self._note_learner_state(*pipe.execute())
        # (else an idle hub, whose turns write nothing, read Redis every tick, not every REFRESH_S)
        self._refreshed = time.monotonic()

    def _read_learner_state(self, pipe: TurnWrite | redis.client.Pipeline) -> None:
        """Queue the reads ``_note_learner_state`` takes, in its argument order."""
        pipe.get(self.keys.version)
        pipe.hget(self.keys.counters, "groups_dropped")
        pipe.get(self.keys.claim_floor)
        pipe.llen(self.keys.dropped)
        pipe.hget(self.keys.counters, "versions_without_batch")

    def _note_learner_state(
        self,
        version: bytes | None,
        dropped: bytes | None,
        claim_floor: bytes | None,
        to_reap: int,
        versions_without_batch: bytes | None,
    ) -> None:
        self.learner_version = int(version or 0)
        self.versions_without_batch = int(versions_without_batch or 0)
        self.groups_dropped = int(dropped or 0)
        self.claim_floor = int(claim_floor or -1)
        self._to_reap = int(to_reap)

    def _reap_dropped(self) -> None:
        """Clean up groups a learner dropped as too stale; re-queue their prompts if configured.

        The list's head is read here and trimmed in the turn's write, with the UNLINKs and the
        re-queues: popped at once, a hub killed before its write (or a pop retried after a lost
        reply) would forget the groups, leaving their keys in Redis for good. Learners only append."""
        entries = self.redis.lrange(self.keys.dropped, 0, 255)
        self._to_reap = 0  # the turn's write reads the list's length again, after its trim
        if not entries:
            return
        self._pipe.ltrim(self.keys.dropped, len(entries), -1)
        dropped = []
        for entry in entries:
            try:
                dropped.append(dropped_entry(entry))
            except ValueError as err:  # not a learner's: nothing to clean up, and nothing to stop for
                log.error("%s: skipped", err)
        metas = self.redis.pipeline(transaction=False)
        for gid, _ in dropped:
            metas.hget(self.keys.group(gid), META)
        for (gid, handed_back), raw in zip(dropped, metas.execute(), strict=True):
            if raw is not None:
                meta = unpack(GroupMeta, raw)
                if handed_back:  # not the prompt's doing: the attempt is not spent
                    self._requeue(meta, "handed back by a restarted learner", spends_attempt=False)
                else:
                    self._requeue(meta)
            elif self.cfg.async_.requeue_stale:
                log.warning("group %d came back without its prompt: not re-queued", gid)
            self._pipe.unlink(self.keys.group(gid))
        back = sum(handed_back for _, handed_back in dropped)
        if back:
            log.info(
                "%d groups handed back by a restarted learner (claimed, never trained on)%s",
                back,
                ": prompts re-queued" if self.cfg.async_.requeue_stale else "",
            )
        # (debug: it can come 20 times a second for days; the stats line counts the drops)
        log.debug("%d groups dropped as too stale (requeue=%s)", len(dropped) - back, self.cfg.async_.requeue_stale)

    def _drop_doomed(self) -> None:
        """Drop every group still generating that already holds a token older than any claim
        will accept (v - η, or v + 1 - η once the learner has claimed its next batch ahead): the
        learner could only ever drop it at its claim, after the generators had finished it. Its
        leases are revoked at once and the staleness bound admits a fresh group in its place."""
        floor = self.policy.doom_floor(self.learner_version, self.claim_floor)
        if floor > self._doom_floor:  # every group, checked at each version the learner reaches, once
            self._doom_floor = floor
            candidates = list(self.groups.values())
        elif self._late_doomed:  # between those checks, only the groups whose first token came in
            candidates = [g for gid in self._late_doomed if (g := self.groups.get(gid)) is not None]
        else:
            return
        self._late_doomed.clear()
        doomed = [
            g
            for g in candidates
            if g.state is GroupState.GENERATING and (oldest := g.oldest_seen()) is not None and oldest < floor
        ]
        for group in doomed:
            self._drop_generating_group(group)
        if doomed:
            log.debug("%d groups dropped while generating: older than v%d - η (leases revoked)", len(doomed), floor)

    def _drop_generating_group(self, group: OpenGroup) -> None:
        gid = group.meta.group_id
        for lease_id in {s.lease_id for s in group.samples if s.done is None}:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                continue
            self._pipe.hdel(self.keys.leases, lease_id)
            self._revoked_leases.add(lease_id)
            if lease.record.generator_id is None:  # re-issued, not yet given out: no longer waiting
                with contextlib.suppress(ValueError):  # (the gauges count it: active = leases - unassigned)
                    self.unassigned.remove(lease_id)
            gen = self.generators.get(lease.record.generator_id or "")
            if gen is not None:
                gen.leases.discard(lease_id)
                self._after_flush(self.gen_sock, gen.identity, Revoke(lease_ids=[lease_id]))
        for index in range(len(group.samples)):  # samples at the reward service: their credit frees
            self.score_asked.discard((gid, index))
            sent = self.score_sent.pop((gid, index), None)
            worker = self.reward_workers.get(sent[0]) if sent is not None else None
            if worker is not None:
                worker.inflight.discard((gid, index))
        group.move(GroupState.DROPPED)
        del self.groups[gid]
        self._refuse_turn_chunks(gid)
        self._dropped_groups.add(gid)
        self._pipe.unlink(self.keys.group(gid))
        self._pipe.srem(self.keys.open, gid)
        self._pipe.hincrby(self.keys.counters, "groups_dropped", 1)  # frees its slot under the bound
        self._pipe.hincrby(self.keys.counters, "groups_dropped_generating", 1)
        self.groups_dropped += 1
        self.stats.groups_dropped_generating += 1
        self._requeue(group.meta)
        if len(self._dropped_groups) > 100_000:  # bounded memory: late messages for these are long gone
            self._dropped_groups.clear()
            self._revoked_leases.clear()

    def _requeue(self, meta: GroupMeta, why: str = "as too stale", spends_attempt: bool = True) -> None:
        """Issue a dropped group's prompt again, before the cursor advances, unless it has had its
        ``async.max_requeues`` attempts: a prompt whose answers always outlast the bound (or
        always fail their reward) is then skipped and counted, not generated for good. A drop
        that is not the prompt's doing (``spends_attempt`` false) issues it at the same attempt."""
        if not self.cfg.async_.requeue_stale:
            return
        attempt = meta.attempt + int(spends_attempt)
        if attempt > self.cfg.async_.max_requeues:
            self.stats.prompts_abandoned += 1
            self._pipe.hincrby(self.keys.counters, "prompts_abandoned", 1)
            log.warning(
                "prompt %d dropped %s %d times: skipped (async.max_requeues %d)",
                meta.prompt_index,
                why,
                attempt,
                self.cfg.async_.max_requeues,
            )
            return
        self.requeued_prompts.append((meta.prompt_index, attempt))
        self._pipe.rpush(self.keys.requeue, f"{meta.prompt_index}:{attempt}")

    def _refuse_turn_chunks(self, gid: int) -> None:
        """The group is dropped in the turn that accepted these chunks of it. Written after the
        drop's UNLINK, they would bring its key back for good; so they are not written, and not
        acknowledged either: their senders hear ``revoked_lease``, as for any chunk of the group
        from now on."""
        chunks = self._turn_chunks.pop(gid, None)
        if not chunks:
            return
        refused = {(c.sample, c.seq): c.lease_id for c in chunks}
        for identity, acked in self._acks.items():
            kept: list[int] = []
            for i in range(0, len(acked), 3):
                g, sample, seq = acked[i : i + 3]
                if g == gid and (sample, seq) in refused:
                    self._rejections[identity].append(
                        ChunkRejection(
                            group_id=g, sample=sample, seq=seq, reason="revoked_lease", lease_id=refused[(sample, seq)]
                        )
                    )
                else:
                    kept += (g, sample, seq)
            acked[:] = kept
        stats = self.stats
        stats.rejected["revoked_lease"] += len(chunks)
        stats.chunks_in -= len(chunks)  # counted as taken a moment ago: ingest counts what is kept
        stats.tokens_in -= sum(len(c.tokens) >> 2 for c in chunks)

    def _expire(self, now: float) -> None:
        for gen_id, gen in list(self.generators.items()):
            if now - gen.last_seen > self.hcfg.generator_timeout_s and gen.draining and not gen.leases:
                log.info("generator %s drained and left", gen_id)  # a scale-down: nothing to re-issue
                del self.generators[gen_id]
                self._pipe.hdel(self.keys.generators, gen_id)
                self.stats.generators_departed += 1
            elif now - gen.last_seen > self.hcfg.generator_timeout_s:
                log.warning(
                    "generator %s silent for %.1fs: evicted, %d leases re-issued",
                    gen_id,
                    now - gen.last_seen,
                    len(gen.leases),
                )
                for lease_id in list(gen.leases):
                    self._expire_lease(lease_id, notify=False)
                del self.generators[gen_id]
                self._pipe.hdel(self.keys.generators, gen_id)
                self.stats.generators_evicted += 1
        wall = time.time()
        for lease in list(self.leases.values()):
            if lease.record.generator_id is not None and lease.record.deadline < wall:
                log.warning(
                    "lease %d (group %d) on %s passed its deadline: re-issued",
                    lease.lease_id,
                    lease.record.group_id,
                    lease.record.generator_id,
                )
                self._expire_lease(lease.lease_id, notify=True)

    def _expire_lease(self, lease_id: int, notify: bool) -> None:
        """Take a lease back; its unfinished samples go out again under a new lease."""
        lease = self.leases.pop(lease_id)
        self._pipe.hdel(self.keys.leases, lease_id)
        gen = self.generators.get(lease.record.generator_id or "")
        if gen is not None:
            gen.leases.discard(lease_id)
            if notify:
                self._after_flush(self.gen_sock, gen.identity, Revoke(lease_ids=[lease_id]))
        group = self.groups[lease.record.group_id]
        unfinished = [s for s in lease.record.samples if group.samples[s].done is None]
        if not unfinished:
            return
        new = self._new_lease(group.meta.group_id, unfinished)
        for s in unfinished:  # their chunks so far stay in the group's blobs, superseded (chunks_by_sample)
            group.samples[s].restart(new.lease_id)
        self.unassigned.append(new.lease_id)
        self.stats.leases_reissued += 1
        self._pipe.hincrby(self.keys.counters, "leases_reissued", 1)

    def _new_lease(self, group_id: int, samples: list[int]) -> ActiveLease:
        lease = ActiveLease(
            LeaseRecord(
                lease_id=self.next_lease_id,
                group_id=group_id,
                generator_id=None,
                samples=samples,
                sampling=self.sampling,
                deadline=0.0,
            )
        )
        self.next_lease_id += 1
        self._pipe.hset(self.keys.counters, "next_lease_id", self.next_lease_id)
        self.leases[lease.lease_id] = lease
        self._pipe.hset(self.keys.leases, lease.lease_id, pack(lease.record))
        return lease

    def _dispatch_leases(self) -> None:
        self._admission_said_no = False
        self._fill_free_slots()
        self._note_blocked(self._admission_said_no)

    def _fill_free_slots(self) -> None:
        # Weights older than the doom floor (v + 1 - η once the learner claimed its next batch
        # ahead) would make a group no claim accepts: the generator waits for the next sync.
        min_version = self.policy.doom_floor(self.learner_version, self.claim_floor)
        for gen in self.generators.values():
            if gen.record.weight_version < min_version:
                continue  # its weights are too old: it waits for the next sync
            while gen.free_slots() > 0:
                lease = self._next_lease()
                if lease is None:
                    return
                self._assign(lease, gen, min_version)

    def _note_blocked(self, blocked: bool) -> None:
        """Time generators had free slots the staleness bound kept empty (what an autoscaler
        reads as "more generators than the learner can use")."""
        now = time.monotonic()
        if self._blocked_at is not None:
            self.stats.admission_blocked_s += now - self._blocked_at
        self._blocked_at = now if blocked else None

    def _next_lease(self) -> ActiveLease | None:
        while self.unassigned:
            lease = self.leases.get(self.unassigned.popleft())
            if lease is not None:
                return lease
        if not self.policy.may_issue(
            self.groups_issued, self.groups_dropped, self.learner_version, self.versions_without_batch
        ):
            self._admission_said_no = True
            return None
        group = self._issue_group()
        return None if group is None else self._new_lease(group.meta.group_id, list(range(group.meta.n_samples)))

    def _issue_group(self) -> OpenGroup | None:
        for _ in range(SKIPS_PER_ISSUE):  # bounded: a source of nothing but over-long prompts
            attempt = 0
            if self.requeued_prompts:
                (index, attempt), epoch = self.requeued_prompts.popleft(), self.epoch
                self._pipe.lpop(self.keys.requeue)
            else:
                if self.source.exhausted(self.epoch):
                    return None
                index, epoch = self.source.index_at(self.epoch, self.cursor), self.epoch
                self.cursor += 1
                if self.cursor >= len(self.source):
                    self.epoch, self.cursor = self.epoch + 1, 0
                self._pipe.hset(self.keys.source, mapping={"epoch": self.epoch, "cursor": self.cursor})
            prompt = self.source.prompt(index, epoch)
            if prompt is not None:
                return self._open_group(prompt, attempt)
        return None

    def _open_group(self, prompt: Prompt, attempt: int) -> OpenGroup:
        index, epoch = prompt.index, prompt.epoch
        gid = self.groups_issued
        self.groups_issued += 1
        n = self.cfg.data.n_samples_per_prompt
        meta = GroupMeta(
            group_id=gid,
            prompt_index=index,
            epoch=epoch,
            prompt_tokens=prompt.tokens.tobytes(),
            n_samples=n,
            metadata=prompt.metadata,
            issued_at_version=self.learner_version,
            attempt=attempt,
            prompt_text=prompt.text,
        )
        group = OpenGroup(meta, [SampleAssembly(lease_id=-1) for _ in range(n)])
        self.groups[gid] = group
        self._pipe.hset(self.keys.group(gid), META, pack(meta))
        self._pipe.sadd(self.keys.open, gid)
        self._pipe.hset(self.keys.counters, "groups_issued", self.groups_issued)
        return group

    def _assign(self, lease: ActiveLease, gen: GeneratorInfo, min_version: int) -> None:
        rec = lease.record
        rec.generator_id = gen.record.generator_id
        rec.deadline = time.time() + self.hcfg.lease_timeout_s
        lease.owner = gen.identity
        gen.leases.add(rec.lease_id)
        group = self.groups[rec.group_id]
        for s in rec.samples:
            group.samples[s].lease_id = rec.lease_id
        self._pipe.hset(self.keys.leases, rec.lease_id, pack(rec))
        self.stats.leases_issued += 1
        lease.min_version, lease.sent_at, lease.confirmed, lease.resends = min_version, time.monotonic(), False, 0
        self._after_flush(self.gen_sock, gen.identity, self._lease_message(lease))

    def _lease_message(self, lease: ActiveLease) -> Lease:
        rec = lease.record
        return Lease(
            lease_id=rec.lease_id,
            group_id=rec.group_id,
            prompt_tokens=self.groups[rec.group_id].meta.prompt_tokens,
            samples=rec.samples,
            sampling=rec.sampling,
            min_version=lease.min_version,
            deadline=rec.deadline,
        )

    # ------------------------------------------------------------------ stats

    def snapshot(self) -> dict[str, object]:
        s = self.stats
        counters = {
            "chunks_in": s.chunks_in,
            "tokens_in": s.tokens_in,
            "duplicate_chunks": s.duplicates,
            "groups_dropped_generating": s.groups_dropped_generating,
            "gc_collections": s.gc_collections,
            "samples_completed": s.samples_completed,
            "groups_ready": s.groups_ready,
            "scores_in": s.scores_in,
            "score_resends": s.score_resends,
            "leases_issued": s.leases_issued,
            "leases_reissued": s.leases_reissued,
            "leases_released": s.leases_released,
            "leases_resent": s.leases_resent,
            "generators_evicted": s.generators_evicted,
            "generator_registrations": s.registrations,
            "reward_registrations": s.reward_registrations,
            "generators_departed": s.generators_departed,
            "groups_dropped_reward": s.groups_dropped_reward,
            "prompts_abandoned": s.prompts_abandoned,
            "admission_blocked_seconds": s.admission_blocked_s,
            "groups_issued": self.groups_issued,
            "groups_dropped": self.groups_dropped,
            "prompts_truncated": self.source.truncated,
            "prompts_skipped": self.source.skipped,
            "prompts_unusable": self.source.unusable,
            "peers_refused": refused_peers(),  # CURVE handshakes with an unauthorised key
        }
        gauges = {
            "learner_version": self.learner_version,
            "open_groups": len(self.groups),
            "active_leases": len(self.leases) - len(self.unassigned),
            "unassigned_leases": len(self.unassigned),
            "generators": len(self.generators),
            "generators_draining": sum(g.draining for g in self.generators.values()),
            "generator_capacity": sum(g.record.capacity for g in self.generators.values() if not g.draining),
            "reward_workers": len(self.reward_workers),
            "watchdog_overdue": sum(WATCHDOG.overdue.values()),
            "scores_pending": len(self.score_queue) + len(self.score_sent),
            "requeued_prompts": len(self.requeued_prompts),
            "data_epoch": self.epoch,
            "ingest_tokens_per_s": self.ingest_rates["tokens"],
            "ingest_chunks_per_s": self.ingest_rates["chunks"],
            "turn_durable_ms_p50": s.durable_ms(50),
            "turn_durable_ms_p99": s.durable_ms(99),
            "turn_write_ms_p50": s.write_ms(50),
            "turn_write_ms_p99": s.write_ms(99),
            "turn_chunks_p50": s.turn_chunks(50),
            "turn_chunks_p99": s.turn_chunks(99),
            "gc_pause_ms_p99": s.gc_pause_ms(99),
            "gc_pause_ms_max": max(s.gc_pauses_s, default=0.0) * 1000,
            "data_exhausted": int(self.source.exhausted(self.epoch) and not self.requeued_prompts),
        }
        try:
            gauges["ready_groups"] = int(self.redis.zcard(self.keys.ready))
            staleness = {int(k): int(v) for k, v in self.redis.hgetall(self.keys.staleness).items()}
        except redis.RedisError:
            staleness = {}
        return {
            "counters": counters,
            "gauges": gauges,
            "rejected": dict(s.rejected),
            "reward_errors": dict(s.reward_errors),
            "staleness": staleness,
        }

    def _log_stats(self) -> None:
        snap = self.snapshot()
        c, g = snap["counters"], snap["gauges"]
        assert isinstance(c, dict) and isinstance(g, dict)
        rates = self.ingest_rates = self._rates.rates({"tokens": c["tokens_in"], "chunks": c["chunks_in"]})
        hist = snap["staleness"]
        assert isinstance(hist, dict)
        served = sum(hist.values())
        mean_staleness = sum(k * n for k, n in hist.items()) / served if served else 0.0
        log.info(
            "v%d | %.0f tok/s %.0f chunks/s | open %d (scoring %d) ready %s leases %d | issued %d dropped %d reissued %d | served %d, staleness mean %.2f max %s | rejected %s",
            g["learner_version"],
            rates["tokens"],
            rates["chunks"],
            g["open_groups"],
            g["scores_pending"],
            g.get("ready_groups"),
            g["active_leases"],
            c["groups_issued"],
            c["groups_dropped"],
            c["leases_reissued"],
            served,
            mean_staleness,
            max(hist, default=None),
            snap["rejected"] or "{}",
        )


def _port_of(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return int(endpoint.rsplit(":", 1)[1])
