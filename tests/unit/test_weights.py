"""The weight-transfer layout (pure functions) and the standalone gloo group between two processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch

from flywheel.weights import (
    ALIGN,
    RanksMissing,
    WeightSyncError,
    check_layout,
    host_store,
    join_group,
    pack_bucket,
    plan_buckets,
    receive,
    send,
    tensor_offsets,
    unpack_bucket,
)
from flywheel.wire import BucketLayout, WeightsReady


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),  # 60 bytes: the next tensor starts at 64
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(9, dtype=torch.int64)),
        ("big", torch.randn(64, 64, generator=g)),  # 16 KiB: larger than a bucket, gets its own
        ("d", torch.randn(2, generator=g)),
    ]


def test_plan_keeps_order_and_bucket_size() -> None:
    buckets = plan_buckets(named(), bucket_bytes=1024)
    assert [b.names for b in buckets] == [["a", "b", "c"], ["big"], ["d"]]
    assert buckets[0].nbytes == 64 + 64 + 72  # aligned offsets, the last tensor unpadded
    assert all(off % ALIGN == 0 for b in buckets for off, _ in tensor_offsets(b))
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(named(), 0)


def test_pack_unpack_round_trip_keeps_values_and_dtypes() -> None:
    tensors = dict(named())
    for layout in plan_buckets(tensors.items(), bucket_bytes=4096):
        buf = pack_bucket([tensors[n] for n in layout.names], layout)
        assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
        for name, t in unpack_bucket(buf, layout):
            assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name])


def test_bad_layouts_are_refused_before_any_allocation() -> None:
    ok = BucketLayout(names=["w"], shapes=[[2, 3]], dtypes=["float32"], nbytes=24)
    check_layout([ok], max_bytes=1024)
    with pytest.raises(WeightSyncError, match="negative"):
        check_layout([BucketLayout(names=["w"], shapes=[[-2, 3]], dtypes=["float32"], nbytes=-24)], 1024)
    with pytest.raises(WeightSyncError, match="does not match"):
        check_layout([BucketLayout(names=["w"], shapes=[[2, 3]], dtypes=["float32"], nbytes=99)], 1024)
    with pytest.raises(WeightSyncError, match="limit"):
        check_layout([ok], max_bytes=10)
    with pytest.raises(WeightSyncError, match="unknown dtype"):
        check_layout([BucketLayout(names=["w"], shapes=[[2]], dtypes=["complex-ish"], nbytes=8)], 1024)
    with pytest.raises(WeightSyncError, match="holds"):
        list(unpack_bucket(torch.empty(5, dtype=torch.uint8), ok))


def _receiver(port: int, ready_bytes: bytes, out: mp.Queue, taken: Any) -> None:  # type: ignore[type-arg]
    from flywheel.wire import Decoder

    ready = Decoder(WeightsReady).decode(ready_bytes)
    assert isinstance(ready, WeightsReady)
    group = join_group("gloo", "127.0.0.1", port, 1, 2, ready.epoch, 30)
    out.put({name: t.clone() for name, t in receive(group, ready)})
    # Tensors cross the queue as shared-memory handles this process serves: it must outlive the
    # parent's unpickling, or the parent finds the handle's socket gone.
    taken.wait(60)
    group.close()


def test_two_processes_broadcast_every_bucket() -> None:
    from flywheel.wire import encode

    tensors = dict(named())
    buckets = plan_buckets(tensors.items(), bucket_bytes=1024)
    store = host_store("127.0.0.1", 30)
    ready = WeightsReady(
        version=1,
        buckets=buckets,
        transport="gloo",
        deadline=time.time() + 30,
        epoch=7,
        master_addr="127.0.0.1",
        master_port=store.port,
        world_size=2,
        ranks={"g": 1},
    )
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    taken = ctx.Event()
    proc = ctx.Process(target=_receiver, args=(store.port, encode(ready), out, taken))
    proc.start()
    try:
        group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 7, 30, store=store)
        send(group, buckets, tensors)
        # "big" went as it is: the packing buffers are a bucket's size, not the largest tensor's
        assert all(b.numel() <= 1024 for b in group.send_buffers), [b.numel() for b in group.send_buffers]
        got = out.get(timeout=60)
    finally:
        taken.set()
        proc.join(timeout=30)
    assert proc.exitcode == 0
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(got[name], t)


def test_a_sender_that_never_comes_raises_at_the_timeout() -> None:
    store = host_store("127.0.0.1", 30)  # the rendezvous exists, but rank 0 never joins the group
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not join"):
        join_group("gloo", "127.0.0.1", store.port, 1, 2, 1, timeout_s=1.5)
    assert time.monotonic() - start < 10


def test_a_rank_that_never_comes_is_named_at_the_rendezvous_before_any_group_is_built() -> None:
    """NCCL builds its communicator at the first broadcast, waiting for every rank with no timeout:
    the ranks meet on the rendezvous store first, within the timeout, and a missing one is named."""
    store = host_store("127.0.0.1", 30)
    start = time.monotonic()
    with pytest.raises(RanksMissing, match="1 of 2 ranks joined the weight group within 1.5s") as raised:
        join_group("gloo", "127.0.0.1", store.port, 0, 2, 3, timeout_s=1.5, store=store)
    assert raised.value.missing == [1]
    assert time.monotonic() - start < 10


def test_a_broadcast_that_does_not_complete_gives_the_group_up_at_its_timeout() -> None:
    """A peer in the group that never takes part: the wait ends at the group's timeout, as NCCL's
    (whose wait() returns at once) would not on its own."""
    import threading

    store = host_store("127.0.0.1", 30)
    joined = threading.Event()
    peer: list[Any] = []

    def silent_peer() -> None:  # joins, then never posts its side of the broadcast
        peer.append(join_group("gloo", "127.0.0.1", store.port, 1, 2, 4, timeout_s=3))
        joined.set()

    threading.Thread(target=silent_peer, daemon=True).start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 4, timeout_s=3, store=store)
    assert joined.wait(30)
    group.op_timeout_s = 0.5  # (the gloo group's own timeout is 3 s)
    buf = torch.zeros(1 << 22, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="not complete within 0.5s"):
        group.broadcast(buf)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("left_s", [0.3, -5.0])
def test_no_broadcast_waits_past_the_syncs_deadline(left_s: float) -> None:
    """Each broadcast had the whole op_timeout_s (the time left when the sync began): a sync of
    many buckets could run that long a bucket, far past its deadline, the engine paused all along."""
    import threading

    store = host_store("127.0.0.1", 30)
    joined = threading.Event()
    peer: list[Any] = []

    def silent_peer() -> None:
        peer.append(join_group("gloo", "127.0.0.1", store.port, 1, 2, 5, timeout_s=4))
        joined.set()

    threading.Thread(target=silent_peer, daemon=True).start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 5, timeout_s=4, store=store)
    assert joined.wait(30)
    group.op_timeout_s, group.deadline = 20.0, time.time() + left_s  # near or past (gloo: 4 s)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="not complete within"):
        group.broadcast(torch.zeros(1 << 20, dtype=torch.uint8))
    assert time.monotonic() - start < 3


def test_a_group_reused_by_a_later_sync_waits_by_that_syncs_deadline() -> None:
    """A receiver that joined its gloo group with 1 s of its sync left kept that 1 s as gloo's
    timeout for the group's life: at a later sync on the same group, a bucket that came 2 s in
    (another generator slow to pause) timed out on it, and the whole sync failed. Each broadcast
    now takes the time its own sync has left."""
    import threading

    store = host_store("127.0.0.1", 30)
    got: dict[str, Any] = {}
    receiver: list[Any] = []
    joined = threading.Event()

    def late_joiner() -> None:
        receiver.append(join_group("gloo", "127.0.0.1", store.port, 1, 2, 6, timeout_s=1.0))
        joined.set()

    threading.Thread(target=late_joiner, daemon=True).start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 6, timeout_s=30, store=store)
    assert joined.wait(30)
    peer = receiver[0]
    peer.op_timeout_s, peer.deadline = 20.0, time.time() + 20  # the later sync's, as worker_ext sets them

    def take() -> None:
        buf = torch.zeros(16, dtype=torch.uint8)
        try:
            peer.broadcast(buf)
            got["value"] = int(buf.sum())
        except WeightSyncError as err:
            got["error"] = str(err)

    taking = threading.Thread(target=take, daemon=True)
    taking.start()
    time.sleep(2.0)  # the bucket comes late, well inside this sync's 20 s
    with contextlib.suppress(WeightSyncError):  # (the receiver's failure shows below)
        group.broadcast(torch.ones(16, dtype=torch.uint8))
    taking.join(30)
    assert got == {"value": 16}, got


def test_a_bucket_of_empty_tensors_alone_to_pack_is_sent() -> None:
    """Two large tensors that go as they are and, between them, a bucket of empty ones (a
    learner's first sync): no packing buffer was made, since the largest bucket to pack holds 0
    bytes, and the send raised IndexError out of the sync."""
    import threading

    tensors = {"a": torch.ones(2000), "z1": torch.empty(0), "z2": torch.empty(0), "b": torch.full((2000,), 2.0)}
    buckets = plan_buckets(tensors.items(), 4000)
    assert [b.names for b in buckets] == [["a"], ["z1", "z2"], ["b"]]
    store = host_store("127.0.0.1", 30)
    received: dict[str, torch.Tensor] = {}

    def receiver() -> None:
        peer = join_group("gloo", "127.0.0.1", store.port, 1, 2, 7, timeout_s=30)
        ready = WeightsReady(
            version=1, buckets=buckets, transport="gloo", deadline=time.time() + 30, epoch=7,
            master_addr="127.0.0.1", master_port=store.port, world_size=2, ranks={"g": 1},
        )  # fmt: skip
        received.update({name: t.clone() for name, t in receive(peer, ready)})

    taking = threading.Thread(target=receiver, daemon=True)
    taking.start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 7, timeout_s=30, store=store)
    send(group, buckets, tensors)
    taking.join(30)
    assert sorted(received) == ["a", "b", "z1", "z2"] and float(received["b"].sum()) == 4000.0


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(WeightSyncError, match="unknown weight transport 'mpi'; use one of gloo, nccl, ipc"):
        join_group("mpi", "127.0.0.1", 1, 1, 2, 1, timeout_s=1)


def test_receive_buffers_are_reused_only_once_no_view_remains() -> None:
    from flywheel.weights import WeightGroup, _recv_buffer

    group = WeightGroup(pg=None, rank=1, world_size=2, epoch=1, device=torch.device("cpu"))
    first = _recv_buffer(group, 64, 128)
    view = first[:16].view(torch.float32)  # a consumer still holding a tensor of the last bucket
    second = _recv_buffer(group, 64, 128)
    assert second.data_ptr() != first.data_ptr(), "a buffer still referenced was handed out again"
    del view, first
    third = _recv_buffer(group, 64, 128)
    assert third.data_ptr() != second.data_ptr()  # `second` is still held here
    del third
    fourth = _recv_buffer(group, 32, 128)
    assert len(group.recv_pool) <= 4 and fourth.numel() == 32


def test_closing_an_nccl_group_aborts_it_without_waiting_for_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner that stops while its generators serve on must not hang in NCCL's collective
    shutdown (seen on 2×H200): the group is aborted, and closing returns even if that stalls."""
    import threading

    from flywheel import weights

    stalled = threading.Event()

    class ProcessGroupNCCL:  # what close() tells NCCL groups apart by
        def __init__(self) -> None:
            self.calls: list[str] = []

        def shutdown(self) -> None:
            self.calls.append("shutdown")

        def abort(self) -> None:
            self.calls.append("abort")
            stalled.wait(30)  # an abort that does not come back

    monkeypatch.setattr(weights, "CLOSE_TIMEOUT_S", 0.2)
    pg = ProcessGroupNCCL()
    start = time.monotonic()
    weights.WeightGroup(pg, 0, 2, 1, torch.device("cpu")).close()
    stalled.set()
    assert pg.calls == ["abort"]
    assert time.monotonic() - start < 5


def test_an_nccl_first_broadcast_that_never_returns_gives_the_group_up_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL sets its communicator up inside the first broadcast, waiting with no timeout for every
    rank: one that passed the barrier and then died hung the learner for good. The first
    broadcast now runs on a thread given the sync's deadline (tests/gpu runs it on real NCCL)."""
    import threading

    from flywheel import weights

    released = threading.Event()

    class ProcessGroupNCCL:
        def __init__(self, blocks: bool) -> None:
            self.blocks, self.calls = blocks, []

        def broadcast(self, tensors: list[torch.Tensor], opts: object) -> str:
            self.calls.append("broadcast")
            if self.blocks:
                released.wait(30)  # the communicator's setup, waiting for a rank that never comes
            return "work"

        def abort(self) -> None:
            self.calls.append("abort")

    monkeypatch.setattr(weights, "CLOSE_TIMEOUT_S", 2.0)
    stuck = ProcessGroupNCCL(blocks=True)
    group = weights.WeightGroup(stuck, 0, 2, 1, torch.device("cpu"), op_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(weights.WeightSyncError, match="a rank that joined never came to the first broadcast"):
        group.start(torch.zeros(8, dtype=torch.uint8))
    assert time.monotonic() - start < 10 and stuck.calls == ["broadcast", "abort"]
    # a receiver's new group: op_timeout_s is what was left when its join began, and the join
    # took some of it; the first broadcast waits no later than the sync's deadline
    stuck = ProcessGroupNCCL(blocks=True)
    group = weights.WeightGroup(stuck, 1, 2, 1, torch.device("cpu"), op_timeout_s=8.0, deadline=time.time() + 0.5)
    start = time.monotonic()
    with pytest.raises(weights.WeightSyncError, match="not up within 0.[45]"):
        group.start(torch.zeros(8, dtype=torch.uint8))
    assert time.monotonic() - start < 3
    released.set()
    fine = ProcessGroupNCCL(blocks=False)
    group = weights.WeightGroup(fine, 0, 2, 1, torch.device("cpu"), op_timeout_s=10)
    assert group.start(torch.zeros(8, dtype=torch.uint8)) == "work" and group.connected
    assert group.start(torch.zeros(8, dtype=torch.uint8)) == "work"  # then posted directly


def test_an_overlapped_sync_reports_from_its_thread_and_hands_failures_to_the_loop() -> None:
    from flywheel.config import SyncConfig
    from flywheel.redis_server import free_port
    from learner.weight_sync import OverlappedSync, SyncReport, WeightBroadcaster

    wb = WeightBroadcaster(SyncConfig(announce_port=free_port(), join_port=free_port(), timeout_s=5))
    reports: list[SyncReport] = []
    overlapped = OverlappedSync(wb, reports.append, wait_s=30)
    weights = {"w": torch.zeros(4)}
    overlapped.start(1, weights)
    weights["w"].add_(1.0)  # the next optimizer step, in place: the thread has its own copy
    overlapped.start(2, weights)  # waits for v1 first
    overlapped.wait()
    assert [r.version for r in reports] == [1, 2] and not reports[0].members  # nobody joined: nothing sent
    wb.close()  # a sync on closed sockets fails in the thread...
    overlapped.start(3, weights)
    with pytest.raises(RuntimeError, match="weight sync failed"):
        overlapped.wait()  # ...and the failure reaches the caller
    overlapped.wait()  # raised once, then clear


def test_members_that_joined_behind_the_last_sync_or_need_weights_are_named() -> None:
    """What the learner reads while it waits for a batch (real ZMQ sockets, as in a run): a
    generator whose version is older than the last sync's, or one that says it holds no usable
    weights, is behind; an ack of the current version clears it."""
    from flywheel.config import SyncConfig
    from flywheel.redis_server import free_port
    from flywheel.wire import WeightsAck, encode
    from generators.sync_link import SyncLink
    from learner import weight_sync
    from learner.weight_sync import WeightBroadcaster

    ports = (free_port(), free_port())
    wb = WeightBroadcaster(SyncConfig(announce_port=ports[0], join_port=ports[1], timeout_s=5))
    old = SyncLink("127.0.0.1", *ports, "restarted", workers=1)
    fresh = SyncLink("127.0.0.1", *ports, "awaiting", workers=1)
    current = SyncLink("127.0.0.1", *ports, "current", workers=1)
    try:
        time.sleep(0.6)  # a link announces itself once its subscription has had time to arrive
        old.join(0, every_s=0)
        fresh.join(3, every_s=0, needs_weights=True)
        current.join(3, every_s=0)
        time.sleep(0.2)
        wb.poll()  # the learner reads joins at each look (every CATCH_UP_CHECK_S while it waits)
        time.sleep(weight_sync.JOIN_SETTLE_S + 0.1)  # members take part once they settled
        assert wb.behind(3) == ["awaiting", "restarted"]
        assert wb.behind(0) == ["awaiting"]  # version 0 is what every generator loads first
        fresh.dealer.send(encode(WeightsAck(generator_id="awaiting", version=3, epoch=wb.epoch)))
        time.sleep(0.2)
        assert wb.behind(3) == ["restarted"]
    finally:
        for link in (old, fresh, current):
            link.close()
        wb.close()


def test_the_rendezvous_store_listens_on_its_host_only() -> None:
    """torch's TCPStore listens on every interface whatever host it is given: ``sync.host``
    127.0.0.1 must keep the rendezvous off the network, as it does the sync's other ports."""

    store = host_store("127.0.0.1", 30)
    listening = [
        c.laddr
        for c in psutil.Process(os.getpid()).net_connections(kind="inet")
        if c.laddr.port == store.port and c.status == psutil.CONN_LISTEN
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    client = torch.distributed.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=timedelta(seconds=10))
    client.set("reached", "yes")  # and it serves
    assert store.get("reached") == b"yes"

    # gloo's own sockets too (they follow the host name's address unless told; on this machine
    # that address is loopback as well, so only a machine with a networked host name tells)
    def listening() -> set[tuple[str, int]]:
        conns = psutil.Process(os.getpid()).net_connections(kind="inet")
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

    before = listening()
    peer: list[Any] = []
    thread = threading.Thread(target=lambda: peer.append(join_group("gloo", "127.0.0.1", store.port, 1, 2, 4, 20)))
    thread.start()
    group = join_group("gloo", "127.0.0.1", store.port, 0, 2, 4, 20, store=store)
    thread.join(timeout=30)
    opened = listening() - before
    assert opened and {ip for ip, _ in opened} == {"127.0.0.1"}, opened
    group.close()
    peer[0].close()


def test_a_tensor_bigger_than_a_bucket_gets_a_receive_buffer_that_is_not_kept() -> None:
    """Pooled receive buffers were all as large as the largest tensor: for a 7B model's untied
    embedding, four buffers of 1.1 GB each on every GPU worker, for good, outside vLLM's budget."""
    from flywheel.weights import WeightGroup, _recv_buffer, pooled_buffer_bytes

    buckets = plan_buckets(named(), bucket_bytes=1024)
    big = next(b for b in buckets if b.names == ["big"])
    pooled = pooled_buffer_bytes(buckets)
    assert pooled <= 1024 < big.nbytes
    group = WeightGroup(pg=None, rank=1, world_size=2, epoch=1, device=torch.device("cpu"))
    small = _recv_buffer(group, 200, pooled)
    del small
    alone = _recv_buffer(group, big.nbytes, pooled)
    assert alone.numel() == big.nbytes
    assert [b.numel() for b in group.recv_pool] == [pooled]  # the big one's buffer is not kept
    assert pooled_buffer_bytes([big]) == big.nbytes  # a layout of single tensors pools their size


def test_a_cpu_learner_refuses_a_gpu_transport_with_the_fix() -> None:
    from flywheel.config import SyncConfig
    from flywheel.redis_server import free_port
    from learner.weight_sync import WeightBroadcaster

    for transport in ("nccl", "ipc"):
        cfg = SyncConfig(announce_port=free_port(), join_port=free_port(), transport=transport)
        with pytest.raises(ValueError, match=f"sync.transport {transport} needs the learner on a CUDA GPU"):
            WeightBroadcaster(cfg, device="cpu")
