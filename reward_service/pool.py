"""The worker pool: reward functions run in child processes the service can kill.

A thread cannot be stopped, so a reward function that hangs (or spins in C code, or segfaults)
would take its worker with it. Each worker is a spawned process with a pipe: the service sends it
a batch, and a worker past ``timeout_s`` is killed and replaced. CPU-bound rule rewards also
scale with the number of workers, which a thread pool would not (the GIL).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from flywheel.procs import descendants
from reward_service.scoring import FunctionSpec, Item, Outcome, Scorer

log = logging.getLogger(__name__)


# A replacement worker that fails to start is started again this many times in a row before the
# pool gives up: what failed the first start (the config, the code) fails every one, but what
# killed a replacement (memory still short after an OOM kill, a slow disk) may not be there next.
REPLACEMENT_STARTS = 5


class PoolError(RuntimeError):
    """The pool cannot work at all (a worker failed to start): the service must stop."""


@dataclass
class Worker:
    index: int
    proc: Any  # multiprocessing SpawnProcess
    conn: Connection
    started_at: float
    ready: bool = False
    batch: list[Item] = field(default_factory=list)
    sent_at: float = 0.0
    batch_seq: int = 0  # the number of the batch sent last, which its answer must carry
    # a replacement's consecutive failed starts (a first start that fails fails the pool)
    replacement: bool = False
    failed_starts: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.batch)


Result = tuple[list[Item], list[Outcome] | str]  # outcomes, or why the whole batch failed


class WorkerPool:
    def __init__(
        self,
        size: int,
        specs: list[FunctionSpec],
        tokenizer: str | None,
        context: dict[str, Any],
        timeout_s: float,
        start_timeout_s: float = 180.0,
    ) -> None:
        self._args = (specs, tokenizer, context)
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._mp = mp.get_context("spawn")  # no fork: the parent holds ZeroMQ sockets and threads
        self.restarts = 0
        self.workers = [self._spawn(i) for i in range(size)]

    def _spawn(self, index: int, replacement: bool = False, failed_starts: int = 0) -> Worker:
        parent, child = self._mp.Pipe()
        proc = self._mp.Process(target=_worker_main, args=(child, *self._args), name=f"reward-worker-{index}")
        proc.daemon = True  # (the worker lifts the flag for itself: see _worker_main)
        proc.start()
        child.close()
        return Worker(index, proc, parent, time.monotonic(), replacement=replacement, failed_starts=failed_starts)

    def filenos(self) -> list[int]:
        return [w.conn.fileno() for w in self.workers]

    def idle(self) -> list[Worker]:
        return [w for w in self.workers if w.ready and not w.busy]

    def ready_count(self) -> int:
        return sum(w.ready for w in self.workers)

    def busy_count(self) -> int:
        return sum(w.busy for w in self.workers)

    def submit(self, worker: Worker, items: list[Item]) -> bool:
        """Hand ``items`` to an idle worker; False if it died while idle (``collect`` replaces it,
        and the items are the caller's to hand to another)."""
        if not worker.proc.is_alive():  # (collect replaces it; a send could block: see there)
            log.warning("reward worker %d is gone: its batch goes to another", worker.index)
            return False
        try:
            worker.conn.send((worker.batch_seq + 1, items))
        except OSError as err:  # BrokenPipeError: killed (the OOM killer) since it last answered
            log.warning("reward worker %d is gone (%s): its batch goes to another", worker.index, err)
            return False
        worker.batch_seq += 1
        worker.batch, worker.sent_at = items, time.monotonic()
        return True

    def collect(self) -> list[Result]:
        """Finished batches, plus batches whose worker died or ran past the deadline (their
        worker is replaced). Raises PoolError when a worker cannot start (``_start_failed``)."""
        results: list[Result] = []
        now = time.monotonic()
        for i, w in enumerate(self.workers):
            failure = start_failure = None
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg == "ready":
                        w.ready, w.failed_starts = True, 0
                    elif isinstance(msg, tuple) and msg[0] == "init_error":
                        start_failure = f"failed to start: {msg[1]}"
                        break
                    elif isinstance(msg, tuple) and msg[0] == w.batch_seq and w.busy:
                        results.append((w.batch, msg[1]))
                        w.batch = []
                    else:  # not the answer to the batch it holds: who else writes on its pipe?
                        failure = "crash: an answer to no batch it held (a process its reward function forked?)"
                        break
            except (EOFError, OSError):
                w.proc.join(timeout=1)  # (its exit code is known once it is reaped)
                start_failure, failure = self._exit_reason(w)
            if failure is None and start_failure is None and not w.proc.is_alive():
                # Dead without an end-of-file on its pipe: a child its reward function forked
                # still holds the pipe open. Seen only by the timeout of a batch sent to it, or
                # never while it is idle (and a batch larger than the pipe's buffer blocked this
                # loop in the send).
                start_failure, failure = self._exit_reason(w)
            if failure is None and w.busy and now - w.sent_at > self.timeout_s:
                failure = f"timeout: no answer within reward.timeout_s = {self.timeout_s:g}s"
            if start_failure is None and not w.ready and now - w.started_at > self.start_timeout_s:
                start_failure = f"did not start within {self.start_timeout_s:g}s"
            if start_failure is not None:
                self._start_failed(i, w, start_failure)
            elif failure is not None:
                log.warning("reward worker %d: %s (%d samples); restarting it", w.index, failure, len(w.batch))
                if w.batch:
                    results.append((w.batch, failure))
                self._kill(w)
                self.workers[i] = self._spawn(w.index, replacement=True)
                self.restarts += 1
        return results

    @staticmethod
    def _exit_reason(w: Worker) -> tuple[str | None, str | None]:
        """(start failure, failure) of a worker that exited."""
        if not w.ready:
            return f"exited with code {w.proc.exitcode} before it was ready", None
        return None, f"crash: worker exited with code {w.proc.exitcode}"

    def _start_failed(self, i: int, w: Worker, why: str) -> None:
        """A worker that could not start (it holds no batch: none is sent before it is ready). A
        first start that fails fails the pool: restarting would fail the same way, forever. A
        replacement is started again, up to ``REPLACEMENT_STARTS`` times in a row."""
        failed = w.failed_starts + 1
        if not w.replacement or failed > REPLACEMENT_STARTS:
            tries = f" ({failed} replacements in a row)" if w.replacement else ""
            raise PoolError(f"reward worker {why}{tries}")
        log.warning("replacement reward worker %d %s: starting it again (%d of %d)", w.index, why, failed,
                    REPLACEMENT_STARTS)  # fmt: skip
        self._kill(w)
        self.workers[i] = self._spawn(w.index, replacement=True, failed_starts=failed)
        self.restarts += 1

    def _kill(self, w: Worker) -> None:
        # What the reward function started goes with it (a sandbox running generated code, say):
        # killed alone, the worker left them running, holding the service's output. Its own
        # process group holds them even once the worker is dead (a crash, the OOM killer), when
        # they are no longer its descendants; those that left the group (setsid) are found
        # below it while it lives.
        if w.proc.is_alive():
            for pid in descendants(w.proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL)  # (the worker leads a group of its own: _worker_main)
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5)
        w.conn.close()

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                w.conn.send(None)
        deadline = time.monotonic() + 2
        for w in self.workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(w)


def _worker_main(conn: Connection, specs: list[FunctionSpec], tokenizer: str | None, context: dict[str, Any]) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the service decides
    # Daemonic, so that a service that exits without closing the pool never waits for a hung
    # worker; but a daemonic process may start no child, and reward functions that run code in
    # a multiprocessing Process or Pool (a sandbox with a timeout) are common. The pool kills
    # what they start with the worker (_kill).
    mp.current_process().daemon = False
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a process group of its own, which what its functions start joins (_kill)
    own_pid = os.getpid()
    try:
        scorer = Scorer(specs, tokenizer, context)
    except Exception as err:
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the service is gone
        if message is None:
            return
        seq, items = message
        outcomes = scorer.score(items)
        if os.getpid() != own_pid:  # a child the reward function forked came back here: not ours to answer
            os._exit(1)
        conn.send((seq, outcomes))


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the service dies, even by kill -9, so a hung reward
    function never outlives it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
