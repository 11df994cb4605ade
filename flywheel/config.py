"""The one typed config tree of a Flywheel run.

Loaded from a YAML recipe plus dotted command-line overrides (``--async.max_staleness 4``).
Unknown keys are rejected with the nearest valid name. Each service reads its own section plus
the shared ones (``run``, ``redis``, ``async``). Importing this module never imports torch.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1: `--async.max_staleness true` would run at 1
        if isinstance(value, bool) and info.field_name and _is_numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"a number is wanted here, not the boolean {str(value).lower()}")
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, bool) and _string_literal(annotation):
            # a recipe's `appendfsync: no`: YAML 1.1 reads no/off and yes/on as booleans, so back
            # to the word the recipe wrote, where the field takes it
            allowed = typing.get_args(annotation)
            for word in ("yes", "on", "true") if value else ("no", "off", "false"):
                if word in allowed:
                    return word
        return value


def _is_numeric(annotation: Any) -> bool:
    """int, float, or either of them optional (a bool field is not numeric)."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(a in (int, float) for a in args)


class RunConfig(_Section):
    """Identity of a run: every Redis key of the run lives under its name."""

    name: str = Field(
        "flywheel", description="Run name; the Redis key prefix is fw:<name>. Letters, digits, '_', '-', '.'."
    )
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the model built from code (launch.tiny_model) and of the warm start (data order: data.seed).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Logging level of every service."
    )
    watchdog_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="Report (a log line and the watchdog/overdue metric) any blocking wait longer than this: a "
        "batch claim, a weight sync, a checkpoint, a hub write to Redis, a generator's weight update.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_key_safe(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", v):
            raise ValueError(
                "run.name must be 1-64 characters of letters, digits, '_', '-', '.', starting with a letter or "
                "digit (it becomes a Redis key prefix and the run's directory name)"
            )
        return v


class RedisConfig(_Section):
    """Where the hub's durable state lives."""

    url: str | None = Field(
        None,
        description="redis:// URL of an existing server. Unset: the launcher starts a private redis-server (AOF on).",
    )
    dir: str | None = Field(
        None,
        description="Data directory of the private server flywheel run starts (AOF files). Unset: <run_dir>/redis. "
        "A previous run's data found there is moved to <redis.dir>.1 (.2, ...) unless train.resume is set.",
    )
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "everysec",
        description="AOF fsync policy of a private server. everysec: a crash of Redis itself (or of its machine) "
        "can lose about the last second of writes, acknowledged chunks included; always: none, each write waits "
        "for its fsync.",
    )
    aof_rewrite_min_mb: int = Field(
        1024,
        ge=64,
        le=1 << 20,
        description="A private server rewrites its AOF only once the file has reached this size (Redis's "
        "auto-aof-rewrite-min-size; its default is 64). Each rewrite forks Redis and writes the dataset again "
        "beside the running hub: at 2M tokens/s, 64 MB meant a rewrite every 2 s and twice the p99 chunk ack "
        "latency (docs/performance.md). The cost: up to about this much AOF on disk, read again when Redis "
        "restarts (about 0.4 s per GB measured here).",
    )
    socket_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Timeout of every Redis call; a hung Redis raises instead of blocking forever."
    )
    connect_timeout_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a service waits for Redis to answer at start-up; the learner also retries this long "
        "through a Redis outage mid-run.",
    )
    username: str | None = Field(
        None, description="Redis ACL user (unset: the default user). A private server gets this user, all rights."
    )
    password_file: str | None = Field(
        None,
        description="File holding the Redis password (AUTH): every client sends it; a private server requires it. "
        "Kept out of flags, URLs and logs; a password in redis.url (redis://user:pass@host:port/0) works too.",
    )

    @model_validator(mode="after")
    def _one_password(self) -> RedisConfig:
        from urllib.parse import urlsplit

        in_url = self.url is not None and urlsplit(self.url).password is not None
        if in_url and self.password_file is not None:
            raise ValueError("redis.url carries a password and redis.password_file is set: keep one of them")
        if self.username is not None and not in_url and self.password_file is None:
            raise ValueError("redis.username needs a password: set redis.password_file (a file holding it)")
        return self


class DataConfig(_Section):
    """The prompt source the hub leases from."""

    path: str | None = Field(
        None, description="JSONL file, parquet file, or a local HF `datasets` directory (save_to_disk)."
    )
    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = Field(
        "auto", description="Source format; auto picks by suffix / directory."
    )
    input_key: str = Field(
        "prompt", description="Field holding the prompt text (or a list of chat messages when apply_chat_template)."
    )
    metadata_keys: list[str] = Field(
        default_factory=lambda: ["answer"],
        description="Fields passed through to the reward service (e.g. the reference answer). Missing ones are skipped.",
    )
    tokenizer: str | None = Field(
        None, description="HF tokenizer path used to tokenize prompts. Required when data.path is set."
    )
    apply_chat_template: bool = Field(
        False, description="Format each prompt with the tokenizer's chat template before tokenizing."
    )
    max_prompt_tokens: int = Field(
        1024, ge=1, le=1 << 20, description="Longest prompt, in tokens (chat template included): see overlong_prompts."
    )
    overlong_prompts: Literal["skip", "truncate_left"] = Field(
        "skip",
        description="A prompt longer than max_prompt_tokens is skipped (counted: prompts_skipped), or cut to its "
        "last max_prompt_tokens tokens (prompts_truncated), which loses its start: the BOS token and the chat "
        "template's header.",
    )
    epochs: int = Field(1, ge=1, le=100000, description="Passes over the prompt source.")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by data.seed and the epoch).")
    seed: int = Field(0, ge=0, description="Shuffle seed.")
    n_samples_per_prompt: int = Field(
        4, ge=1, le=4096, description="Samples per prompt: one prompt group holds this many."
    )


VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises a lower positive temperature to this (`_MAX_TEMP` in its sampling_params)


class RolloutConfig(_Section):
    """Sampling parameters carried by every lease."""

    max_tokens: int = Field(256, ge=1, le=1 << 20, description="Maximum new tokens per sample.")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Sampling temperature: 0 (greedy) or at least 0.01, as vLLM samples."
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling mass. Must stay 1 for training rollouts: the learner's log-probabilities "
        "are over the whole vocabulary.",
    )
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 (or 0) disables it, as training rollouts need.")
    seed: int | None = Field(
        None,
        ge=0,
        description="Seeded sampling: each request's seed derived from this, its group, sample and attempt, so a "
        "run's rollouts repeat whatever generator takes them. Unset: the engine's RNG (faster: vLLM samples "
        "seeded requests one by one).",
    )

    @field_validator("temperature")
    @classmethod
    def _temperature_vllm_keeps(cls, t: float) -> float:
        if 0 < t < VLLM_MIN_TEMPERATURE:
            raise ValueError(
                f"vLLM raises a temperature below {VLLM_MIN_TEMPERATURE} to {VLLM_MIN_TEMPERATURE} without a word, "
                f"so the generators would sample (and report log-probabilities) at {VLLM_MIN_TEMPERATURE} while the "
                f"learner divides its logits by {t}: every importance ratio would be off. Use 0 (greedy) or at least "
                f"{VLLM_MIN_TEMPERATURE}"
            )
        return t


class AsyncConfig(_Section):
    """How far generation may run ahead of the learner (DESIGN.md: versions and staleness)."""

    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description="η: never train on a sample older than v - η. 0 is exactly synchronous on-policy training.",
    )
    groups_per_step: int = Field(
        8, ge=1, le=1 << 20, description="Prompt groups the learner consumes per optimizer step."
    )
    requeue_stale: bool = Field(
        True,
        description="Re-queue the prompts of groups dropped as too stale, or for failed rewards (reward.on_error "
        "drop_group); otherwise they are skipped.",
    )
    max_requeues: int = Field(
        3,
        ge=0,
        le=1000,
        description="A prompt dropped (too stale, failed rewards) is issued again at most this many times, then "
        "skipped and counted (prompts_abandoned): one whose answers always take longer than the bound, or always "
        "fail their reward, would otherwise take generation time for good.",
    )
    revoke_stale: bool = Field(
        True,
        description="Drop a group the moment its oldest token is more than η versions behind the learner "
        "(or behind the batch it has claimed ahead), revoking the leases still generating it (it could only "
        "ever be dropped at consumption): generators "
        "stop spending time on it and the staleness bound admits a fresh group in its place.",
    )
    sync_every: int = Field(
        1,
        ge=1,
        le=1 << 20,
        description="The learner broadcasts new weights to the generators every this many steps; at most "
        "max_staleness + 1, since only generators whose weights are within the bound get leases.",
    )
    partial_rollout: Literal["keep", "interrupt"] = Field(
        "keep",
        description="New weights mid-generation: keep (pause, update, resume; later tokens get the new version) "
        "or interrupt (abort, update, resubmit with the partial tokens appended to the prompt).",
    )

    @model_validator(mode="after")
    def _syncs_within_the_bound(self) -> AsyncConfig:
        # Between syncs the generators hold weights up to sync_every - 1 versions old, and the hub
        # leases only to generators within η of the learner: past η + 1 none would ever qualify.
        if self.sync_every > self.max_staleness + 1:
            raise ValueError(
                f"async.sync_every {self.sync_every} is more than async.max_staleness + 1 "
                f"({self.max_staleness + 1}): between syncs every generator would hold weights older than "
                "the staleness bound allows, and no group could be leased. Lower async.sync_every or raise "
                "async.max_staleness"
            )
        return self


class HubConfig(_Section):
    """The rollout hub service (flywheel-buffer)."""

    host: str = Field("127.0.0.1", description="Interface the hub binds (use 0.0.0.0 on a cluster).")
    generator_port: int = Field(
        5555,
        ge=0,
        le=65535,
        description="ROUTER port for generators (Register, Heartbeat, Chunk). 0 picks a free port.",
    )
    reward_port: int = Field(5556, ge=0, le=65535, description="ROUTER port for reward workers. 0 picks a free port.")
    metrics_port: int | None = Field(
        9400, ge=0, le=65535, description="Prometheus /metrics HTTP port; null disables it. 0 picks a free port."
    )
    lease_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="A lease with no chunk or heartbeat for this long is re-issued."
    )
    generator_timeout_s: float = Field(
        15.0,
        gt=0,
        le=86400,
        description="A generator silent for this long is presumed dead: its leases are re-issued at once.",
    )
    score_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="A score request unanswered for this long is sent again."
    )
    max_message_bytes: int = Field(
        64 << 20, ge=1024, description="Frames larger than this are rejected (counted as 'oversized')."
    )
    sndhwm: int = Field(10000, ge=0, description="ZMQ send high-water mark, per connected peer (messages).")
    rcvhwm: int = Field(
        10000,
        ge=0,
        description="ZMQ receive high-water mark, per connected peer (messages): the hub may queue up to "
        "peers x rcvhwm messages, each holding up to its 8 KiB read buffer; lower it for large fleets "
        "(bench/load.py runs 1000 generators with 64).",
    )
    max_generators: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="Most generators registered at once: a Register from a new id beyond it is rejected "
        "('too_many_generators') until one leaves. Bounds the hub's per-generator state.",
    )
    max_turn_items: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="Chunks (or other messages) taken per loop turn before its one MULTI/EXEC write: bounds ack latency.",
    )
    stats_interval_s: float = Field(10.0, gt=0, description="How often the hub logs a stats line.")
    reject_log_interval_s: float = Field(
        10.0, gt=0, description="Rejected messages are logged at most once per reason per interval."
    )
    state_file: str | None = Field(
        None, description="Write the bound ports here as JSON once listening (for launchers and tests)."
    )


BUILTIN_REWARDS = (
    "arithmetic",
    "math",
    "exact_match",
    "regex_match",
    "format",
    "length_penalty",
    "length",
    "remote",
    "reward_model",
)
"""The reward service's built-in functions (``reward_service/builtins.py``; a test keeps the two alike):
named here so that a config naming another is refused at once, not by the reward service a minute
into the run."""


class RewardFunctionSpec(_Section):
    """One reward function of the weighted sum the reward service computes."""

    name: str = Field(
        description=f"A built-in ({', '.join(BUILTIN_REWARDS)}) or a user function by import path 'pkg.module:fn'."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of this function in the total reward.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed on every call.")

    @field_validator("name")
    @classmethod
    def _name_is_builtin_or_path(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?", v):
            raise ValueError(f"reward function {v!r} is neither a built-in name nor an import path 'pkg.module:fn'")
        if ":" not in v and v not in BUILTIN_REWARDS:
            close = difflib.get_close_matches(v, BUILTIN_REWARDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown built-in reward function {v!r}: {hint}choose one of {list(BUILTIN_REWARDS)}, or give a "
                "user function as 'pkg.module:fn'"
            )
        return v


class RewardConfig(_Section):
    """The reward service (flywheel-reward)."""

    functions: list[RewardFunctionSpec] = Field(
        default_factory=lambda: [RewardFunctionSpec(name="math")],
        description="Reward functions, summed with their weights. A flag takes a name "
        "(--reward.functions arithmetic) or YAML ('[math, {name: format, weight: 0.1}]').",
    )
    tokenizer: str | None = Field(None, description="HF tokenizer for decoding responses; defaults to data.tokenizer.")
    hub_address: str = Field("tcp://127.0.0.1:5556", description="Hub reward ROUTER address the service connects to.")
    workers: int = Field(2, ge=1, le=512, description="Worker processes that run the reward functions.")
    batch_size: int = Field(32, ge=1, le=65536, description="Most samples in one call of the reward functions.")
    timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Deadline of one call; a worker past it is killed and restarted."
    )
    on_error: Literal["drop_group", "assign"] = Field(
        "drop_group",
        description="A sample whose reward failed (exception, timeout, non-finite): drop its group, or train on it "
        "with reward.error_reward.",
    )
    error_reward: float = Field(0.0, description="Reward of a failed sample when on_error is assign.")
    capacity: int = Field(
        256,
        ge=1,
        le=65536,
        description="Samples in flight to one service (its credit at the hub); enough to cover a round trip at full rate.",
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _names_are_specs(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str | dict) else v
        if isinstance(v, list):
            v = [{"name": x} if isinstance(x, str) else x for x in v]
            if not v:
                raise ValueError("reward.functions needs at least one function, e.g. --reward.functions math")
        return v

    @field_validator("error_reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward.error_reward must be finite")
        return v


class RewardModelConfig(_Section):
    """The reward-model server (flywheel-rm): an HF sequence classifier behind HTTP."""

    model: str | None = Field(
        None, description="HF AutoModelForSequenceClassification path (num_labels 1); required to serve."
    )
    host: str = Field("127.0.0.1", description="Interface the server binds.")
    port: int = Field(8300, ge=0, le=65535, description="HTTP port (0: a free one, written to rm.state_file).")
    state_file: str | None = Field(None, description="JSON file the server writes its bound port to once ready.")
    max_batch: int = Field(64, ge=1, le=65536, description="Most sequences in one forward pass.")
    batch_wait_ms: float = Field(5.0, ge=0, le=10000, description="How long a forward waits to fill its batch.")
    request_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="A /score request not answered by then gets HTTP 503 (a hung forward pass must not hold its "
        "callers for good); /health then reports the server stalled.",
    )
    max_length: int = Field(2048, ge=8, description="Longer prompt + completion texts are truncated (from the left).")
    chat_template: bool = Field(
        False, description="Format (prompt, completion) as a user/assistant chat with the tokenizer's template."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype (auto: bf16 on GPUs, fp32 on CPUs)."
    )


class GeneratorConfig(_Section):
    """A vLLM generator service (flywheel-generator)."""

    model: str | None = Field(
        None, description="HF causal-LM path (a directory or hub name) the generator serves; required."
    )
    id: str | None = Field(None, description="Generator id (its identity at the hub). Unset: <hostname>-<pid>.")
    await_weights: bool = Field(
        False,
        description="Load `model` only for its shape and serve nothing until the learner's first weight sync "
        "(the launcher sets it so that vLLM loads the base model while the warm start trains).",
    )
    hub_address: str = Field("tcp://127.0.0.1:5555", description="Hub generator ROUTER address.")
    capacity: int = Field(8, ge=1, le=65536, description="Leases (prompt groups) generated at once.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM tensor-parallel size (GPUs per generator).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype inside vLLM (auto: bf16 on GPUs, fp32 on CPUs)."
    )
    max_model_len: int | None = Field(None, ge=16, description="Longest prompt + response; unset: the model's.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    cpu_kv_cache_gib: float = Field(
        1.0,
        gt=0,
        le=1024,
        description="KV-cache size on CPUs (VLLM_CPU_KVCACHE_SPACE, which vLLM reads in whole GiB: rounded up, at least "
        "1; the variable set in the environment wins).",
    )
    cpu_reserved_cores: int = Field(
        0,
        ge=0,
        le=1024,
        description="CPUs only: cores vLLM keeps free of model threads (VLLM_CPU_NUM_OF_RESERVED_CPU); 0 measured "
        "fastest on 2 cores.",
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs / compilation (faster start, slower decode).")
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Sequences vLLM batches at once.")
    seed: int = Field(0, ge=0, description="Engine seed (the sampling RNG of requests without a seed: rollout.seed).")
    flush_interval_ms: float = Field(
        20.0, gt=0, le=10000, description="New tokens are streamed to the hub as chunks at this interval."
    )
    heartbeat_s: float = Field(0.5, gt=0, le=600, description="Heartbeat interval to the hub and the learner.")
    resend_after_s: float = Field(
        2.0,
        gt=0,
        le=600,
        description="Resend chunks not acknowledged for this long at least: the timeout follows the measured ack "
        "latency and doubles (up to 8x) while resends go unanswered.",
    )
    drain_timeout_s: float = Field(
        60.0, ge=0, le=86400, description="On SIGTERM: finish held leases for at most this long, then return the rest."
    )
    stall_timeout_s: float = Field(
        300.0,
        ge=0,
        le=86400,
        description="The engine giving no token for this long while requests are in flight and no weight update "
        "pauses it (a wedged engine): the generator exits, for the launcher to restart, instead of holding its "
        "leases with live heartbeats. 0: never.",
    )
    max_weight_bytes: int = Field(
        1 << 40, ge=1, description="Refuse a WeightsReady whose layout is larger than this (guards allocations)."
    )
    ack_log: str | None = Field(
        None,
        description="Append how many chunks each hub ack confirmed to this file (audits: acked vs persisted).",
    )
    standby_file: str | None = Field(
        None,
        description="Start as a spare (the launcher sets it, launch.spare_generators): load the engine, create "
        '<standby_file>.ready, then wait until <standby_file> appears, holding the JSON {"id": ..., "ack_log": '
        "...} of the generator to stand in for; only then connect to the hub and the learner as that generator.",
    )


class SyncConfig(_Section):
    """Weight broadcast from the learner to the generators."""

    host: str = Field(
        "127.0.0.1",
        description="Learner address for the weight sync: it binds its sockets and the rendezvous store here, "
        "generators connect to it.",
    )
    announce_port: int = Field(5557, ge=1, le=65535, description="Learner PUB port (WeightsReady).")
    join_port: int = Field(5558, ge=1, le=65535, description="Learner ROUTER port (SyncJoin, WeightsAck).")
    transport: Literal["auto", "gloo", "nccl", "ipc"] = Field(
        "auto",
        description="How the weights travel: a gloo or nccl broadcast, or ipc (CUDA IPC handles, for a learner and "
        "generators on one GPU, where NCCL refuses two ranks on one device). auto: nccl when CUDA is available, "
        "else gloo; the launcher picks ipc when it must put the learner and the generators on one GPU.",
    )
    bucket_mb: float = Field(
        256.0,
        gt=0,
        le=1 << 20,
        description="Parameters are broadcast in flat buckets of about this many MiB (two buffers of it on each "
        "side). 256 measured best over 0.5B-7B on 2xH200 (bench/weight_sync_gpu.py): fewer, bigger buckets cannot "
        "overlap packing with the transfer.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Deadline of one sync: a generator that has not loaded the weights by then is evicted from "
        "the group (it rejoins at the next sync).",
    )
    member_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A generator not heard from (SyncJoin) for this long leaves the group."
    )
    overlap: bool = Field(
        False,
        description="Send the weights from a background thread while the learner trains the next step (one sync "
        "in flight; costs a copy of the weights in the learner's memory). Off: the step waits for every "
        "generator's ack. No effect at η = 0, where the next batch needs the new weights first.",
    )


class AdvantageConfig(_Section):
    """How a sample's reward becomes per-token advantages."""

    estimator: Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="gae (PPO, needs algo.critic.enabled), grpo (group mean/std), dr_grpo (group mean, no std), "
        "rloo (leave-one-out mean), reinforce_pp (batch-whitened returns), reinforce_pp_baseline (group mean, then whitened).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of token rewards (gae, reinforce_pp).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")


class OffPolicyConfig(_Section):
    """Correction for samples generated by older policies."""

    correction: Literal["decoupled", "tis", "none"] = Field(
        "decoupled",
        description="decoupled: clip around the proximal policy (the learner's weights at the start of the step: "
        "one update per step, so each micro-batch's own forward gives it, no extra forward), times the behaviour "
        "weight prox/behaviour truncated at is_cap; tis: truncated importance sampling alone; none: plain PPO "
        "around the behaviour policy.",
    )
    is_cap: float = Field(2.0, ge=1.0, le=1000, description="Truncation of the behaviour importance weight.")
    cap_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="A behaviour weight above is_cap: truncate counts it as is_cap (truncated importance sampling); "
        "mask gives its token no gradient (AReaL's decoupled PPO, which drops such tokens).",
    )


class LossConfig(_Section):
    """The clipped surrogate."""

    clip_low: float = Field(0.2, gt=0, lt=1, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(
        0.2, gt=0, le=10, description="Ratio clipped above at 1 + clip_high (clip-higher when > clip_low)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual clip c: the loss of a negative advantage is at most c * |A|. Unset: off."
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="token: PPO ratios; sequence: GSPO's length-normalised sequence ratio."
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean (every token weighs the same), seq_mean_token_mean (every sequence), "
        "seq_mean_token_sum_norm (Dr. GRPO: token sum over a constant, sequences x rollout.max_tokens). "
        "Over every data-parallel rank's tokens and sequences.",
    )


class KLConfig(_Section):
    """KL to a frozen reference model."""

    coef: float = Field(0.0, ge=0, le=100, description="KL coefficient; 0 loads no reference model.")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
    in_reward: bool = Field(
        False, description="Subtract the KL from token rewards (PPO style) instead of adding it to the loss."
    )
    reference: str | None = Field(None, description="Reference model path; unset: train.model.")


class CriticConfig(_Section):
    """The value model PPO's gae estimator needs."""

    enabled: bool = Field(False, description="Train a critic (required by algo.advantage.estimator gae).")
    model: str | None = Field(
        None, description="Critic initialisation (a causal-LM path; a value head is added); unset: train.model."
    )
    lr: float = Field(1e-5, gt=0, le=1, description="Critic learning rate (AdamW).")
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO value clipping around the values at the start of the step; null: off."
    )


class AlgoConfig(_Section):
    """The RL algorithm."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimator.")
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig, description="Off-policy correction.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty.")
    entropy_coef: float = Field(0.0, ge=0, le=10, description="Entropy bonus coefficient.")
    dynamic_filtering: bool = Field(
        False,
        description="Skip groups with no advantage signal, as DAPO does: whose rewards are all equal, counting "
        "the samples the engine did not abort (those the advantages compare), or with fewer than two such samples. "
        "A batch with no other group takes no step: the learner logs it and counts it in the next step's "
        "batch/skipped_without_signal.",
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (PPO).")

    @model_validator(mode="after")
    def _clip_settings_need_a_clip(self) -> AlgoConfig:
        """Under ``decoupled`` a step makes one update, so the ratio to the proximal policy (the
        step's own weights) is 1 and never clipped; ``tis`` has no clip. Settings that shape the
        clip would do nothing there, in silence. (Under ``tis`` GSPO's sequence ratio is the
        importance weight itself: it acts.)"""
        correction, loss, default = self.off_policy.correction, self.loss, LossConfig()
        if correction == "none":
            return self
        shaping = ("clip_low", "clip_high", "dual_clip") + (("ratio_level",) if correction == "decoupled" else ())
        moot = [
            f"algo.loss.{name} {getattr(loss, name)}"
            for name in shaping
            if getattr(loss, name) != getattr(default, name)
        ]
        if moot:
            why = (
                "a step makes one update, so the ratio to the proximal policy (the step's own weights) is 1 "
                "and never clipped"
                if correction == "decoupled"
                else "it weighs each token by its capped importance weight, with no clip"
            )
            raise ValueError(
                f"{', '.join(moot)} does nothing under algo.off_policy.correction {correction}: {why}. To clip "
                "around the behaviour policy (PPO, DAPO's clip-higher, dual clip, GSPO), set "
                "--algo.off_policy.correction none; otherwise drop the setting"
            )
        return self


class TrainConfig(_Section):
    """The learner's optimisation."""

    model: str | None = Field(None, description="HF causal-LM path to train (the generators start from the same).")
    total_steps: int = Field(100, ge=1, le=1 << 30, description="Optimizer steps (= policy versions) to train.")
    lr: float = Field(1e-6, gt=0, le=1, description="Peak learning rate (AdamW).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="Schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR / peak LR for linear and cosine schedules.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping.")
    micro_batch_tokens: int = Field(
        16384, ge=16, le=1 << 24, description="Token budget of one forward/backward (sequences are packed up to it)."
    )
    packing: bool | Literal["auto"] = Field(
        "auto",
        description="Padding-free packing of sequences into one row (position ids restart per sequence). auto: "
        "packed with attention kernels that skip the other sequences (flash_attention_2, flex_attention), padded "
        "with sdpa/eager, where a packed row costs a dense mask.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="transformers attention implementation of the trained model."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    batch_timeout_s: float = Field(
        600.0, gt=0, description="How long the learner waits for a batch before it stops with an error."
    )
    checkpoint_dir: str | None = Field(None, description="DeepSpeed checkpoints (plus the version) go here.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every this many steps (0: only at the end).")
    resume: bool = Field(False, description="Resume from the latest checkpoint in checkpoint_dir, if there is one.")
    keep_checkpoints: int = Field(
        3,
        ge=0,
        description="Checkpoints kept in checkpoint_dir, the newest; older ones (and saves a kill left unfinished) "
        "are deleted once a newer one is complete (0: keep all). Each holds the optimizer state: 12 bytes a "
        "parameter with AdamW.",
    )
    standby_file: str | None = Field(
        None,
        description="Start as the standby learner (the launcher sets it, launch.standby_learner): import what a "
        "start imports, create <standby_file>.ready, then wait until <standby_file> appears; only then start "
        "DeepSpeed, resume and train. Redis, the sync ports and the checkpoints are untouched until then.",
    )
    export_dir: str | None = Field(None, description="Save the final policy as an HF checkpoint here.")
    run_dir: str | None = Field(
        None,
        description="Metrics (learner_metrics.jsonl) and wandb files; unset: runs/<run.name> under the working directory.",
    )


class DeepSpeedSection(_Section):
    """DeepSpeed engine settings."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="ZeRO stage: 2 shards optimizer state and gradients, 3 also parameters."
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Training dtype; auto: bf16 on GPUs, fp32 on CPUs."
    )
    offload_optimizer: bool = Field(False, description="Keep optimizer state in CPU memory.")


class TaskConfig(_Section):
    """A synthetic verifiable task generated by code: `flywheel run` writes its prompts and
    evaluates the policy on it before and after training."""

    name: Literal["none", "arithmetic"] = Field(
        "none", description="none: train on data.path; arithmetic: 'What is a + b? Answer:' prompts, built here."
    )
    prompts: int = Field(2000, ge=1, le=10_000_000, description="Training prompts written to the run directory.")
    eval_prompts: int = Field(100, ge=1, le=100_000, description="Prompts of the greedy evaluation (all distinct).")
    max_operand: int = Field(9, ge=1, le=1000, description="Operands are drawn from 0..max_operand.")
    seed: int = Field(0, ge=0, description="Seed of the generated prompts.")


class SftConfig(_Section):
    """Supervised warm start before RL (`flywheel run`): teaches the task's answer format."""

    steps: int = Field(0, ge=0, le=1_000_000, description="Optimizer steps (0: no warm start).")
    lr: float = Field(3e-3, gt=0, le=1, description="Learning rate (AdamW).")
    batch_size: int = Field(64, ge=1, le=65536, description="Examples per step.")
    format_only: bool = Field(
        True,
        description="Train on random answers in the right format (the policy learns the format, not the task: RL "
        "has to learn the rest); false: on the reference answers.",
    )


class SecurityConfig(_Section):
    """Authentication of the ZeroMQ links (flywheel/netsec.py). Every service binds 127.0.0.1 unless its
    host is set (hub.host, sync.host, rm.host)."""

    curve: bool = Field(
        False,
        description="Encrypt and authenticate every ZeroMQ link (hub generator and reward ports, weight-sync "
        "announce and join ports) with CURVE: servers accept only clients whose public key is in "
        "<keys_dir>/authorized.",
    )
    keys_dir: str | None = Field(
        None,
        description="CURVE keys made by `flywheel keys DIR` (server.key, client.key, their .key_secret files, "
        "authorized/). Unset with curve on: flywheel run makes a set in <run_dir>/keys; services need it set.",
    )


ServiceName = Literal["redis", "hub", "reward", "generator", "learner"]


class LaunchConfig(_Section):
    """`flywheel run`: which services it starts, and where the run's files go."""

    launcher: Literal["local", "ray"] = Field("local", description="Processes on this machine, or Ray actors.")
    run_dir: str | None = Field(
        None,
        description="Logs, model, Redis AOF, metrics and the report. Unset: runs/<run.name>. A previous run "
        "found there is moved to <run_dir>.1 (.2, ...) unless train.resume is set.",
    )
    services: list[ServiceName] = Field(
        default_factory=lambda: list(get_args(ServiceName)),
        description="Services to start; leave one out to use a running one (redis.url, reward.hub_address, "
        "generator.hub_address name it).",
    )
    generators: int = Field(1, ge=0, le=1024, description="vLLM generator services started at first.")
    spare_generators: int = Field(
        0,
        ge=0,
        le=64,
        description="Local launcher: vLLM generators started once the fleet is up and held loaded but idle "
        "(generator.standby_file). When a generator dies, a spare takes its id at once and a new spare starts: "
        "the fleet is whole again in about a second instead of a vLLM start-up (minutes on busy CPUs). Each "
        "spare holds a generator's memory (and GPUs) while it waits.",
    )
    standby_learner: bool = Field(
        False,
        description="Local launcher, one learner process: hold a second learner process with torch, DeepSpeed "
        "and the model's code imported (train.standby_file). When the learner dies, it takes over at once and "
        "resumes from the checkpoint: seconds of imports saved from each learner restart. It holds no model "
        "and no GPU memory while it waits.",
    )
    tiny_model: Literal["tiny", "small", "medium", "large", "0.5b"] | None = Field(
        None,
        description="Build a Llama of this size from code (with its tokenizer) when train.model is unset; "
        "flywheel.tiny.SIZES gives the shapes (0.5b: 0.49B parameters, for GPUs).",
    )
    learner_procs: int = Field(1, ge=1, le=1024, description="Learner ranks (data parallel, via torchrun).")
    learner_threads: int = Field(1, ge=1, le=1024, description="OMP threads per learner rank (CPUs).")
    ready_timeout_s: float = Field(600, gt=0, description="Longest a service may take to become ready.")
    job_timeout_s: float = Field(
        86400,
        gt=0,
        description="Longest the launcher's one-off jobs may run: the warm start (sft) and the evaluations "
        "before and after training, which grow with sft.steps and task.eval_prompts.",
    )
    restart: bool = Field(
        True,
        description="Restart a service that dies (kill -9, OOM; not a bad configuration, exit code 2): Redis "
        "from its AOF, the learner from its latest checkpoint (train.checkpoint_every), the others reconnect.",
    )
    max_restarts: int = Field(
        5, ge=0, le=100_000, description="Restarts per service within launch.restart_window_s before the run fails."
    )
    restart_window_s: float = Field(
        3600.0,
        gt=0,
        le=1e9,
        description="How long a restart counts against launch.max_restarts: crashes that far apart, over a run of "
        "days, do not add up to its end.",
    )
    restart_backoff_s: float = Field(
        2.0,
        ge=0,
        le=3600,
        description="A service that crashes within a minute of its last restart waits this long before the next "
        "one, doubled for each such crash in a row (at most 5 minutes); a first crash, or one after a minute up, "
        "restarts at once. 0: no wait.",
    )
    display: bool = Field(True, description="Live progress display (off: one log line every few seconds).")
    ray_address: str | None = Field(None, description="Ray cluster address for launcher ray (unset: a local Ray).")
    cpus_per_service: float = Field(1.0, ge=0, le=1024, description="Ray: CPUs reserved for each service.")
    gpus_per_generator: float = Field(0, ge=0, le=64, description="Ray: GPUs reserved for each generator.")
    gpus_per_learner: float = Field(0, ge=0, le=64, description="Ray: GPUs reserved for the learner.")
    cpus: dict[str, str] = Field(
        default_factory=dict,
        description="Local launcher: pin services to CPUs, e.g. {learner: '1', generator: '0', hub: '0'} (keys: "
        "redis, hub, reward, generator, generatorN, learner; values: CPU lists such as 0-3,6; the warm start and "
        "the evaluations take the learner's). Unlisted services run anywhere. Disaggregated placement on one "
        "machine: each side keeps its own cores.",
    )

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_lists(cls, value: Any) -> Any:
        from flywheel.procs import parse_cpu_list

        if not isinstance(value, dict):
            return value  # pydantic names the type error
        value = {k: str(v) if isinstance(v, int) else v for k, v in value.items()}  # `learner: 1` in YAML
        names = get_args(ServiceName)
        for key, cpus in value.items():
            if not isinstance(cpus, str):
                raise ValueError(f"launch.cpus.{key}: a CPU list such as 0-3,6, got {cpus!r}")
            if key not in names and not (key.startswith("generator") and key[len("generator") :].isdigit()):
                raise ValueError(f"launch.cpus: unknown service {key!r}; use one of {', '.join(names)} or generatorN")
            parse_cpu_list(cpus)
        return value


class AutoscaleConfig(_Section):
    """Generator autoscaling (`flywheel run`): the fleet follows what the learner can consume."""

    enabled: bool = Field(False, description="Adjust the number of generators while the run goes.")
    min_generators: int = Field(1, ge=0, le=4096, description="Fewest generators.")
    max_generators: int = Field(4, ge=1, le=4096, description="Most generators.")
    interval_s: float = Field(5.0, gt=0, le=3600, description="Seconds between two looks at the hub's metrics.")
    cooldown_s: float = Field(
        30.0, ge=0, le=86400, description="Least time between two changes (a new generator needs time to load)."
    )
    starving_ready_steps: float = Field(
        1.0, ge=0, description="Grow when fewer ready groups than this many learner steps wait and generators are busy."
    )
    busy_utilisation: float = Field(
        0.75, ge=0, le=1, description="Generators count as busy above this share of their lease slots in use."
    )
    blocked_frac: float = Field(
        0.5,
        gt=0,  # 0: any interval "blocked", the fleet shrinking for good
        le=1,
        description="Shrink when generators spent this share of the interval with slots the staleness bound kept empty.",
    )
    backend: Literal["launcher", "command"] = Field(
        "launcher", description="launcher: processes or Ray actors of flywheel run; command: run autoscale.command."
    )
    command: str | None = Field(
        None,
        description="Hook for compose/Kubernetes: a shell command with {replicas}, e.g. "
        "'docker compose --env-file deploy/flywheel.env -f deploy/docker-compose.yml up -d --no-recreate --scale generator={replicas}'.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_generators > self.max_generators:
            raise ValueError("autoscale.min_generators must be <= autoscale.max_generators")
        if self.backend == "command" and not self.command:
            raise ValueError("autoscale.backend command needs autoscale.command (with {replicas})")
        return self


class WandbConfig(_Section):
    """Experiment logging."""

    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto: online when WANDB_API_KEY is set, else offline (files in train.run_dir)."
    )
    project: str = Field("flywheel", description="wandb project.")


class FlywheelConfig(_Section):
    """A whole run. Sections map to YAML top-level keys and to `--section.field` flags."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Durable state.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt source.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", description="Staleness bound.")
    hub: HubConfig = Field(default_factory=HubConfig, description="Rollout hub.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward service.")
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Reward-model server.")
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig, description="vLLM generator service.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight broadcast.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="RL algorithm.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Learner optimisation.")
    ds: DeepSpeedSection = Field(default_factory=DeepSpeedSection, description="DeepSpeed.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Experiment logging.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Synthetic task.")
    sft: SftConfig = Field(default_factory=SftConfig, description="Supervised warm start.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="The flywheel run launcher.")
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig, description="Generator autoscaling.")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="Link authentication.")

    @model_validator(mode="after")
    def _ports_are_distinct(self) -> FlywheelConfig:
        """Two sockets on one port of one host: the second service died with "Address already in
        use" (a traceback, then restarts). One service's ports must differ; two services' only
        when both bind loopback, the one host they surely share (0 picks a free port)."""
        ports = [
            ("hub", self.hub.host, "hub.generator_port", self.hub.generator_port),
            ("hub", self.hub.host, "hub.reward_port", self.hub.reward_port),
            ("hub", self.hub.host, "hub.metrics_port", self.hub.metrics_port or 0),
            ("learner", self.sync.host, "sync.announce_port", self.sync.announce_port),
            ("learner", self.sync.host, "sync.join_port", self.sync.join_port),
            ("rm", self.rm.host, "rm.port", self.rm.port),
        ]
        seen: dict[tuple[str, int], str] = {}
        for service, host, key, port in ports:
            if not port:
                continue
            shared = host in ("127.0.0.1", "localhost", "::1")
            other = seen.setdefault((host if shared else f"{service}@{host}", port), key)
            if other != key:
                raise ValueError(f"{key} and {other} are both {port} on {host}: give each its own port")
        return self

    @model_validator(mode="after")
    def _plans_agree(self) -> FlywheelConfig:
        """Settings that each pass alone but cannot all hold."""
        a, n = self.autoscale, self.launch.generators
        if a.enabled and "generator" in self.launch.services and not a.min_generators <= n <= a.max_generators:
            raise ValueError(
                f"launch.generators {n} is outside autoscale.min_generators..max_generators "
                f"({a.min_generators}..{a.max_generators}): the autoscaler would move it there at once"
            )
        if a.enabled and a.backend == "launcher" and "generator" not in self.launch.services:
            raise ValueError(
                "autoscale.backend launcher scales the generators flywheel run starts, and launch.services has no "
                "'generator': add it, or scale a fleet run elsewhere with --autoscale.backend command"
            )
        if a.enabled and a.backend == "command" and "generator" in self.launch.services:
            raise ValueError(
                "autoscale.backend command scales a fleet run elsewhere (compose, Kubernetes), and launch.services "
                "has 'generator' too: two owners of one fleet; take 'generator' out of launch.services, or use "
                "--autoscale.backend launcher"
            )
        if "generator" in self.launch.services and n == 0 and not a.enabled:
            raise ValueError(
                "launch.generators 0 starts no generator, and nothing would generate: start one, enable "
                "autoscale, or leave 'generator' out of launch.services when generators run elsewhere"
            )
        if self.train.warmup_steps >= self.train.total_steps > 1:
            raise ValueError(
                f"train.warmup_steps {self.train.warmup_steps} >= train.total_steps {self.train.total_steps}: the "
                "learning rate would never reach train.lr; shorten the warm-up"
            )
        return self

    @model_validator(mode="after")
    def _algorithm_is_consistent(self) -> FlywheelConfig:
        est = self.algo.advantage.estimator
        if est == "gae" and not self.algo.critic.enabled:
            raise ValueError(
                "algo.advantage.estimator gae needs a critic: add --algo.critic.enabled true "
                "(or use a critic-free estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline)"
            )
        if est in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline") and self.data.n_samples_per_prompt < 2:
            raise ValueError(
                f"algo.advantage.estimator {est} compares the samples of a prompt: set --data.n_samples_per_prompt "
                ">= 2 (or use reinforce_pp, whose baseline is the batch's)"
            )
        if self.algo.critic.enabled and est != "gae":
            raise ValueError(f"algo.critic.enabled trains a value model only gae uses, not {est}: drop it or use gae")
        if self.algo.loss.clip_high < self.algo.loss.clip_low:
            raise ValueError("algo.loss.clip_high must be >= algo.loss.clip_low (clip-higher widens the upper side)")
        kl = self.algo.kl
        if kl.coef > 0 and kl.estimator == "k1" and not kl.in_reward:
            raise ValueError(
                "algo.kl.estimator k1 in the loss penalises nothing: its gradient is the score function, whose "
                "expectation is 0. Use --algo.kl.estimator k3 (or k2) in the loss, or put k1 in the reward "
                "with --algo.kl.in_reward true"
            )
        if self.rollout.top_p < 1.0 or self.rollout.top_k > 0:
            raise ValueError(
                f"rollout.top_p {self.rollout.top_p} / rollout.top_k {self.rollout.top_k} sample from a truncated "
                "distribution, whose log-probabilities the generators report, while the learner's are over the "
                "whole vocabulary: every importance ratio would be off, on-policy too. Keep --rollout.top_p 1 "
                "and --rollout.top_k -1 for training rollouts (temperature is matched on both sides)"
            )
        return self

    @model_validator(mode="after")
    def _task_prompts_are_raw_text(self) -> FlywheelConfig:
        if self.task.name != "none" and self.data.apply_chat_template:
            raise ValueError(
                f"task.name {self.task.name} writes raw-text prompts, which its warm start and evaluation use as they "
                "are: drop --data.apply_chat_template (or train on your own data.path with task.name none)"
            )
        return self

    @model_validator(mode="after")
    def _sequence_ratios_average_over_sequences(self) -> FlywheelConfig:
        loss = self.algo.loss
        if loss.ratio_level == "sequence" and loss.aggregation != "seq_mean_token_mean":
            raise ValueError(
                f"algo.loss.ratio_level sequence (GSPO) averages over sequences, but algo.loss.aggregation is "
                f"{loss.aggregation}, which weighs each sequence by its length: add --algo.loss.aggregation "
                "seq_mean_token_mean"
            )
        return self

    @model_validator(mode="after")
    def _prompts_leave_room_to_answer(self) -> FlywheelConfig:
        limit = self.generator.max_model_len
        if limit is not None and self.data.max_prompt_tokens >= limit:
            raise ValueError(
                f"data.max_prompt_tokens {self.data.max_prompt_tokens} leaves no room for an answer within "
                f"generator.max_model_len {limit}: lower --data.max_prompt_tokens (to at most "
                f"{max(limit - self.rollout.max_tokens, 1)} for whole answers of rollout.max_tokens) "
                "or raise --generator.max_model_len"
            )
        return self

    @model_validator(mode="after")
    def _ranks_share_the_batch_evenly(self) -> FlywheelConfig:
        ranks, groups = self.launch.learner_procs, self.async_.groups_per_step
        if groups % ranks:
            raise ValueError(_uneven_batch(groups, ranks, "launch.learner_procs"))
        return self

    @model_validator(mode="after")
    def _data_needs_tokenizer(self) -> FlywheelConfig:
        if self.data.path is not None and self.data.tokenizer is None:
            raise ValueError(
                "data.tokenizer is required when data.path is set: pass --data.tokenizer PATH (an HF tokenizer directory)"
            )
        return self


def _uneven_batch(groups: int, ranks: int, ranks_key: str) -> str:
    """Why a batch must split evenly over the learner's ranks, and the fix."""
    return (
        f"async.groups_per_step {groups} does not split over {ranks} learner ranks ({ranks_key}): each rank claims "
        "groups_per_step / ranks groups, and the hub admits groups_per_step a version, so the ranks would claim more "
        "than it admits (the run stalls) or fewer (the rest pile up and age to the bound). Use a multiple of "
        f"{ranks} (e.g. --async.groups_per_step {max(ranks, groups - groups % ranks)})"
    )


def check_batch_split(groups: int, ranks: int) -> None:
    """The learner's own check, for ranks started by hand (``torchrun -m learner``)."""
    if groups % ranks:
        raise ConfigError(_uneven_batch(groups, ranks, "WORLD_SIZE"))


# --------------------------------------------------------------------------- loading


class ConfigError(ValueError):
    """A recipe or flag a user must fix; the message names the key and the fix."""


def parse_overrides(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Split ``[--config FILE] --a.b value --c.d=value ...`` into (recipe path, nested dict)."""
    recipe: str | None = None
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"flag --{key} needs a value: --{key} VALUE")
            value = argv[i + 1]
            i += 1
        i += 1
        if key in ("config", "c"):
            recipe = value
            continue
        node = overrides
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{key} conflicts with an earlier flag that set {part!r} to a value")
        node[parts[-1]] = _flag_value(key, value)
    return recipe, overrides


def _flag_value(key: str, value: str) -> Any:
    """A flag's value as YAML reads it (numbers, booleans, lists), except where the field is a
    string: ``--run.name on`` is the name "on", not True, and ``--generator.id 007`` is "007"."""
    if value == "":
        return ""
    string, optional = _string_fields().get(key, (False, False))
    if string and optional and value in ("null", "~", "None"):
        return None  # (YAML reads "None" as the string "None": a directory named None)
    if string:
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"--{key} {value!r} is not a value YAML can read: {str(err).splitlines()[0]}") from None


@functools.cache
def _string_fields() -> dict[str, tuple[bool, bool]]:
    """Every key whose field is a string: (True, whether it may be null)."""
    out: dict[str, tuple[bool, bool]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key, ann = f"{prefix}{field.alias or name}", field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
            elif ann is str or _string_literal(ann):
                out[key] = (True, False)
            elif typing.get_origin(ann) in (typing.Union, types.UnionType) and set(typing.get_args(ann)) == {
                str,
                type(None),
            }:
                out[key] = (True, True)

    walk(FlywheelConfig, "")
    return out


def _string_literal(ann: Any) -> bool:
    """A Literal of strings: YAML 1.1 reads some of them as something else (``no`` is False)."""
    return typing.get_origin(ann) is Literal and all(isinstance(a, str) for a in typing.get_args(ann))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _known_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        ann = field.annotation
        item = typing.get_args(ann)[0] if typing.get_origin(ann) is list and typing.get_args(ann) else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths.extend(_known_paths(ann, f"{prefix}{key}."))
        elif isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: `*` for the index
            paths.append(f"{prefix}{key}")
            paths.extend(_known_paths(item, f"{prefix}{key}.*."))
        else:
            paths.append(f"{prefix}{key}")
    return paths


def _nearest_key(path: str, known: list[str]) -> str | None:
    """The known key a misspelled one most likely meant: a misspelled section (``asynch``) is
    matched against the sections first, a key against its own section's keys first."""
    index = re.search(r"\.(\d+)(?=\.|$)", path)
    if index:  # an entry of a list of sections (reward.functions.0.wieght): matched as `*`, said as given
        nearest = _nearest_key(path[: index.start()] + ".*" + path[index.end() :], known)
        return nearest.replace("*", index.group(1), 1) if nearest else None
    sections = sorted({k.split(".", 1)[0] for k in known})
    head, _, rest = path.partition(".")
    if head not in sections:
        near = difflib.get_close_matches(head, sections, n=1, cutoff=0.6)
        if near:
            return f"{near[0]}.{rest}" if rest else near[0]
    else:
        near = difflib.get_close_matches(path, [k for k in known if k.startswith(head + ".")], n=1)
        if near:
            return near[0]
    near = difflib.get_close_matches(path, known, n=1)
    return near[0] if near else None


def _explain(err: ValidationError) -> str:
    known = _known_paths(FlywheelConfig)
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            near = _nearest_key(path, known)
            hint = f"; did you mean `{near}`?" if near else "; see `flywheel config` for every key"
            lines.append(f"unknown key `{path}`{hint}")
        elif not path:  # a check across fields: its message names them, and the input is the whole config
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"`{path}`: {e['msg']} (got {mask_credentials(repr(e.get('input')))})")
    return "invalid config:\n  " + "\n  ".join(lines)


_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/@\s:'\"]*):[^/@\s'\"]*@")


def mask_credentials(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (for logs and messages)."""
    return _URL_PASSWORD.sub(r"\1:***@", text)


def load_config(argv: list[str] | None = None, recipe: str | Path | None = None) -> FlywheelConfig:
    """Build the config from an optional recipe file and dotted overrides in ``argv``."""
    flag_recipe, overrides = parse_overrides(list(argv or []))
    path = flag_recipe or recipe
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {str(p)!r} not found: pass --config PATH to a YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:  # (its message names "<unicode string>": the file is named here)
            where = getattr(err, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"recipe {str(p)!r} is not valid YAML{at}: {problem}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {str(p)!r} must be a YAML mapping of sections")
        data = loaded
    try:
        return FlywheelConfig.model_validate(_merge(data, overrides))
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def reference(model: type[BaseModel] = FlywheelConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf field: the config reference."""
    rows = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(reference(ann, f"{prefix}{key}."))
            continue
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        type_name = (
            str(ann).replace("typing.", "").replace(f"{__name__}.", "") if not isinstance(ann, type) else ann.__name__
        )
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [m.model_dump() for m in default]
        bounds = [
            f"{sym} {getattr(m, attr)}"
            for m in field.metadata
            for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if hasattr(m, attr)
        ]
        desc = field.description or ""
        if bounds:
            desc += f" [{', '.join(bounds)}]"
        rows.append((f"{prefix}{key}", type_name, repr(default), desc))
    return rows


def reference_markdown() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{k}` | `{t}` | `{d}` | {m} |" for k, t, d, m in reference()]
    return "\n".join(rows)


def help_text(prog: str, what: str) -> str:
    lines = [
        f"usage: {prog} [--config RECIPE.yaml] [--section.field VALUE ...]",
        "",
        what,
        "",
        "Every config key can be set in the recipe or overridden with a flag:",
    ]
    lines += [f"  --{k:<32} {m} (default {d})" for k, _, d, m in reference()]
    return "\n".join(lines)


def pop_flags(argv: list[str], *flags: str) -> dict[str, str] | str:
    """Take ``--flag VALUE`` pairs that are not config keys out of ``argv`` (in place); returns
    them by flag, or the message naming the first one missing."""
    found = {}
    for flag in flags:
        if flag not in argv or argv.index(flag) + 1 >= len(argv):
            return f"{flag} VALUE is required"
        i = argv.index(flag)
        found[flag] = argv[i + 1]
        del argv[i : i + 2]
    return found


def service_config(prog: str, what: str, argv: list[str]) -> FlywheelConfig | int:
    """A service entry point's first step: the parsed config, or an exit code after printing
    the help (0) or what to fix (2). Imports nothing heavy."""
    import sys

    if "-h" in argv or "--help" in argv:
        print(help_text(prog, what))
        return 0
    try:
        return load_config(argv)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
