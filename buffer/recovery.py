"""Rebuild the hub's in-memory mirror from Redis: a restarted hub resumes where it died.

Everything acknowledged is in Redis (acks follow the MULTI/EXEC write of their turn), so this
only has to read: counters, the source position, leases, generators, and each open group's
chunks, samples and scores.
"""

from __future__ import annotations

import logging
import time

from buffer.hub import Hub
from buffer.state import ActiveLease, GeneratorInfo, OpenGroup, SampleAssembly
from flywheel.staleness import GroupState
from flywheel.store import (
    META,
    GeneratorRecord,
    GroupMeta,
    LeaseRecord,
    SampleDone,
    StoredScore,
    assemble,
    chunks_by_sample,
    unpack,
)

log = logging.getLogger(__name__)


def load(hub: Hub) -> None:
    r, k = hub.redis, hub.keys
    counters = {key.decode(): int(v) for key, v in r.hgetall(k.counters).items()}
    hub.groups_issued = counters.get("groups_issued", 0)
    hub.groups_dropped = counters.get("groups_dropped", 0)
    hub.next_lease_id = counters.get("next_lease_id", 0)
    # the run's totals, which /metrics reports as such (the other hub counters count this process)
    hub.stats.leases_reissued = counters.get("leases_reissued", 0)
    hub.stats.groups_dropped_generating = counters.get("groups_dropped_generating", 0)
    hub.stats.groups_dropped_reward = counters.get("groups_dropped_reward", 0)
    source = {key.decode(): int(v) for key, v in r.hgetall(k.source).items()}
    hub.epoch, hub.cursor = source.get("epoch", 0), source.get("cursor", 0)
    hub.stats.prompts_abandoned = counters.get("prompts_abandoned", 0)
    hub.requeued_prompts.extend(_requeued(entry) for entry in r.lrange(k.requeue, 0, -1))
    hub.learner_version = int(r.get(k.version) or 0)
    hub.claim_floor = int(r.get(k.claim_floor) or -1)

    now = time.monotonic()
    for raw in r.hvals(k.generators):
        gen_rec = unpack(GeneratorRecord, raw)
        # presumed alive until its heartbeat is overdue; it keeps its socket identity
        hub.generators[gen_rec.generator_id] = GeneratorInfo(gen_rec, gen_rec.generator_id.encode(), now)

    for gid in sorted(int(g) for g in r.smembers(k.open)):
        group = _load_group(hub, gid)
        if group is not None:
            hub.groups[gid] = group

    for raw in r.hvals(k.leases):
        rec = unpack(LeaseRecord, raw)
        if rec.group_id not in hub.groups:
            r.hdel(k.leases, rec.lease_id)
            continue
        hub.leases[rec.lease_id] = ActiveLease(rec)
        for s in rec.samples:
            sample = hub.groups[rec.group_id].samples[s]
            if sample.done is None:
                _keep_lease_chunks(sample, rec.lease_id)
        gen = hub.generators.get(rec.generator_id or "")
        if rec.generator_id is None or gen is None:
            rec.generator_id = None
            hub.unassigned.append(rec.lease_id)
        else:
            gen.leases.add(rec.lease_id)
            hub.leases[rec.lease_id].owner = gen.identity
            # Its generator's next heartbeat lists it, and so extends it, if the generator has
            # it; a lease written but never sent (the hub killed between its write and its
            # send) is listed by none and goes back within the generator timeout, not after
            # the whole lease_timeout_s, its group and the generator's slot held all along.
            rec.deadline = time.time() + hub.hcfg.generator_timeout_s

    # the version of each unfinished sample's first token (its current lease's chunks only), so
    # that a group already too stale is dropped while generating, as it would have been
    for group in hub.groups.values():
        for sample in group.samples:
            if sample.done is None and sample.chunks:
                sample.note_chunk_version(sample.chunks[min(sample.chunks)].versions)

    # groups that were fully scored when the hub died become ready now
    for group in list(hub.groups.values()):
        if group.all_scored():
            hub._group_scored(group)
    hub._flush()
    log.info(
        "recovered: v%d, %d open groups, %d leases, %d generators, %d samples to score, issued %d dropped %d",
        hub.learner_version,
        len(hub.groups),
        len(hub.leases),
        len(hub.generators),
        len(hub.score_queue),
        hub.groups_issued,
        hub.groups_dropped,
    )


def _load_group(hub: Hub, gid: int) -> OpenGroup | None:
    raw = hub.redis.hgetall(hub.keys.group(gid))
    if META not in raw:
        # Lost by Redis itself (an eviction under maxmemory, a hand's DEL): counted as dropped,
        # or it would hold a slot under the staleness bound for the rest of the run.
        log.error("open group %d has no data in Redis (evicted or deleted?): forgotten, counted as dropped", gid)
        pipe = hub.redis.pipeline(transaction=True)
        pipe.srem(hub.keys.open, gid)
        pipe.hincrby(hub.keys.counters, "groups_dropped", 1)
        pipe.hincrby(hub.keys.counters, "groups_lost_in_redis", 1)
        pipe.execute()
        hub.groups_dropped += 1
        return None
    meta = unpack(GroupMeta, raw[META])
    samples = [SampleAssembly(lease_id=-1) for _ in range(meta.n_samples)]
    for field, value in raw.items():
        kind, _, rest = field.partition(b":")
        if kind == b"s":
            done = samples[int(rest)].done = unpack(SampleDone, value)
            samples[int(rest)].lease_id = done.lease_id
            samples[int(rest)].final_seq = done.n_chunks - 1
        elif kind == b"r":
            samples[int(rest)].score = unpack(StoredScore, value)
    # a finished sample's chunks are its SampleDone's lease's, as the learner reads them
    stored = chunks_by_sample(raw, {i: s.done.lease_id for i, s in enumerate(samples) if s.done is not None})
    for index, sample in enumerate(samples):
        chunks = stored.get(index, {})
        if sample.done is not None:
            # read by the staleness check, which revokes old groups; a sample with no token has
            # no version (its stored 0 is none), as the live hub never set one from it
            sample.oldest = sample.done.version if sample.done.n_tokens else None
            if sample.score is None:  # complete but unscored: score it again
                sample.response = assemble(chunks, sample.done.n_chunks).tokens
                hub.score_queue.append((gid, index))
            continue
        sample.chunks = chunks
        sample.tokens = sum(len(c.tokens) >> 2 for c in chunks.values())
        for chunk in chunks.values():
            sample.lease_id = chunk.lease_id
            if chunk.finish_reason is not None:
                sample.final_seq = chunk.seq
    group = OpenGroup(meta, samples)
    if any(s.done is not None or s.chunks for s in samples):
        group.move(GroupState.GENERATING)
        if group.all_done():
            group.move(GroupState.COMPLETE)
    return group


def _keep_lease_chunks(sample: SampleAssembly, lease_id: int) -> None:
    """An unfinished sample's chunks are its current lease's only: one re-issued before the hub
    died may have stored chunks of an earlier lease and none yet of its new one."""
    sample.lease_id = lease_id
    if any(c.lease_id != lease_id for c in sample.chunks.values()):
        sample.chunks = {q: c for q, c in sample.chunks.items() if c.lease_id == lease_id}
        finals = [c.seq for c in sample.chunks.values() if c.finish_reason is not None]
        sample.final_seq = finals[0] if finals else None
        # and its token count the kept chunks' (the earlier lease's would count against
        # rollout.max_tokens, refusing the new lease's chunks as over it)
        sample.tokens = sum(len(c.tokens) >> 2 for c in sample.chunks.values())


def prompt_order_changed(hub: Hub) -> str | None:
    """Why the run's prompt position no longer means what it did, or None (and then the order it
    counts in is recorded, for the next hub). The position (epoch, cursor) counts rows of an
    order that the data and ``data.seed`` / ``data.shuffle`` make: a restart with other data, or
    another seed, went on from the same cursor in another order, repeating some prompts and
    skipping others in silence, and one with fewer rows than the cursor crashed at every
    restart. A run that has issued nothing yet may change them."""
    cfg = hub.cfg.data
    now = {"order_rows": len(hub.source), "order_seed": cfg.seed, "order_shuffle": int(cfg.shuffle)}
    raw = hub.redis.hgetall(hub.keys.source)
    was = {key.decode(): int(v) for key, v in raw.items() if key.decode() in now}
    began = hub.epoch > 0 or hub.cursor > 0 or hub.groups_issued > 0
    if began and was and was != now:
        names = {"order_rows": "rows", "order_seed": "data.seed", "order_shuffle": "data.shuffle"}
        diff = ", ".join(f"{names[k]} {was.get(k)} -> {now[k]}" for k in now if was.get(k) != now[k])
        return (
            f"the prompts of run {hub.cfg.run.name!r} changed since it began ({diff}): its position (epoch "
            f"{hub.epoch}, row {hub.cursor} of that epoch's order) would repeat some prompts and skip others. "
            "Resume with the data and data.seed / data.shuffle it began with, or start a new run (another "
            "--run.name; `flywheel run` without train.resume sets the old one aside)"
        )
    hub.redis.hset(hub.keys.source, mapping=now)
    return None


def _requeued(entry: bytes) -> tuple[int, int]:
    """A re-queued prompt's (index, attempt), from ``INDEX:ATTEMPT`` (a bare index: attempt 1)."""
    index, _, attempt = entry.partition(b":")
    return int(index), int(attempt or 1)
