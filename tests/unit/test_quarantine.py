"""The weight sync's time outs for generators that never came to a rendezvous: doubling, cleared
by an ack, and forgotten once their generator is gone for good."""

from __future__ import annotations

import time

from learner.weight_sync import QUARANTINE_MAX_S, Quarantine


def test_each_repeat_doubles_the_time_out_up_to_its_cap() -> None:
    q = Quarantine(base_s=100.0)
    now = time.monotonic()
    lengths = []
    for _ in range(5):
        q.add("gen1", "never came")
        lengths.append(round(q.until["gen1"] - now, -1))
    assert lengths == [100.0, 200.0, 400.0, QUARANTINE_MAX_S, QUARANTINE_MAX_S]
    assert q.holds("gen1", now) and not q.holds("gen2", now)
    q.clear("gen1")  # it acked a sync: a fresh start
    assert not q.holds("gen1", now) and "gen1" not in q.strikes


def test_the_records_of_generators_gone_for_good_are_forgotten() -> None:
    q = Quarantine(base_s=10.0)
    q.add("gone", "never came")
    q.add("still-heard", "never came")
    now = time.monotonic()
    q.forget_gone({"still-heard"}, now)
    assert "gone" in q.until  # its time out is not over: kept (it may be back)
    q.forget_gone({"still-heard"}, now + 11)
    assert "gone" not in q.until and "gone" not in q.strikes
    assert "still-heard" in q.strikes  # heard from: its record (and its strikes) stay


def test_failed_syncs_quarantine_from_the_second_in_a_row_and_an_ack_forgives_them() -> None:
    q = Quarantine(base_s=10.0)
    now = time.monotonic()
    q.failed_sync("gen1", "KeyError")
    assert not q.holds("gen1", now)  # one failure may be a hiccup
    q.failed_sync("gen1", "KeyError")
    assert q.holds("gen1", now) and q.strikes["gen1"] == 1
    q.failed_sync("gen1", "missed the deadline")  # back, and failing again: at once, for longer
    assert q.strikes["gen1"] == 2 and q.until["gen1"] - now > 15
    q.clear("gen1")  # it acked a sync
    q.failed_sync("gen1", "KeyError")
    assert not q.holds("gen1", now)


def test_the_failure_count_of_a_generator_gone_for_good_is_forgotten() -> None:
    q = Quarantine(base_s=10.0)
    q.failed_sync("gone", "KeyError")
    now = time.monotonic()
    q.forget_gone(set(), now)
    assert "gone" in q.failed_in_a_row  # away between its eviction and its next SyncJoin: kept
    q.forget_gone(set(), now + 11)
    assert "gone" not in q.failed_in_a_row
