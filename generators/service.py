"""The vLLM generator service: leases in, streamed chunks out, new weights taken in flight.

One asyncio loop. Every sample of every lease is one vLLM request, consumed by its own task that
appends each token delta, with its behaviour log-probability and the version of the weights that
produced it, to the sample's pending buffer. The loop's tick (every ``flush_interval_ms``) sends
all pending tokens to the hub as one ChunkBatch, reads leases, acks and revocations, heartbeats
the hub and the learner, and starts a weight-update task when a WeightsReady names this
generator (one at a time, in order; the tick goes on meanwhile, so heartbeats never stop).

Versions are exact: during an update the engine is paused and the loop waits until every token
the old weights produced has been consumed before it bumps ``self.version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from flywheel.config import FlywheelConfig
from flywheel.watchdog import WATCHDOG
from flywheel.wire import FINISH_REASONS, Chunk, Lease, Rejections, WeightsReady, pack_f32, pack_i32, unpack_i32
from generators.hub_link import HubLink
from generators.sync_link import SyncLink

log = logging.getLogger(__name__)

MIN_LOGPROB = -1e9  # -inf (a token the processed distribution excludes) travels as this finite floor
ENGINE_CALL_TIMEOUT_S = 120.0  # an engine's pause, cache reset or resume in a weight update
ENGINE_ERROR_RETRIES = 2  # a request vLLM ends with "error" goes on from its partial tokens this many times
LATE_LEASES_S = 0.3  # how long a stopping generator listens for leases sent before the hub heard it


@dataclass
class SampleRun:
    """One sample being generated, and what of it the hub has not been sent yet."""

    lease: Lease
    sample: int
    tokens: list[int] = field(default_factory=list)  # everything generated so far (resubmission needs it)
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_versions: list[int] = field(default_factory=list)
    seq: int = 0
    finish: str | None = None
    task: asyncio.Task[None] | None = None

    def add(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        self.tokens.extend(token_ids)
        self.pending_tokens.extend(token_ids)
        self.pending_logprobs.extend(logprobs)
        self.pending_versions.extend([version] * len(token_ids))

    def take_chunk(self) -> Chunk | None:
        if not self.pending_tokens and self.finish is None:
            return None
        chunk = Chunk(
            lease_id=self.lease.lease_id,
            group_id=self.lease.group_id,
            sample=self.sample,
            seq=self.seq,
            tokens=pack_i32(self.pending_tokens),
            logprobs=pack_f32(self.pending_logprobs),
            versions=pack_i32(self.pending_versions),
            finish_reason=self.finish,
        )
        self.seq += 1
        self.pending_tokens, self.pending_logprobs, self.pending_versions = [], [], []
        return chunk


@dataclass
class UpdateResult:
    version: int
    ok: bool
    error: str | None
    seconds: float


class GeneratorService:
    def __init__(
        self,
        cfg: FlywheelConfig,
        engine: Any,  # vllm AsyncLLM (typed loosely: vLLM is imported only after the config is parsed)
        link: HubLink,
        sync: SyncLink | None,
        generator_id: str,
        max_model_len: int,
    ) -> None:
        self.cfg = cfg
        self.gcfg = cfg.generator
        self.engine = engine
        self.link = link
        self.sync = sync
        self.generator_id = generator_id
        self.max_model_len = max_model_len
        longest = cfg.data.max_prompt_tokens + cfg.rollout.max_tokens
        if longest > max_model_len:  # said once: otherwise long prompts get shorter answers in silence
            log.warning(
                "data.max_prompt_tokens %d + rollout.max_tokens %d = %d is over the model's context (%d): a response "
                "is cut at the context's end, so long prompts get less than rollout.max_tokens",
                cfg.data.max_prompt_tokens,
                cfg.rollout.max_tokens,
                longest,
                max_model_len,
            )
        self.version = 0
        # False after an update failed half-way, or until the learner's first sync when the engine
        # loaded the base model only for its shape (generator.await_weights): no leases meanwhile
        self.weights_valid = not self.gcfg.await_weights
        self.samples: dict[int, dict[int, SampleRun]] = {}  # lease id -> sample index -> run
        self.updates: deque[UpdateResult] = deque(maxlen=1000)  # the latest weight updates (a benchmark reads them)
        self.tokens_generated = 0
        self.refused = Rejections(log)  # requests vLLM refused for their input, by reason
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._interrupts = 0  # bumped by every interrupt-policy update: aborts it caused are resubmitted
        self._deltas = 0  # token deltas consumed so far; an update waits until this stops moving
        self._progress = (time.monotonic(), 0)  # when _deltas last moved (or the engine last had cause to wait)
        self._draining_since: float | None = None
        self._failure: BaseException | None = None
        # Weight updates run as a task so the loop keeps heartbeating (and streaming) meanwhile.
        self._pending_updates: deque[tuple[WeightsReady, bytes]] = deque()
        self._update_task: asyncio.Task[UpdateResult] | None = None

    # ------------------------------------------------------------------ main loop

    async def run(self, max_seconds: float | None = None) -> None:
        try:
            await self._serve(max_seconds)
        except BaseException:
            if self.sync is not None:  # failing (or cancelled): out of the next weight syncs at once
                self.sync.leave(self.version)
            # and its leases go back now, not after the hub's generator_timeout_s (none of it may
            # come from whatever failed: a half-loaded update, a wedged engine)
            with contextlib.suppress(Exception):
                self.link.draining = True
                self.link.heartbeat(force=True)
                self.link.release(list(self.samples))
            raise

    async def _serve(self, max_seconds: float | None) -> None:
        self.link.draining = not self.weights_valid  # told with the first heartbeat, right after
        self.link.register(self.version)
        start = time.monotonic()
        interval = self.gcfg.flush_interval_ms / 1000
        while not self._finished(start, max_seconds):
            self._raise_failure()  # before the tick: it would flush what a failed update left
            self._tick()
            self._schedule_update()
            self._raise_failure()
            await asyncio.sleep(interval)
        if self._update_task is not None:
            await asyncio.wait([self._update_task], timeout=self.cfg.sync.timeout_s + 10)
        self._raise_failure()  # an update that failed while the loop ended: no clean exit
        await self._shutdown()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError("a generation or weight-update task failed") from self._failure

    def drain(self) -> None:
        """SIGTERM: take no new leases, finish what is held (for at most drain_timeout_s)."""
        if self._draining_since is None:
            log.info("draining: finishing %d leases, taking no new ones", len(self.samples))
            self._draining_since = time.monotonic()
            self.link.drain()

    def _finished(self, start: float, max_seconds: float | None) -> bool:
        if max_seconds is not None and time.monotonic() - start >= max_seconds:
            return True
        if self._draining_since is None:
            return False
        timed_out = time.monotonic() - self._draining_since >= self.gcfg.drain_timeout_s
        return not self.samples or timed_out

    def _tick(self) -> None:
        inbox = self.link.poll(0)
        for lease in inbox.leases:
            self._start_lease(lease)
        for lease_id in inbox.revoked:
            self._cancel_lease(lease_id)
        self._flush()
        self.link.resend_due()
        self.link.draining = self._draining_since is not None or not self.weights_valid
        self.link.heartbeat()
        if self.sync is not None:
            self.sync.join(self.version, self.gcfg.heartbeat_s, needs_weights=not self.weights_valid)
        self._check_engine_progress()

    def _check_engine_progress(self) -> None:
        """A wedged engine (a hung kernel, a frozen engine process) gives no token while this loop
        heartbeats on, so the hub extends every lease held for good: fail instead, and the
        launcher's restart gives the leases back. Pauses for weight updates are no stall."""
        now, (since, deltas) = time.monotonic(), self._progress
        updating = not self._resumed.is_set() or (self._update_task is not None and not self._update_task.done())
        if self._deltas != deltas or updating or not self._requests_in_flight():
            self._progress = (now, self._deltas)
            return
        limit = self.gcfg.stall_timeout_s
        if limit and now - since > limit and self._failure is None:
            self._failure = RuntimeError(
                f"the engine gave no token for {now - since:.0f}s with {self._requests_in_flight()} requests in "
                "flight and no weight update under way (generator.stall_timeout_s): it is wedged; exiting for a restart"
            )

    def _requests_in_flight(self) -> int:
        return sum(
            1 for runs in self.samples.values() for run in runs.values() if run.task is not None and not run.task.done()
        )

    async def _shutdown(self) -> None:
        if self.sync is not None:
            self.sync.leave(self.version)
        if self._draining_since is None:  # (max_seconds): no new lease while it stops
            self.link.drain()
        # What is finished goes out first (past the flow-control window: these are the last
        # chunks), so a sample or lease done before the stop is not generated again elsewhere;
        # the rest goes back to the hub, which re-issues it whole.
        self._flush(finished_only=True)
        held = list(self.samples)
        for lease_id in held:
            self._cancel_lease(lease_id)
        self.link.release(held)
        # let the hub make our last chunks durable, and hear it a little while in any case: a
        # lease it sent before it heard we stop goes straight back
        now = time.monotonic()
        deadline, heard_enough = now + 5.0, now + LATE_LEASES_S
        while (self.link.unacked or time.monotonic() < heard_enough) and time.monotonic() < deadline:
            late = self.link.poll(0).leases
            self.link.release([lease.lease_id for lease in late])
            self.link.resend_due()
            # waited here, not in the socket's poll: the cancelled requests' tasks run meanwhile
            # and abort them in the engine, which would otherwise go on generating released work
            # until it is shut down
            await asyncio.sleep(0.02)
        log.info(
            "stopped: %d tokens generated, %d chunks unacknowledged", self.tokens_generated, len(self.link.unacked)
        )

    # ------------------------------------------------------------------ leases and samples

    def _start_lease(self, lease: Lease) -> None:
        if not self.weights_valid or lease.min_version > self.version or self._draining_since is not None:
            log.info(
                "returning lease %d (weights v%d, lease needs v%d)", lease.lease_id, self.version, lease.min_version
            )
            self.link.release([lease.lease_id])
            return
        runs = {s: SampleRun(lease, s) for s in lease.samples}
        self.samples[lease.lease_id] = runs
        for run in runs.values():
            run.task = asyncio.create_task(self._generate(run))
            run.task.add_done_callback(self._task_done)

    def _cancel_lease(self, lease_id: int) -> None:
        for run in self.samples.pop(lease_id, {}).values():
            if run.task is not None:
                run.task.cancel()  # vLLM aborts the request when its stream is cancelled

    def _schedule_update(self) -> None:
        if self.sync is not None:
            self._pending_updates.extend(r for r in self.sync.poll() if self.generator_id in r[0].ranks)
        if self._pending_updates and (self._update_task is None or self._update_task.done()):
            ready, raw = self._pending_updates.popleft()
            self._update_task = asyncio.create_task(self._update(ready, raw))
            self._update_task.add_done_callback(self._update_done)

    def _update_done(self, task: asyncio.Task[UpdateResult]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self._failure = self._failure or task.exception()
        else:
            self.updates.append(task.result())

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    async def _generate(self, run: SampleRun) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        lease, sp = run.lease, run.lease.sampling
        prompt = unpack_i32(lease.prompt_tokens).tolist()
        attempt = errors = 0
        while True:
            await self._resumed.wait()
            max_new = min(sp.max_tokens - len(run.tokens), self.max_model_len - len(prompt) - len(run.tokens))
            if max_new <= 0:
                run.finish = "length"
                return
            seed = (
                None if sp.seed is None else (sp.seed * 1_000_003 + lease.group_id * 7919 + run.sample * 31 + attempt)
            )
            params = SamplingParams(
                max_tokens=max_new,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                seed=None if seed is None else seed % (1 << 31),
                stop_token_ids=list(sp.stop_token_ids),
                logprobs=0,
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,
            )
            request_id = f"{self.generator_id}-{lease.lease_id}-{run.sample}-{attempt}"
            interrupts_before = self._interrupts
            finish = None
            try:
                async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=prompt + run.tokens), params, request_id
                ):
                    completion = out.outputs[0]
                    ids = list(completion.token_ids)
                    if ids:
                        lps = [_behaviour_logprob(completion.logprobs[i][t].logprob) for i, t in enumerate(ids)]
                        run.add(ids, lps, self.version)
                        self.tokens_generated += len(ids)
                        self._deltas += 1
                    finish = completion.finish_reason or finish
            except _request_errors() as err:
                # This request's input, not the engine: failing the generator would fail every
                # generator the hub re-issues the lease to after it, in turn.
                self.refused.reject(
                    "engine_refused_request",
                    f"group {lease.group_id} sample {run.sample}: {err} (prompt token ids outside the model's "
                    "vocabulary? data.tokenizer must be generator.model's); it ends as abort",
                    "vLLM",
                )
                run.finish = "abort"
                return
            if finish == "abort" and self._interrupts != interrupts_before:
                attempt += 1  # aborted by an interrupt-policy update: go on from the partial tokens
                continue
            if finish not in FINISH_REASONS and errors < ENGINE_ERROR_RETRIES:
                # vLLM's "error" is a retryable request-level failure (a KV-cache load, say); a
                # stream that ends with no reason is one too: go on from the partial tokens
                errors += 1
                attempt += 1
                log.warning(
                    "request %s ended with %r: going on from its %d tokens", request_id, finish, len(run.tokens)
                )
                continue
            # what is still unfinished ends as "abort": scored, but the learner gives it no gradient
            run.finish = finish if finish in FINISH_REASONS else "abort"
            return

    def _flush(self, finished_only: bool = False) -> None:
        """Send every sample's new tokens as one batch; retire finished samples and leases.
        ``finished_only`` (at shutdown): the finished samples' last chunks, whatever the window."""
        if self.link.window_full() and not finished_only:
            return  # flow control: tokens wait in the sample buffers until the hub catches up
        chunks = []
        for lease_id in list(self.samples):
            runs = self.samples[lease_id]
            for index in list(runs):
                if finished_only and runs[index].finish is None:
                    continue
                chunk = runs[index].take_chunk()
                if chunk is not None:
                    chunks.append(chunk)
                if runs[index].finish is not None:
                    del runs[index]
            if not runs:
                del self.samples[lease_id]
                self.link.lease_done(lease_id)
        self.link.send_chunks(chunks)

    # ------------------------------------------------------------------ weight updates

    async def _update(self, ready: WeightsReady, raw: bytes) -> UpdateResult:
        start = time.perf_counter()
        if time.time() > ready.due:
            return self._ack_update(ready, "its deadline passed before this generator read it", start)
        interrupt = self.cfg.async_.partial_rollout == "interrupt"
        if interrupt:
            self._interrupts += 1
            self._resumed.clear()
        phases: dict[str, float] = {}  # where an update's time goes (logged: it is the generator's sync cost)
        mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name], mark = now - mark, now

        await self._engine_call(
            self.engine.pause_generation(mode="abort" if interrupt else "keep", clear_cache=False), "pause"
        )
        lap("pause")
        try:
            await self._quiesce()
            lap("quiesce")
            with WATCHDOG.wait(f"weight update v{ready.version}", self.cfg.run.watchdog_s):
                error, touched = await self._load(ready, raw)
            lap("load")
            if error is None:
                self.version = ready.version
            elif touched:  # before the resume: not one more step, nor a lease, on half-loaded weights
                self._give_up_work_of_half_loaded_weights()
            # The learner's sync waits for this ack, not for the cache reset and the resume: they
            # are this engine's own business (and one queued behind an engine RPC still running
            # past a load's timeout would hold the ack up to ENGINE_CALL_TIMEOUT_S).
            result = self._ack_update(ready, error, start)
            # Cached KV (prefix cache and running requests) came from the old weights: recompute it.
            await self._engine_call(self.engine.reset_prefix_cache(reset_running_requests=True), "reset its cache")
            lap("reset")
        finally:
            await self._engine_call(self.engine.resume_generation(), "resume")
            lap("resume")
            self._resumed.set()
        result.seconds = time.perf_counter() - start  # the engine's whole pause (the ack went earlier)
        if error is None:
            detail = " ".join(f"{k} {v:.3f}" for k, v in phases.items())
            log.info("now serving weights v%d (update took %.3fs: %s)", self.version, result.seconds, detail)
        return result

    @staticmethod
    async def _engine_call(call: Awaitable[object], what: str) -> None:
        """An engine call of a weight update, with a timeout: one queued behind a stuck load (on
        NCCL nothing else bounds it) would stall the update, and every sync after it, for good.
        Past it, the generator fails (its supervisor restarts it) rather than serve half-paused."""
        try:
            await asyncio.wait_for(call, timeout=ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"the engine did not {what} within {ENGINE_CALL_TIMEOUT_S:g}s") from None

    async def _load(self, ready: WeightsReady, raw: bytes) -> tuple[str | None, bool]:
        first_rank = ready.ranks[self.generator_id]
        budget = max(0.1, ready.due - time.time()) + 5.0  # the workers' own timeout fires first
        try:
            results = await asyncio.wait_for(
                self.engine.collective_rpc(
                    "flywheel_update_weights", args=(raw, first_rank, self.gcfg.max_weight_bytes)
                ),
                timeout=budget,
            )
        except TimeoutError:
            return f"workers did not finish loading version {ready.version} within {budget:.0f}s", True
        errors = [r["error"] for r in results if not r["ok"]]
        return (errors[0] if errors else None), any(r["touched"] for r in results)

    async def _quiesce(self) -> None:
        """Wait until every token the engine produced before the pause has been consumed."""
        deadline = time.monotonic() + 2.0
        seen = -1
        while seen != self._deltas and time.monotonic() < deadline:
            seen = self._deltas
            await asyncio.sleep(0.005)

    def _give_up_work_of_half_loaded_weights(self) -> None:
        self.weights_valid = False  # half-loaded: serve nothing until a sync succeeds
        # the hub hears it before the Release below, or it would lease the same work straight
        # back, to be returned again (the heartbeat says so only every heartbeat_s)
        self.link.draining = True
        self.link.heartbeat(force=True)
        # nothing may come of the half-loaded weights: their work goes back to the hub
        held = list(self.samples)
        for lease_id in held:
            self._cancel_lease(lease_id)
        self.link.release(held)

    def _ack_update(self, ready: WeightsReady, error: str | None, start: float) -> UpdateResult:
        """Tell the learner how the load went, and the hub which weights this generator holds."""
        seconds = time.perf_counter() - start
        if error is None:
            self.weights_valid = True
            log.info("loaded weights v%d in %.3fs: acked, the engine resumes", self.version, seconds)
        else:
            log.error("could not load weights v%d: %s", ready.version, error)
            # (touched, the work went back already: _give_up_work_of_half_loaded_weights)
            # Untouched, the weights are the ones the leases were taken with: their work goes on
            # (the hub leased it to these weights' version, and drops whatever turns too stale);
            # released, it came straight back here, to be generated again from the start.
        assert self.sync is not None
        self.sync.ack(self.version if error is None else ready.version, ready.epoch, error, seconds)
        self.link.draining = self._draining_since is not None or not self.weights_valid
        self.link.set_weight_version(self.version)
        return UpdateResult(ready.version, error is None, error, seconds)


def _behaviour_logprob(lp: float) -> float:
    """vLLM's log-probability of a sampled token, as the wire carries it: -inf (and a NaN, which
    min() read as 0.0, probability 1) becomes the floor the learner reads as "no probability"
    (its loss gives such a token no gradient); above 0 (rounding) is 0."""
    if math.isnan(lp):
        return MIN_LOGPROB
    return max(MIN_LOGPROB, min(0.0, lp))


@functools.cache
def _request_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for one request's bad input (a token id outside the vocabulary, a prompt
    too long), as against a failed engine (``EngineDeadError``): the first ends that request."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # an older vLLM: its input checks raise ValueError
        return (ValueError,)
    return (VLLMClientError, ValueError)
