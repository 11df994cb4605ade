"""A reward worker: takes ScoreRequests from the hub, answers with Scores.

The hub hands each worker at most ``capacity`` samples at a time (credit-based), re-sends what
is not answered in time, and drops a worker that stops re-registering (its heartbeat).
"""

from __future__ import annotations

import logging
import time

import zmq

from flywheel.wire import Decoder, RewardRegister, Score, ScoreRequest, WireError, encode
from reward_service.functions import RewardFn

log = logging.getLogger(__name__)


class RewardWorker:
    def __init__(self, address: str, worker_id: str, capacity: int, fn: RewardFn, heartbeat_s: float = 1.0) -> None:
        self.worker_id = worker_id
        self.capacity = capacity
        self.fn = fn
        self.heartbeat_s = heartbeat_s
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder = Decoder(ScoreRequest)
        self.scored = 0
        self._stop = False

    def stop(self) -> None:
        self._stop = True

    def run(self, max_seconds: float | None = None) -> None:
        start = last_hello = 0.0
        start = time.monotonic()
        while not self._stop and (max_seconds is None or time.monotonic() - start < max_seconds):
            now = time.monotonic()
            if now - last_hello >= self.heartbeat_s:
                last_hello = now
                self.sock.send(encode(RewardRegister(worker_id=self.worker_id, capacity=self.capacity)))
            if not self.sock.poll(100, zmq.POLLIN):
                continue
            while True:
                try:
                    payload = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    req = self.decoder.decode(payload)
                except WireError as err:
                    log.warning("bad message from hub: %s", err)
                    continue
                assert isinstance(req, ScoreRequest)
                self.sock.send(encode(self._score(req)))

    def _score(self, req: ScoreRequest) -> Score:
        try:
            reward, breakdown = self.fn(req)
            error = None
        except Exception as err:  # a reward bug must not kill the worker: the error is reported
            reward, breakdown, error = 0.0, {}, f"{type(err).__name__}: {err}"
            log.warning("reward failed for (group %d, sample %d): %s", req.group_id, req.sample, error)
        self.scored += 1
        return Score(
            worker_id=self.worker_id,
            group_id=req.group_id,
            sample=req.sample,
            reward=reward,
            breakdown=breakdown,
            error=error,
        )

    def close(self) -> None:
        self.sock.close(linger=0)
