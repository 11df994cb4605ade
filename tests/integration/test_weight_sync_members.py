"""The learner's weight-sync membership when a generator's process is replaced under its id (a
restart, or a spare taking its place): a sync waiting for the old process's ack stops waiting as
soon as the new one says it is back, instead of waiting out the deadline."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from flywheel.config import SyncConfig
from flywheel.redis_server import free_port
from generators.sync_link import SyncLink
from learner.weight_sync import SyncReport, WeightBroadcaster
from tests.conftest import ROOT, wait_until


def test_a_generator_back_under_its_id_ends_the_wait_for_the_old_ones_ack() -> None:
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=20)
    wb = WeightBroadcaster(cfg)
    old = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen0", 1)
    new: SyncLink | None = None
    try:

        def joined_at_v7() -> bool:
            old.join(7, every_s=0.05)
            wb.poll(50)
            return "gen0" in wb.members and wb.members["gen0"].version == 7

        wait_until(joined_at_v7, 15, "gen0's SyncJoin at v7")
        old.close()  # killed while the learner sends it v8
        new = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen0", 1)
        stop = threading.Event()

        def new_process() -> None:  # the replacement heartbeats as a fresh generator does: v0
            while not stop.is_set():
                assert new is not None
                new.join(0, every_s=0.1)
                time.sleep(0.05)

        report = SyncReport(version=8, members=["gen0"])
        thread = threading.Thread(target=new_process, daemon=True)
        started = time.monotonic()
        thread.start()
        wb._collect_acks(8, time.time() + cfg.timeout_s, report)
        waited = time.monotonic() - started
        assert report.evicted == {"gen0": "restarted during the sync"}, report
        assert waited < 5, f"waited {waited:.1f}s of a {cfg.timeout_s:.0f}s deadline"
        member = wb.members["gen0"]  # joined afresh (settles for JOIN_SETTLE_S), at v0
        assert member.version == 0 and member.joined >= started
        wait_until(lambda: wb.behind(8) == ["gen0"], 10, "the new process listed as lacking v8's weights")
        stop.set()
        thread.join(timeout=5)
    finally:
        if new is not None:
            new.close()
        wb.close()


def test_a_new_process_under_a_known_id_at_the_same_version_is_seen_as_new() -> None:
    """A spare that took a dead generator's id at the version the dead one served (both synced
    to v7) was taken for the old process: the next sync broadcast on the group the old one had
    been in, to a process that holds none of it. Its SyncJoin's incarnation now tells them apart."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=20)
    wb = WeightBroadcaster(cfg)
    old = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen0", 1)
    new: SyncLink | None = None
    try:

        def joined_since(link: SyncLink, since: float) -> bool:
            link.join(7, every_s=0.05)
            wb.poll(50)
            member = wb.members.get("gen0")
            return member is not None and member.last_seen > since

        wait_until(lambda: joined_since(old, 0.0), 15, "the old process's SyncJoin at v7")
        assert not wb._restarted
        old.close()
        closed = time.monotonic()
        new = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen0", 1)
        wait_until(lambda: joined_since(new, closed), 15, "the new process's SyncJoin at v7")  # type: ignore[arg-type]
        assert wb._restarted == {"gen0"}  # the next sync builds the group again, with the new process
    finally:
        if new is not None:
            new.close()
        wb.close()


def start_member(ports: tuple[int, int], gen_id: str, *mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.weight_member", str(ports[0]), str(ports[1]), gen_id, *mode],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_generator_replaced_between_syncs_gets_a_group_of_its_own() -> None:
    """A generator's process replaced under its id while no sync ran (a restart, or a spare taking
    its place): the next sync builds the group again with the new process, rather than broadcast
    on the old group to a process that is gone (real gloo groups, real processes)."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=8)
    ports = (cfg.announce_port, cfg.join_port)
    wb = WeightBroadcaster(cfg)
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    members = [start_member(ports, "gen0")]
    try:
        assert wb.wait_for_members(1, timeout_s=30)
        first = wb.sync(1, tensors.items())
        assert first.acked == ["gen0"] and first.rebuilt_group, first
        assert members[0].stdout is not None and members[0].stdout.readline().split() == ["loaded", "1", "1020"]

        members[0].kill()  # killed between syncs; its replacement joins under the same id at v0
        members[0].wait(timeout=10)
        members.append(start_member(ports, "gen0"))
        wait_until(lambda: wb.behind(1) == ["gen0"], 30, "the new process listed as lacking v1's weights")

        t0 = time.monotonic()
        second = wb.sync(2, tensors.items())
        assert second.acked == ["gen0"] and second.rebuilt_group and not second.evicted, second
        assert time.monotonic() - t0 < cfg.timeout_s / 2
        assert members[1].stdout is not None and members[1].stdout.readline().split() == ["loaded", "2", "1020"]
    finally:
        for member in members:
            member.kill()
            member.wait(timeout=10)
        wb.close()


def joining(link: SyncLink) -> tuple[threading.Event, threading.Thread]:
    """A thread sending ``link``'s SyncJoin at every heartbeat (0.1 s) until the event is set."""
    stop = threading.Event()

    def heartbeats() -> None:
        while not stop.is_set():
            link.join(0, every_s=0.1)
            time.sleep(0.05)

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    return stop, thread


def test_a_generator_that_never_comes_to_the_rendezvous_stops_failing_the_fleets_syncs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A generator that says it joins but whose ranks never reach the group's rendezvous (its sync
    worker hung, or the learner's store unreachable from its node): the sync it is in fails for
    every member (a collective needs every rank), and without a time out it was back in the next
    group at its next SyncJoin, failing every sync of the run. It is left out; the next sync
    reaches the others (real gloo group, real processes)."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=3)
    ports = (cfg.announce_port, cfg.join_port)
    wb = WeightBroadcaster(cfg)
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    member = start_member(ports, "gen0")
    ghost = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen1", 1)
    stop, thread = joining(ghost)  # joins at every heartbeat, never comes to a rendezvous
    try:
        assert wb.wait_for_members(2, timeout_s=30)
        with caplog.at_level(logging.WARNING, logger="learner.weight_sync"):
            first = wb.sync(1, tensors.items())
        assert first.members == ["gen0", "gen1"] and not first.acked, first
        assert "generator gen1 never came to the weight group's rendezvous (ranks [2])" in caplog.text
        assert "gen0 never came" not in caplog.text  # it came: the failure was not its own
        wait_until(lambda: wb.behind(2) == ["gen0"], 15, "gen0 back in the sync after its failed join, gen1 not")
        second = wb.sync(2, tensors.items())
        assert second.members == ["gen0"] and second.acked == ["gen0"] and not second.evicted, second
        assert "gen1" in wb.members and "gen1" not in wb.live_members()  # still heard, left out
        assert member.stdout is not None and member.stdout.readline().split() == ["loaded", "2", "1020"]
    finally:
        stop.set()
        thread.join(timeout=5)
        ghost.close()
        member.kill()
        member.wait(timeout=10)
        wb.close()


def heard(wb: WeightBroadcaster) -> bool:
    """Take in what the members sent (for a ``wait_until`` predicate)."""
    wb.poll(50)
    return True


def test_a_generator_that_fails_every_sync_the_others_take_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """A generator whose loader refuses every sync (its own vLLM, its own memory) while the others
    take the same weights: each failure closed the group, and it was back at its next SyncJoin, so
    the whole fleet built the group again at every sync of the run (an NCCL rendezvous, every
    engine paused). After two failures in a row it is left out; the group then holds (real gloo
    group, real processes)."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=8)
    ports = (cfg.announce_port, cfg.join_port)
    wb = WeightBroadcaster(cfg)
    wb.quarantine.base_s = 300  # its time out outlasts the test on a slow machine
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    members = [start_member(ports, "gen0"), start_member(ports, "gen1", "refuses")]
    try:
        reports = []
        for version in (1, 2, 3, 4):
            expected = 2 if version <= 2 else 1
            wait_until(lambda n=expected: heard(wb) and len(wb.live_members()) == n, 60, f"sync {version}'s members")
            with caplog.at_level(logging.WARNING, logger="learner.weight_sync"):
                reports.append(wb.sync(version, tensors.items()))
            assert reports[-1].acked == ["gen0"], reports[-1]
            if version <= 2:
                assert "KeyError" in reports[-1].evicted["gen1"], reports[-1]
                wait_until(lambda: heard(wb) and "gen1" in wb.members, 15, "gen1's next SyncJoin")
        assert "generator gen1 failed 2 weight syncs in a row that the others took" in caplog.text
        assert [r.members for r in reports] == [["gen0", "gen1"], ["gen0", "gen1"], ["gen0"], ["gen0"]], reports
        assert not reports[3].rebuilt_group, "the group was built again with nothing changed"
        assert "gen1" in wb.members and "gen1" not in wb.live_members()  # still heard, left out
    finally:
        for member in members:
            member.kill()
            member.wait(timeout=10)
        wb.close()


def test_a_generator_that_stops_leaves_the_next_sync_at_once() -> None:
    """A generator drained away (the autoscaler's scale-down, a SIGTERM) sent no word: it stayed a
    member for member_timeout_s after its last SyncJoin, and a sync announced meanwhile named it
    and waited out its whole deadline for ranks that never came, the rest of the fleet paused.
    It says it leaves as it stops; the next sync is the others' alone."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=20, member_timeout_s=30)
    wb = WeightBroadcaster(cfg)
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    member = start_member((cfg.announce_port, cfg.join_port), "gen0")
    leaver = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen1", 1)
    stop, thread = joining(leaver)  # a member until it stops
    try:
        assert wb.wait_for_members(2, timeout_s=30)
        stop.set()
        thread.join(timeout=5)
        leaver.leave(0)
        leaver.close()
        wait_until(lambda: wb.poll(50) or "gen1" not in wb.members, 5, "gen1 out of the sync")
        started = time.monotonic()
        report = wb.sync(1, tensors.items())
        assert report.members == ["gen0"] and report.acked == ["gen0"], report
        assert time.monotonic() - started < 10  # not the 20 s deadline
    finally:
        member.kill()
        member.wait(timeout=10)
        wb.close()


def test_a_generator_that_stops_after_a_sync_named_it_does_not_cost_that_sync_its_deadline() -> None:
    """A generator that stops (a scale-down) between the sync's announcement and its rendezvous:
    rank 0 waited out the whole deadline (20 s here) for ranks that would never come, the rest of
    the fleet paused; its leave now ends the wait at once, and the others have the weights at the
    next sync."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=20, member_timeout_s=30)
    wb = WeightBroadcaster(cfg)
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    member = start_member((cfg.announce_port, cfg.join_port), "gen0")
    leaver = SyncLink("127.0.0.1", cfg.announce_port, cfg.join_port, "gen1", 1)
    stop, thread = joining(leaver)
    named = threading.Event()

    def leave_once_named() -> None:
        # the announcement names it: it stops instead of joining (read off the announce socket
        # alone: the join thread still sends on the other, and a ZeroMQ socket is one thread's)
        while not leaver.sub.poll(10):
            pass
        stop.set()
        thread.join(timeout=5)
        leaver.leave(0)
        named.set()

    watcher = threading.Thread(target=leave_once_named, daemon=True)
    try:
        assert wb.wait_for_members(2, timeout_s=30)
        watcher.start()
        started = time.monotonic()
        first = wb.sync(1, tensors.items())
        assert named.is_set() and time.monotonic() - started < 10, first  # not the 20 s deadline
        assert first.members == ["gen0", "gen1"] and first.evicted.get("gen1") == "left the sync", first
        wait_until(lambda: wb.behind(2) == ["gen0"], 15, "gen0 back in the sync")
        second = wb.sync(2, tensors.items())
        assert second.members == ["gen0"] and second.acked == ["gen0"], second
    finally:
        stop.set()
        watcher.join(timeout=5)
        leaver.close()
        member.kill()
        member.wait(timeout=10)
        wb.close()


def test_a_generator_back_after_it_left_the_sync_gets_a_group_of_its_own() -> None:
    """A generator silent past member_timeout_s leaves the sync; a new process under its id (its
    restart took longer) then joins as a newcomer, not as a restart, and the membership of the
    next sync equals that of the group: the group was reused, the broadcast went to the gone
    process's ranks and the new one failed to join (the whole sync lost, every member evicted)."""
    cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=8, member_timeout_s=2)
    ports = (cfg.announce_port, cfg.join_port)
    wb = WeightBroadcaster(cfg)
    tensors = {"w": torch.ones(1000), "b": torch.full((10,), 2.0)}
    members = [start_member(ports, "gen0")]
    try:
        assert wb.wait_for_members(1, timeout_s=30)
        assert wb.sync(1, tensors.items()).acked == ["gen0"]
        members[0].kill()
        members[0].wait(timeout=10)

        def left() -> bool:
            wb.poll(50)
            return "gen0" not in wb.live_members() and "gen0" not in wb.members

        wait_until(left, 15, "gen0 out of the sync for its silence")
        members.append(start_member(ports, "gen0"))
        assert wb.wait_for_members(1, timeout_s=30)
        second = wb.sync(2, tensors.items())
        assert second.acked == ["gen0"] and second.rebuilt_group and not second.evicted, second
        assert members[1].stdout is not None and members[1].stdout.readline().split() == ["loaded", "2", "1020"]
    finally:
        for member in members:
            member.kill()
            member.wait(timeout=10)
        wb.close()
