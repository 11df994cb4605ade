"""The watchdog reports a wait past its bound while it still waits, counts it by kind, and says
when it ended; waits within their bound are not reported."""

from __future__ import annotations

import time

from flywheel.watchdog import Watchdog


def test_a_wait_past_its_bound_is_reported_while_it_waits() -> None:
    lines: list[str] = []
    dog = Watchdog(interval_s=0.05, report=lines.append)
    with dog.wait("claim of the batch for v12", bound_s=0.2):
        time.sleep(0.5)
        assert any("claim of the batch for v12 waiting for" in line for line in lines), lines  # not only at the end
    assert dog.overdue == {"claim of the batch for": 1}
    assert "finished after" in lines[-1]
    with dog.wait("claim of the batch for v13", bound_s=5):
        time.sleep(0.1)
    assert dog.overdue == {"claim of the batch for": 1} and len(lines) == 2


def test_a_wait_that_ends_past_its_bound_before_a_check_is_still_counted() -> None:
    lines: list[str] = []
    dog = Watchdog(interval_s=60, report=lines.append)  # the thread never looks in time
    with dog.wait("weight sync v3", bound_s=0.01):
        time.sleep(0.05)
    assert dog.overdue == {"weight sync": 1}
    assert "took" in lines[0] and "bound of 0.01s" in lines[0]
