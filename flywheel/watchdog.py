"""A watchdog for blocking waits: any wait that outlasts its bound is reported while it is still
waiting (a log line naming it, and a count per wait), not only when it ends.

Every blocking wait in Flywheel already has a timeout; the watchdog catches what a timeout does
not: a wait that is legal but far longer than it should be (a claim starved by a stalled fleet,
a weight sync or a checkpoint that crawls, a Redis write stuck behind a slow disk). Services
wrap their waits::

    with WATCHDOG.wait("claim batch v12", bound_s=cfg.run.watchdog_s):
        batch = client.claim(...)

and export ``WATCHDOG.overdue`` with their metrics.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger("flywheel.watchdog")


@dataclass
class _Wait:
    what: str
    kind: str  # what is counted: the wait's name without its particulars ("claim batch")
    started: float
    bound_s: float
    reported: bool = False


class Watchdog:
    def __init__(self, interval_s: float = 1.0, report: Callable[[str], None] | None = None) -> None:
        self.interval_s = interval_s
        self.report = report or log.warning
        self.overdue: Counter[str] = Counter()  # waits that outlasted their bound, by kind
        self._waits: dict[int, _Wait] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def wait(self, what: str, bound_s: float, kind: str | None = None) -> Iterator[None]:
        """Watch the enclosed wait; ``kind`` (default: ``what`` up to its first digit) is the
        name it is counted under."""
        self._ensure_thread()
        key = next(self._ids)
        entry = _Wait(what, kind or _kind(what), time.monotonic(), bound_s)
        with self._lock:
            self._waits[key] = entry
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(key, None)
            took = time.monotonic() - entry.started
            if took > entry.bound_s and not entry.reported:
                self._overdue(entry, f"watchdog: {entry.what} took {took:.1f}s, past its bound of {bound_s:g}s")
            elif entry.reported:
                self.report(f"watchdog: {entry.what} finished after {took:.1f}s")

    def check(self) -> None:
        """Report every wait in progress past its bound (the thread calls this)."""
        now = time.monotonic()
        with self._lock:
            late = [w for w in self._waits.values() if not w.reported and now - w.started > w.bound_s]
            for w in late:
                w.reported = True
        for w in late:
            self._overdue(w, f"watchdog: {w.what} waiting for {now - w.started:.1f}s, past its bound of {w.bound_s:g}s")

    def _overdue(self, w: _Wait, message: str) -> None:
        self.overdue[w.kind] += 1
        self.report(message)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # the watchdog must never take its process down
                log.exception("watchdog check failed")


def _kind(what: str) -> str:
    words = []
    for word in what.split():
        if any(ch.isdigit() for ch in word):
            break
        words.append(word)
    return " ".join(words) or what


WATCHDOG = Watchdog()  # one per process
