"""Start and stop service processes: each child is tracked by pid and stopped only by pid.

Every service runs in its own session (process group) so that what it spawns (vLLM's engine-core
and worker processes) goes with it: ``kill9`` is what a dying container or node does to all of
them, and ``stop`` leaves no orphan behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

KILLED_EXIT_S = 5.0  # how long a stop waits for a process it has SIGKILLed to be gone


class ServiceHandle(Protocol):
    """What a launcher needs of a running service, wherever it runs (here, or a Ray actor)."""

    name: str
    log_path: Path

    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def terminate(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    def tail(self, n: int = 30) -> str: ...


class Service:
    """One child process (``python -m module args``) with its log file."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self._terminated = False
        self._group_killed = False  # its leader reaped and the rest killed: the id may be reused
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=die_with_parent if cpus is None else partial(_pinned_child, frozenset(cpus)),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.returncode is None

    @property
    def returncode(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self._kill_group()  # what it left running goes with it, now, while the group id is ours
        return code

    def kill9(self) -> None:
        """SIGKILL the service and every process it started (its process group)."""
        self._kill_group()
        self.proc.wait(timeout=10)
        self._group_killed = True

    def terminate(self) -> None:
        """SIGTERM without waiting: the service starts draining (``stop`` waits for it). Sent
        once: a second SIGTERM would cut a service's drain short."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the service drains and exits), then SIGKILL whatever of its group is left,
        after at most ``timeout_s`` (0: at once)."""
        self.terminate()
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        self._kill_group()
        try:  # a SIGKILLed process is gone within moments, but not at once: a wait of 0 would raise
            self.proc.wait(timeout=max(timeout_s, KILLED_EXIT_S))
        except subprocess.TimeoutExpired:  # (in uninterruptible sleep: it goes when the kernel lets it)
            log.warning("%s (pid %d) has not exited %gs after SIGKILL", self.name, self.proc.pid, KILLED_EXIT_S)
        self._group_killed = True  # (killed before its leader was reaped: never signalled again)
        self._log.close()

    def _kill_group(self) -> None:
        # The group id is the service's pid (start_new_session): only processes it started are in it.
        # Once its leader is reaped and the rest are killed, the id is free for the system to give
        # to an unrelated process: the group is never signalled again.
        if self._group_killed:
            return
        # While it lives, what it started is found below it even outside its group: the reward
        # service's workers lead groups of their own, and what their functions start (a sandbox,
        # setsid) may too. Once it is dead they are orphans, found by nobody.
        strays = descendants(self.proc.pid) if self.proc.poll() is None else []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._group_killed = self.proc.poll() is not None

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the parent dies, even by kill -9, so a
    launcher that vanishes leaves no service behind (each drains and exits as on Ctrl-C), nor its
    Redis (which shuts down cleanly on SIGTERM)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pinned_child(cpus: frozenset[int]) -> None:
    """``die_with_parent``, and the child (with every thread and process it starts) runs on
    ``cpus`` only. Set before exec, so even a library that sizes its thread pools at import (torch,
    vLLM's OpenMP binding) sees the pinned set."""
    die_with_parent()
    os.sched_setaffinity(0, cpus)


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6} (the notation of taskset and /proc/cpuinfo)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list; write e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: the range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def wait_for_state_file(path: Path, service: ServiceHandle, timeout_s: float = 60.0) -> dict[str, int]:
    """Wait until a service writes its ports, failing fast if it dies first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not service.alive():
            raise RuntimeError(f"{service.name} exited ({service.returncode}) before listening:\n{service.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} did not start within {timeout_s}s:\n{service.tail()}")
        time.sleep(0.05)
    ports: dict[str, int] = json.loads(path.read_text())
    return ports


@contextlib.contextmanager
def scratch_dir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh directory under the system's temp dir for one run's files (Redis's AOF among them:
    gigabytes after a saturated benchmark), removed afterwards unless ``keep``."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if keep:
            print(f"run files kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
