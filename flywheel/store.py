"""The Redis layout of a run: key names, stored records, and the atomic claim script.

Shared by the hub (the writer) and the learner's batch client (the consumer). Layout, with
``R`` the run name:

    fw:{R}:version        learner policy version v (written by the learner)
    fw:{R}:counters       hash: groups_issued, groups_dropped, groups_consumed, leases_reissued, ...
    fw:{R}:ready          zset: group id -> group version (scored groups waiting for a learner)
    fw:{R}:consumed       bitmap: bit gid set once the group was served (never twice)
    fw:{R}:staleness      hash: staleness -> groups served with it
    fw:{R}:dropped        list: ids of groups dropped as too stale, for the hub to clean up
    fw:{R}:open           set: ids of groups issued but not yet ready (rebuilt on hub restart)
    fw:{R}:leases         hash: lease id -> LeaseRecord
    fw:{R}:generators     hash: generator id -> GeneratorRecord
    fw:{R}:source         hash: epoch, cursor (prompt source position)
    fw:{R}:requeue        list: prompts to issue again before the cursor advances, b"INDEX:ATTEMPT"
    fw:R:g:{R:<gid>}      hash: everything of one group (one key, so one hash slot):
                            meta -> GroupMeta, c:<sample>:<seq> -> [Chunk, ...] (chunks of one
                            sample accepted in one hub turn: the only copy of its tokens),
                            s:<sample> -> SampleDone (the sample is complete),
                            r:<sample> -> StoredScore

Run-level keys share the hash tag ``{R}`` so the claim script touches one slot; each group's
data is one key with its own tag, so a Redis Cluster can spread groups over shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import msgspec

from flywheel.wire import Chunk, SamplingParams

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig


class RunKeys:
    """Key names of one run."""

    def __init__(self, run: str) -> None:
        tag = f"fw:{{{run}}}"
        self.run = run
        self.version = f"{tag}:version"
        self.counters = f"{tag}:counters"
        self.ready = f"{tag}:ready"
        self.consumed = f"{tag}:consumed"
        self.staleness = f"{tag}:staleness"
        self.dropped = f"{tag}:dropped"
        self.open = f"{tag}:open"
        self.leases = f"{tag}:leases"
        self.generators = f"{tag}:generators"
        self.source = f"{tag}:source"
        self.requeue = f"{tag}:requeue"
        self.claim_floor = f"{tag}:claim_floor"  # the oldest version the newest claim accepted
        self.finish_at = f"{tag}:finish_at"  # the step a finish request ends training at (FINISH_SCRIPT)
        self.settings = f"{tag}:settings"  # the hub's SHARED_SETTINGS, which the learner's must equal
        # set by the hub while its prompts are spent (data.epochs) and no group is left open
        self.data_done = f"{tag}:data_done"
        self._tag = tag
        self._group_prefix = f"fw:{run}:g:{{{run}:"
        self._group_prefix_bytes = self._group_prefix.encode()

    def claimed(self, owner: str) -> str:
        """The groups ``owner`` (a learner rank) claimed and has not yet trained on."""
        return f"{self._tag}:claimed:{owner}"

    def claim_receipt(self, claim_id: str) -> str:
        """A claim's reply, kept for its retries (CLAIM_SCRIPT); expires."""
        return f"{self._tag}:claim:{claim_id}"

    def claim_done(self, claim_id: str) -> str:
        """Marks a claimed batch counted as finished (FINISHED_SCRIPT); expires."""
        return f"{self._tag}:done:{claim_id}"

    def group(self, group_id: int) -> str:
        return f"{self._group_prefix}{group_id}}}"

    def group_bytes(self, group_id: int) -> bytes:
        """``group``, encoded (the hub's hot path packs its commands from bytes)."""
        return b"%b%d}" % (self._group_prefix_bytes, group_id)

    def all_run_keys(self) -> list[str]:
        return [
            self.version,
            self.counters,
            self.ready,
            self.consumed,
            self.staleness,
            self.dropped,
            self.open,
            self.leases,
            self.generators,
            self.source,
            self.requeue,
            self.claim_floor,
            self.finish_at,
            self.settings,
        ]


# Hash fields inside a group key.
META = b"meta"

# An entry of the run's ``dropped`` list is a group id ("17": dropped as too stale by a claim), or
# a group id and this mark ("17:back"): claimed by a learner that died before training on it, and
# handed back at its restart. The hub issues both prompts again (async.requeue_stale); only the
# first spends one of the prompt's async.max_requeues attempts, since the second says nothing
# about the prompt.
HANDED_BACK = "back"


def dropped_entry(raw: bytes | str) -> tuple[int, bool]:
    """A ``dropped`` list entry: (group id, handed back by a restarted learner)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    gid, sep, mark = text.partition(":")
    if not (gid.isascii() and gid.isdigit()) or (sep and mark != HANDED_BACK):
        raise ValueError(f"dropped list entry {text[:40]!r} is neither GROUP_ID nor GROUP_ID:{HANDED_BACK}")
    return int(gid), mark == HANDED_BACK


def chunk_blob_field(lease_id: int, sample: int, first_seq: int) -> bytes:
    """One field per (group, hub turn): the group's chunks accepted in that turn, all samples.

    Named by its first chunk's (lease, sample, seq), which no other blob holds (each chunk is
    stored once), so names never collide, not even with a re-issued sample's, whose seqs start
    again at 0 under a new lease.
    """
    return b"c:%d:%d:%d" % (lease_id, sample, first_seq)


def sample_field(sample: int) -> bytes:
    return b"s:%d" % sample


def score_field(sample: int) -> bytes:
    return b"r:%d" % sample


class GroupMeta(msgspec.Struct, kw_only=True, gc=False):
    """What the hub knows about a group when it issues it."""

    group_id: int
    prompt_index: int  # position in the prompt source (to re-queue it)
    epoch: int
    prompt_tokens: bytes  # packed int32
    n_samples: int
    metadata: dict[str, str | int | float | bool | None]
    issued_at_version: int  # learner version when the group was issued
    attempt: int = 0  # how many times the prompt was issued before, each dropped as too stale
    prompt_text: str = ""  # the prompt as the dataset gave it (buffer.prompts.prompt_text)


class SampleDone(msgspec.Struct, kw_only=True, gc=False):
    """Marks a sample complete. Its tokens stay in its chunk blobs: written once, never copied."""

    finish_reason: str
    lease_id: int  # the lease whose chunks make up the sample
    n_chunks: int  # chunks 0..n_chunks-1, the last one carrying finish_reason
    n_tokens: int
    version: int  # oldest token version


class AssembledSample(msgspec.Struct, kw_only=True, gc=False):
    tokens: bytes  # packed int32
    logprobs: bytes  # packed float32
    versions: bytes  # packed int32


def assemble(chunks: dict[int, Chunk], n_chunks: int) -> AssembledSample:
    """Concatenate chunks 0..n_chunks-1 in sequence order (they may have arrived out of order)."""
    missing = [seq for seq in range(n_chunks) if seq not in chunks]
    if missing:
        raise ValueError(f"sample incomplete: chunks {missing[:8]} of 0..{n_chunks - 1} are missing")
    ordered = [chunks[seq] for seq in range(n_chunks)]
    return AssembledSample(
        tokens=b"".join(c.tokens for c in ordered),
        logprobs=b"".join(c.logprobs for c in ordered),
        versions=b"".join(c.versions for c in ordered),
    )


def chunks_by_sample(raw: dict[bytes, bytes], done_leases: dict[int, int] | None = None) -> dict[int, dict[int, Chunk]]:
    """Decode every chunk blob of a group hash: sample -> seq -> chunk, of one lease each. A
    re-issued sample's earlier chunks stay in the group's blobs beside other samples' (they are
    dropped with the group). A finished sample's are its ``SampleDone.lease_id``'s
    (``done_leases``); an unfinished one's, its newest lease's (lease ids only grow), whatever
    order the fields come in."""
    out: dict[int, dict[int, Chunk]] = {}
    lease_of: dict[int, int] = {}
    done_leases = done_leases or {}
    for name, value in raw.items():
        if name.startswith(b"c:"):
            for chunk in unpack_chunks(value):
                s, lease = chunk.sample, chunk.lease_id
                done = done_leases.get(s)
                if done is not None:
                    if lease == done:
                        out.setdefault(s, {})[chunk.seq] = chunk
                    continue
                newest = lease_of.get(s, -1)
                if lease > newest:
                    lease_of[s] = lease
                    out[s] = {}
                elif lease < newest:
                    continue  # an earlier lease's, superseded
                out[s][chunk.seq] = chunk
    return out


class StoredScore(msgspec.Struct, kw_only=True, gc=False):
    reward: float
    breakdown: dict[str, float] = {}
    error: str | None = None


class LeaseRecord(msgspec.Struct, kw_only=True, gc=False):
    lease_id: int
    group_id: int
    generator_id: str | None  # None while waiting for a generator (re-issued)
    samples: list[int]
    sampling: SamplingParams
    deadline: float


class GeneratorRecord(msgspec.Struct, kw_only=True, gc=False):
    generator_id: str
    model: str
    capacity: int
    weight_version: int


_enc = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def pack(record: msgspec.Struct) -> bytes:
    return _enc.encode(record)


T = TypeVar("T")


def unpack(kind: type[T], data: bytes) -> T:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return dec.decode(data)


_chunk_list = msgspec.msgpack.Decoder(list[Chunk])


def unpack_chunks(data: bytes) -> list[Chunk]:
    return _chunk_list.decode(data)


# A learner starting from a checkpoint: every group claimed before it and never trained on
# (claimed by a learner that died, its batch and the one it claimed ahead) is released to
# admission, counted as dropped; otherwise each learner restart would shrink the admission
# window (issued - dropped < (v + η + 1) · groups_per_step) by what it lost, for good.
#
# KEYS: counters
# Returns the number of groups released.
RELEASE_UNTRAINED_SCRIPT = """
local consumed = tonumber(redis.call('HGET', KEYS[1], 'groups_consumed') or '0')
local finished = tonumber(redis.call('HGET', KEYS[1], 'groups_finished') or '0')
local lost = consumed - finished
if lost > 0 then
  redis.call('HINCRBY', KEYS[1], 'groups_dropped', lost)
  redis.call('HINCRBY', KEYS[1], 'groups_lost_with_learner', lost)
  redis.call('HSET', KEYS[1], 'groups_finished', consumed)
  return lost
end
return 0
"""

# A claimed group the learner has read: its data goes (UNLINK: a large hash is freed off Redis's
# main thread, where the hub's writes wait), its prompt stays until the group is trained on, to
# go back to the hub if the learner dies first. One key, one script: however the learner dies,
# the group keeps its prompt, and a repeat changes nothing.
#
# KEYS: the group
KEEP_PROMPT_SCRIPT = """
local meta = redis.call('HGET', KEYS[1], 'meta')
redis.call('UNLINK', KEYS[1])
if meta then
  redis.call('HSET', KEYS[1], 'meta', meta)
end
return 0
"""

# At a learner's start, after RELEASE_UNTRAINED_SCRIPT: how many versions hold no trained batch.
# Admission bounds the groups in flight by (v + η + 1) · groups_per_step, which holds only while
# the groups trained number v · groups_per_step; a learner resumed behind the published version
# continues one version past it (a version names one set of weights), and one resumed on a
# Redis that lost the run's counters starts at its checkpoint's version with none trained. The
# hub takes these versions off v when it admits, or each such start would keep one more batch
# in flight for the rest of the run.
VERSIONS_WITHOUT_BATCH_SCRIPT = """
local c = redis.call('HMGET', KEYS[1], 'groups_finished', 'groups_filtered_out', 'groups_lost_with_learner')
local trained = tonumber(c[1] or '0') - tonumber(c[2] or '0') - tonumber(c[3] or '0')
local skipped = tonumber(ARGV[1]) - math.floor(trained / tonumber(ARGV[2]))
if skipped < 0 then skipped = 0 end
redis.call('HSET', KEYS[1], 'versions_without_batch', skipped)
return skipped
"""

# A learner done with a claimed batch counts it once, however often the call is retried (a
# reply lost to a Redis restart): the first call sets the claim's ``done`` marker, a repeat
# finds it and counts nothing. Counted twice, ``groups_finished`` would hide a learner's lost
# claims from RELEASE_UNTRAINED_SCRIPT, and ``groups_dropped`` would widen admission past η.
#
# KEYS: counters, done marker
# ARGV: n_groups, trained (0/1), marker_ttl_s
# Returns 1 if counted now, 0 if an earlier call already had.
FINISHED_SCRIPT = """
if not redis.call('SET', KEYS[2], 1, 'NX', 'EX', tonumber(ARGV[3])) then
  return 0
end
local n = tonumber(ARGV[1])
redis.call('HINCRBY', KEYS[1], 'groups_finished', n)
if ARGV[2] == '0' then
  redis.call('HINCRBY', KEYS[1], 'groups_dropped', n)
  redis.call('HINCRBY', KEYS[1], 'groups_filtered_out', n)
end
return 1
"""

# A request to end training early (``flywheel finish``): every learner rank stops once its
# version reaches the step stored here, saves its checkpoint and exports, as at
# ``train.total_steps``. The step is at least the published version + 2, so that no rank has
# begun it when the request lands: ranks move in lockstep, within a step of the version rank 0
# published, and each rank reads the key before every step. An earlier request already stored
# stands; a later one cannot postpone it.
#
# KEYS: version, finish_at
# ARGV: the step asked for (0: as soon as possible)
# Returns the step training ends at.
FINISH_SCRIPT = """
local earliest = tonumber(redis.call('GET', KEYS[1]) or '0') + 2
local at = math.max(tonumber(ARGV[1]), earliest)
local stored = tonumber(redis.call('GET', KEYS[2]) or '-1')
if stored >= 0 and stored <= at then
  return stored
end
redis.call('SET', KEYS[2], at)
return at
"""

# Atomically: drop every ready group older than v - η, then pop the n oldest remaining ready
# groups (or none if fewer than n are ready), mark each consumed in the bitmap (refusing any
# group served before), and count the staleness of what was served.
#
# Retried safely: a claim that popped groups stores its reply under its receipt key (a token
# the client picks once per claim), and the same claim made again (a reply lost to a Redis
# restart, then retried) returns that reply instead of popping a second batch, which would
# leave the first consumed, never trained on, and its data in Redis for good. The claimed groups
# also join the claiming rank's ``claimed`` set until it has trained on them, so that a learner
# dying in between leaves nothing behind and loses no prompt (``BatchClient.release_claimed``).
#
# KEYS: ready, counters, consumed, staleness, dropped, claim_floor, receipt, claimed
# ARGV: n, learner_version, max_staleness, receipt_ttl_s
# Returns {dropped_count, {gid1, version1, gid2, version2, ...}}
CLAIM_SCRIPT = """
local receipt = redis.call('GET', KEYS[7])
if receipt then
  return cmsgpack.unpack(receipt)
end
local n = tonumber(ARGV[1])
local v = tonumber(ARGV[2])
local floor = v - tonumber(ARGV[3])
-- Remembered for the hub: a group older than this can no longer be claimed, ready or not
-- (a learner claiming ahead claims for v + 1 while it still publishes v).
if floor > tonumber(redis.call('GET', KEYS[6]) or '-1') then
  redis.call('SET', KEYS[6], floor)
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. floor)
for _, gid in ipairs(stale) do
  redis.call('ZREM', KEYS[1], gid)
  redis.call('RPUSH', KEYS[5], gid)
end
if #stale > 0 then
  redis.call('HINCRBY', KEYS[2], 'groups_dropped', #stale)
end
if redis.call('ZCARD', KEYS[1]) < n then
  return {#stale, {}}
end
-- Every check before the first write of the claim: Redis does not roll a script back, and an
-- error after the pop would leave groups popped and marked consumed that nobody holds.
local head = redis.call('ZRANGE', KEYS[1], 0, n - 1)
for _, gid in ipairs(head) do
  if redis.call('GETBIT', KEYS[3], gid) == 1 then
    return redis.error_reply('group ' .. gid .. ' was already consumed')
  end
end
local popped = redis.call('ZPOPMIN', KEYS[1], n)
for i = 1, #popped, 2 do
  redis.call('SETBIT', KEYS[3], popped[i], 1)
  redis.call('HINCRBY', KEYS[4], tostring(v - tonumber(popped[i + 1])), 1)
  -- one at a time: unpack() of thousands of ids fails ("too many results to unpack")
  redis.call('SADD', KEYS[8], popped[i])
end
redis.call('HINCRBY', KEYS[2], 'groups_consumed', n)
redis.call('SET', KEYS[7], cmsgpack.pack({#stale, popped}), 'EX', tonumber(ARGV[4]))
return {#stale, popped}
"""


# Settings the hub and the learner each read from their own configuration, which must agree: the
# admission bound and the claims (max_staleness, groups_per_step), the group size the advantages
# compare, and the sampling the learner's log-probabilities and Dr. GRPO's budget assume. The hub
# publishes its own at start (``fw:{run}:settings``); a learner that disagrees refuses to start.
SHARED_SETTINGS = (
    "async.max_staleness",
    "async.groups_per_step",
    "data.n_samples_per_prompt",
    "rollout.temperature",
    "rollout.max_tokens",
)


def shared_settings(cfg: FlywheelConfig) -> dict[str, str]:
    """``SHARED_SETTINGS`` of ``cfg``, as the strings the hub publishes."""
    sections = {"async": cfg.async_, "data": cfg.data, "rollout": cfg.rollout}
    out = {}
    for key in SHARED_SETTINGS:
        section, field = key.split(".")
        out[key] = repr(getattr(sections[section], field))
    return out


def settings_disagree(published: dict[bytes, bytes], cfg: FlywheelConfig) -> list[str]:
    """What of ``cfg`` differs from the hub's published settings (none published: nothing)."""
    theirs = {k.decode(): v.decode() for k, v in published.items()}
    return [
        f"{key} is {mine} here but {theirs[key]} at the run's hub: pass --{key} {theirs[key]} (or start the hub with yours)"
        for key, mine in shared_settings(cfg).items()
        if key in theirs and theirs[key] != mine
    ]
