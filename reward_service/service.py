"""The reward service: takes completed samples from the hub, scores them in a worker pool,
answers with Scores.

The hub hands the service at most ``reward.capacity`` samples at a time (credit-based),
re-sends what is not answered in time, and forgets a service that stops re-registering. Here,
samples wait in a queue and go to idle workers in batches of up to ``reward.batch_size``. A
batch that timed out or crashed its worker is retried one sample at a time, so only the culprit
gets the error; every failure is answered as a Score with an error reason, never dropped.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque

import zmq

from flywheel.config import RewardConfig, SecurityConfig
from flywheel.netsec import curve_client
from flywheel.wire import (
    MAX_BREAKDOWN,
    Decoder,
    Rejections,
    RewardRegister,
    Score,
    ScoreBatch,
    ScoreRequest,
    WireError,
    clip_error,
    encode,
)
from reward_service.pool import WorkerPool
from reward_service.scoring import Item, Outcome, valid_utf8

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 10.0
MAX_REQUEST_BYTES = 64 << 20  # a ScoreRequest carries one prompt and one response
SCORES_PER_FRAME = 256  # scores per ScoreBatch: small frames, far under the hub's message limit
RECENT_ANSWERS = 8192  # answers kept to send again when the hub re-sends a request already answered


class RewardService:
    def __init__(
        self,
        rcfg: RewardConfig,
        service_id: str,
        pool: WorkerPool,
        heartbeat_s: float = 1.0,
        security: SecurityConfig | None = None,
    ) -> None:
        self.rcfg = rcfg
        self.service_id = service_id
        self.pool = pool
        self.heartbeat_s = heartbeat_s
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, service_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_REQUEST_BYTES)  # far over the checked limit: ZMQ drops it
        curve_client(self.sock, security)
        self.sock.connect(rcfg.hub_address)
        self.decoder = Decoder(ScoreRequest, max_bytes=MAX_REQUEST_BYTES)
        self.rejects = Rejections(log)  # what the hub sent that failed validation, by reason
        # when each reason of failed rewards was last logged: once per STATS_INTERVAL_S, or a
        # function failing on every sample would write a line (its whole exception) per sample
        self._failure_logged: dict[str, float] = {}
        self.queue: deque[Item] = deque()  # scored in batches
        self.solo: deque[Item] = deque()  # from a batch that hung or crashed: scored alone
        # (group, sample) of every request queued or being scored, with its fingerprint: the hub
        # re-sends what it has had no answer to in time, and a copy of one still held here would
        # only be scored twice
        self.held: dict[tuple[int, int], int] = {}
        # the latest answers: a re-send that crossed our answer on the wire (or whose answer was
        # lost) is answered again from here, not scored again
        self.answered: OrderedDict[tuple[int, int], tuple[int, Score]] = OrderedDict()
        self.duplicates = 0
        self.answered_again = 0
        self.superseded = 0  # answers not sent: a newer request under the same key came meanwhile
        self.unsent = 0  # messages dropped because the hub was unreachable (it re-sends its requests)
        self.scored = 0
        self.errors: Counter[str] = Counter()
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def run(self, max_seconds: float | None = None) -> None:
        start = time.monotonic()
        last_hello = last_stats = 0.0
        while not self._stop and (max_seconds is None or time.monotonic() - start < max_seconds):
            now = time.monotonic()
            # announce ourselves only once a worker can score: until then the hub gives work to others
            if now - last_hello >= self.heartbeat_s and self.pool.ready_count():
                last_hello = now
                self._send(encode(RewardRegister(worker_id=self.service_id, capacity=self.rcfg.capacity)))
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self._log_stats()
            self._wait(100)
            self._receive()
            for items, result in self.pool.collect():
                self._answer(items, result)
            self._dispatch()
        self._finish_in_flight(deadline_s=min(self.rcfg.timeout_s, 10.0))
        self._log_stats()

    def _wait(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for fd in self.pool.filenos():
            poller.register(fd, zmq.POLLIN)
        poller.poll(timeout_ms)

    def _receive(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                self.rejects.reject("malformed", f"expected 1 frame, got {len(frames)}", "hub")
                continue
            try:
                req = self.decoder.decode(frames[0])
            except WireError as err:
                self.rejects.reject(err.reason, err, "hub")
                continue
            assert isinstance(req, ScoreRequest)
            item = Item(
                key=(req.group_id, req.sample),
                prompt_tokens=req.prompt_tokens,
                completion_tokens=req.response_tokens,
                finish_reason=req.finish_reason,
                metadata=dict(req.metadata),
                prompt_text=req.prompt_text,
            )
            fingerprint = item.fingerprint
            if self.held.get(item.key) == fingerprint:
                self.duplicates += 1  # a re-send of what is being scored
                continue
            recent = self.answered.get(item.key)
            if recent is not None and recent[0] == fingerprint:
                self.answered_again += 1
                self._send(encode(recent[1]))
                continue
            # (held under another fingerprint: a new request under an old key, from a restarted
            # hub or a new run; it supersedes the one being scored, whose answer is not sent)
            self.held[item.key] = fingerprint
            self.queue.append(item)

    def _dispatch(self) -> None:
        idle = self.pool.idle()
        while idle and self.solo:
            item = self.solo.popleft()
            if not self.pool.submit(idle.pop(), [item]):
                self.solo.appendleft(item)
        if not idle or not self.queue:
            return
        # spread what is queued over the idle workers rather than filling one batch first
        share = min(self.rcfg.batch_size, math.ceil(len(self.queue) / len(idle)))
        for worker in idle:
            if not self.queue:
                break
            batch = [self.queue.popleft() for _ in range(min(share, len(self.queue)))]
            if not self.pool.submit(worker, batch):
                self.queue.extendleft(reversed(batch))

    def _answer(self, items: list[Item], result: list[Outcome] | str) -> None:
        if isinstance(result, str):
            if len(items) > 1:  # which sample hung or crashed the worker? score each alone
                self.solo.extend(items)
                return
            result = [Outcome(error=result)]  # "timeout: ..." or "crash: ..."
        scores = []
        for item, out in zip(items, result, strict=True):
            fingerprint = item.fingerprint
            if self.held.get(item.key) != fingerprint:
                self.superseded += 1  # a newer request holds its key: this answer would be wrong for it
                continue
            del self.held[item.key]
            reward = out.reward
            error = None if out.error is None else clip_error(valid_utf8(out.error))
            if error is not None:
                reason = error.split(":", 1)[0]
                self.errors[reason] += 1
                reward = self.rcfg.error_reward
                self._log_failure(reason, item.key, error)
            self.scored += 1
            breakdown = {valid_utf8(k): v for k, v in list(out.breakdown.items())[:MAX_BREAKDOWN]}
            scores.append(
                Score(
                    worker_id=self.service_id,
                    group_id=item.key[0],
                    sample=item.key[1],
                    reward=reward,
                    breakdown=breakdown,
                    error=error,
                )
            )
            self._remember(item.key, fingerprint, scores[-1])
        for i in range(0, len(scores), SCORES_PER_FRAME):  # one frame per worker batch, bounded
            self._send(encode(ScoreBatch(worker_id=self.service_id, scores=scores[i : i + SCORES_PER_FRAME])))

    def _log_failure(self, reason: str, key: tuple[int, int], error: str) -> None:
        now = time.monotonic()
        if now - self._failure_logged.get(reason, -math.inf) >= STATS_INTERVAL_S:
            self._failure_logged[reason] = now
            log.warning(
                "reward failed for (group %d, sample %d): %s (the first %s in %gs: the stats line counts them all)",
                *key,
                error,
                reason,
                STATS_INTERVAL_S,
            )

    def _remember(self, key: tuple[int, int], fingerprint: int, score: Score) -> None:
        self.answered[key] = (fingerprint, score)
        self.answered.move_to_end(key)
        if len(self.answered) > RECENT_ANSWERS:
            self.answered.popitem(last=False)

    def _send(self, payload: bytes) -> None:
        """Never blocks: with the hub away, the socket's queue fills (a heartbeat a second) and a
        blocking send would stop the loop, its worker deadlines and its stop. What cannot be queued
        is dropped: the hub re-sends every request it has no score for."""
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.unsent += 1

    def _finish_in_flight(self, deadline_s: float) -> None:
        """On stop: answer what the workers are scoring now (the hub re-sends the queued rest)."""
        deadline = time.monotonic() + deadline_s
        while self.pool.busy_count() and time.monotonic() < deadline:
            self._wait(50)
            for items, result in self.pool.collect():
                if not isinstance(result, str):
                    self._answer(items, result)

    def _log_stats(self) -> None:
        log.info(
            "scored %d | errors %s | queued %d, in workers %d | workers ready %d/%d, restarts %d | rejected %s"
            " | re-sent while held %d, after the answer %d | superseded %d | unsent %d",
            self.scored,
            dict(self.errors) or "none",
            len(self.queue) + len(self.solo),
            self.pool.busy_count(),
            self.pool.ready_count(),
            len(self.pool.workers),
            self.pool.restarts,
            dict(self.rejects.counts) or "none",
            self.duplicates,
            self.answered_again,
            self.superseded,
            self.unsent,
        )

    def close(self) -> None:
        self.pool.close()
        self.sock.close(linger=1000)  # the last Scores still go out
