"""A service stand-in for the launcher's stop tests: on SIGTERM it "drains" for a while, then
exits 0, writing ``NAME term T`` and ``NAME exit T`` (monotonic clock) to a shared file.

    python -m tests.integration.draining_child NAME DRAIN_S FILE
"""

from __future__ import annotations

import signal
import sys
import time


def main(name: str, drain_s: float, path: str) -> None:
    asked: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: asked.append(time.monotonic()))
    while not asked:
        time.sleep(0.01)
    with open(path, "a") as f:
        f.write(f"{name} term {asked[0]}\n")
    time.sleep(drain_s)
    with open(path, "a") as f:
        f.write(f"{name} exit {time.monotonic()}\n")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
