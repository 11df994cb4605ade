"""The weight-transfer layout and its transports, shared by the learner (rank 0, the sender) and
the generator workers (ranks 1..N, the receivers).

Parameters are laid end to end into flat ``uint8`` buckets of about ``bucket_bytes`` each, in a
fixed order; the ``BucketLayout`` list in ``WeightsReady`` tells a receiver how to cut a bucket
back into named tensors. Every tensor starts at a 64-byte aligned offset, so a receiver can view
the bytes as the tensor's dtype without copying.

The process group is standalone: a ``TCPStore`` hosted by the learner plus a gloo (CPU) or NCCL
(GPU) group built directly on it, never ``torch.distributed.init_process_group``, so it cannot
disturb DeepSpeed's or vLLM's own groups. With ``ipc`` (the learner and the workers on one GPU)
there is no process group: the buckets go through CUDA IPC buffers, the store carrying the
handshake (``flywheel.weights_ipc``). Every operation has the group's timeout: a peer that
never shows up makes the call raise instead of hang.

Importing this module imports torch; config-only code paths must not import it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flywheel.wire import BucketLayout, WeightsReady

ALIGN = 64
"""Byte alignment of every tensor inside a bucket."""
CLOSE_TIMEOUT_S = 10.0
"""How long closing an NCCL group may take before it is left behind."""
NCCL_WATCHDOG_GRACE_S = 60.0
"""NCCL's watchdog timeout past the group's own: ``WeightGroup.finish`` aborts the group first."""
LEFT_CHECK_S = 0.05  # how often rank 0 asks, while it waits for the ranks, whether some will never come

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
TRANSPORT_BACKENDS = {"gloo": "gloo", "nccl": "nccl"}
"""Transports that run over a process group; ``ipc`` (colocated on one GPU) is a separate path
(``flywheel.weights_ipc``): the same rendezvous and bucket layout, the buckets through CUDA IPC."""
TRANSPORTS = ("gloo", "nccl", "ipc")


class WeightSyncError(RuntimeError):
    """A weight transfer failed: bad layout, a peer missing its deadline, a transport error."""


class RanksLeft(WeightSyncError):
    """Rank 0 gave up the rendezvous: ``left`` ranks' generators stopped after the sync named them."""

    def __init__(self, message: str, left: list[int]) -> None:
        super().__init__(message)
        self.left = left


class RanksMissing(WeightSyncError):
    """Rank 0 waited out the rendezvous and these ranks never came (dead, hung, or unable to reach
    the store): the learner leaves their generators out rather than fail every later sync too."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise WeightSyncError(f"cannot transfer tensors of dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightSyncError(f"unknown dtype {name!r} in the bucket layout; supported: {sorted(_DTYPES)}") from None


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_offsets(layout: BucketLayout) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor of a bucket; the same rule on both sides of the wire."""
    spans = []
    offset = 0
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch_dtype(dtype).itemsize
        spans.append((offset, nbytes))
        offset = _aligned(offset + nbytes)
    return spans


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketLayout]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[BucketLayout] = []
    cur = BucketLayout(names=[], shapes=[], dtypes=[], nbytes=0)
    for name, t in tensors:
        size = t.numel() * t.element_size()
        start = _aligned(cur.nbytes)
        if cur.names and start + size > bucket_bytes:
            buckets.append(cur)
            cur = BucketLayout(names=[], shapes=[], dtypes=[], nbytes=0)
            start = 0
        cur.names.append(name)
        cur.shapes.append(list(t.shape))
        cur.dtypes.append(dtype_name(t.dtype))
        cur.nbytes = start + size
    if cur.names:
        buckets.append(cur)
    return buckets


def pack_bucket(
    tensors: list[torch.Tensor],
    layout: BucketLayout,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``tensors`` (in layout order) into one flat uint8 buffer (``out`` when given: reusing
    a buffer saves the page faults of a fresh allocation, which cost as much as the copy)."""
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device) if out is None else out[: layout.nbytes]
    by_width: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, (off, n) in zip(tensors, tensor_offsets(layout), strict=True):
        dst, src = _as_widest(buf[off : off + n], t.detach().contiguous().reshape(-1).view(torch.uint8))
        pair = by_width.setdefault(dst.dtype, ([], []))
        pair[0].append(dst)
        pair[1].append(src)
    for dsts, srcs in by_width.values():
        torch._foreach_copy_(dsts, srcs)  # one multi-tensor copy per width instead of a launch per tensor
    return buf


def _as_widest(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two same-sized byte views, reinterpreted as the widest integers both divide into.

    A GPU copy kernel moves a few elements per thread, so copying as bytes runs at a fraction of
    the memory bandwidth (a 1 GB bucket took 4.4 ms on an H200, against 2.8 ms to broadcast it);
    as 8-byte words it runs near the bandwidth. Bit patterns are moved, never converted."""
    for wide in (torch.int64, torch.int32, torch.int16):
        size = wide.itemsize
        if dst.numel() % size == 0 and dst.data_ptr() % size == 0 and src.data_ptr() % size == 0:
            return dst.view(wide), src.view(wide)
    return dst, src


def unpack_bucket(buf: torch.Tensor, layout: BucketLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``buf`` as the named tensors of ``layout`` (no copy)."""
    if buf.numel() != layout.nbytes:
        raise WeightSyncError(f"bucket holds {buf.numel()} bytes, layout says {layout.nbytes}")
    spans = tensor_offsets(layout)
    for name, shape, dtype, (off, n) in zip(layout.names, layout.shapes, layout.dtypes, spans, strict=True):
        if off + n > layout.nbytes:
            raise WeightSyncError(f"tensor {name} runs past the end of its bucket ({off + n} > {layout.nbytes})")
        yield name, buf[off : off + n].view(torch_dtype(dtype)).view(shape)


def check_layout(buckets: list[BucketLayout], max_bytes: int) -> None:
    """Reject layouts that would make a receiver allocate nonsense (negative or huge shapes)."""
    total = 0
    for i, b in enumerate(buckets):
        for name, shape in zip(b.names, b.shapes, strict=True):
            if any(d < 0 for d in shape):
                raise WeightSyncError(f"buckets[{i}]: tensor {name} has a negative dimension {shape}")
        spans = tensor_offsets(b)
        need = spans[-1][0] + spans[-1][1] if spans else 0
        if need != b.nbytes:
            raise WeightSyncError(f"buckets[{i}]: nbytes {b.nbytes} does not match its tensors ({need} bytes)")
        total += b.nbytes
    if total > max_bytes:
        raise WeightSyncError(f"layout holds {total} bytes, more than the limit {max_bytes}")


@dataclass
class WeightGroup:
    """A standalone process group for broadcasting weights from rank 0 (for ``ipc``: the store only)."""

    pg: Any  # ProcessGroupGloo or ProcessGroupNCCL; None for ipc
    rank: int
    world_size: int
    epoch: int
    device: torch.device
    store: dist.TCPStore | None = None  # held by rank 0: the rendezvous server lives as long as the group
    op_timeout_s: float = 600.0  # how long one broadcast may take before the group is given up
    # the current sync's deadline (unix time): no broadcast waits past it, so a sync of many
    # buckets ends by it, not op_timeout_s a bucket later
    deadline: float | None = None
    send_buffers: list[torch.Tensor] = field(default_factory=list)  # rank 0: two, reused every sync
    recv_pool: list[torch.Tensor] = field(default_factory=list)  # receivers: buffers no one references any more
    connected: bool = False  # whether the backend's links are up (gloo: at construction; NCCL: first broadcast)
    transport: str = "gloo"
    ipc_store: Any = None  # ipc: every rank's view of the rendezvous store, which carries the handshake
    sync_prefix: str = ""  # ipc, rank 0: the current sync's keys (weights_ipc.sync_prefix)
    ipc_generation: int = 0  # ipc: of rank 0's two buffers (rank 0: made; receivers: opened)
    ipc_opened: list[torch.Tensor] = field(default_factory=list)  # ipc receivers: rank 0's buffers, kept open

    def time_left_s(self) -> float:
        """What one broadcast may take now: ``op_timeout_s``, and never past the sync's deadline."""
        if self.deadline is None:
            return self.op_timeout_s
        return max(0.1, min(self.op_timeout_s, self.deadline - time.time()))

    def start(self, buf: torch.Tensor) -> Any:
        """Post a broadcast from rank 0 into ``buf``; returns the work to ``finish``."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        # The backend's own timeout, from this sync's time: the group's is the time that was left
        # when it was built, which every later sync on it kept (gloo gave up a bucket that came
        # later than that, failing the whole sync). NCCL's watchdog, which tears the process
        # down, stays behind ``finish``'s poll, which aborts the group first.
        grace = NCCL_WATCHDOG_GRACE_S if self.transport == "nccl" else 0.0
        opts.timeout = timedelta(seconds=self.time_left_s() + grace)
        try:
            if self.connected:
                return self.pg.broadcast([buf], opts)
            return self._first_broadcast(buf, opts)
        except RuntimeError as err:
            raise WeightSyncError(f"broadcast failed (rank {self.rank}/{self.world_size}): {err}") from err

    def _first_broadcast(self, buf: torch.Tensor, opts: Any) -> Any:
        """NCCL sets its communicator up inside the group's first collective, in a call that waits
        for every rank with no timeout: a rank that passed the barrier but never came this far (out
        of memory for its buffer, killed) hung this one for good, past every deadline of the
        sync. So the first one is posted from a thread and given ``op_timeout_s``; if it does not
        return, the group is given up (the thread stays behind, blocked, holding nothing else)."""
        posted: dict[str, Any] = {}

        def post() -> None:
            try:
                if buf.device.type == "cuda":
                    # the current device is per thread; the current stream there is the default
                    # one, on which the caller packed ``buf`` (pack_bucket uses no stream of its own)
                    torch.cuda.set_device(buf.device)
                posted["work"] = self.pg.broadcast([buf], opts)
            except BaseException as err:  # handed to the caller's thread
                posted["error"] = err

        poster = threading.Thread(target=post, name="weights-first-broadcast", daemon=True)
        poster.start()
        waited_s = self.time_left_s()  # (not past the sync's deadline: the join took some of it)
        poster.join(waited_s)
        if poster.is_alive():
            self.close()
            raise WeightSyncError(
                f"the group's links were not up within {waited_s:g}s (rank {self.rank}/{self.world_size}): "
                "a rank that joined never came to the first broadcast; the group is given up"
            )
        if "error" in posted:
            raise posted["error"]
        self.connected = True
        return posted["work"]

    def finish(self, work: Any) -> None:
        """Wait for a posted broadcast, at most ``op_timeout_s``.

        NCCL's ``wait()`` only makes the device stream wait: it returns at once and raises
        nothing, and a dead peer is noticed, if ever, by NCCL's watchdog, which tears the whole
        process down. So completion is polled here, and past the timeout the group is aborted (a
        generator acks the error and rejoins; the learner evicts). Gloo's own timeout ends its
        operations; the poll changes nothing there."""
        timeout_s = self.time_left_s()
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.close()
                raise WeightSyncError(
                    f"broadcast not complete within {timeout_s:g}s (rank {self.rank}/{self.world_size}): "
                    "the group is given up"
                )
            time.sleep(0.0002)
        try:
            work.wait()  # raises the operation's error; on NCCL, orders the stream after it
        except RuntimeError as err:  # gloo/NCCL raise RuntimeError subclasses on timeouts and dead peers
            raise WeightSyncError(f"broadcast failed (rank {self.rank}/{self.world_size}): {err}") from err

    def broadcast(self, buf: torch.Tensor) -> None:
        self.finish(self.start(buf))

    def close(self) -> None:
        """Release the group. NCCL's orderly shutdown is collective (it waits until every rank
        shuts down), so a learner that stops while its generators serve on would hang in it: an
        NCCL group is aborted instead, which needs no peer, on a thread given a few seconds."""
        if self.pg is None:  # ipc: no process group, only the store (and rank 0's buffers, opened)
            self.ipc_opened = []
            return
        if type(self.pg).__name__ != "ProcessGroupNCCL":
            _quietly(self.pg.shutdown)
            return
        aborting = threading.Thread(target=_quietly, args=(self.pg.abort,), daemon=True)
        aborting.start()
        aborting.join(CLOSE_TIMEOUT_S)
        if aborting.is_alive():
            log.warning("the NCCL weight group did not abort within %.0fs: left behind", CLOSE_TIMEOUT_S)


def _quietly(release: Callable[[], Any]) -> None:
    with contextlib.suppress(RuntimeError, AttributeError):  # already broken: nothing to release
        release()


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0: start the rendezvous server on a free port of ``host`` (read it back from
    ``store.port``).

    torch's TCPStore listens on every interface whatever host it is given; the socket is bound
    here, on ``host`` only, and handed over (``master_listen_fd``: the store owns and closes it),
    so that ``sync.host`` 127.0.0.1 keeps the rendezvous off the network as it does the sync's
    other ports."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the socket from here, failure included (closing it again could close an fd
    # another thread has been given since).
    return dist.TCPStore(
        host,
        port,
        None,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def join_group(
    transport: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    epoch: int,
    timeout_s: float,
    store: dist.TCPStore | None = None,
    device: torch.device | str = "cpu",
    ranks_left: Callable[[], list[int]] | None = None,
) -> WeightGroup:
    """Build the group (blocks until every rank joined, at most ``timeout_s``). ``ranks_left``
    (rank 0's): ranks that will never come, whose wait is given up at once (``RanksLeft``)."""
    if transport not in TRANSPORTS:
        raise WeightSyncError(f"unknown weight transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    backend = TRANSPORT_BACKENDS.get(transport)
    timeout = timedelta(seconds=max(timeout_s, 0.1))
    try:
        if store is None:
            store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        prefix = dist.PrefixStore(f"flywheel/weights/{epoch}", store)
        _all_joined(prefix, rank, world_size, timeout_s, ranks_left)
        if backend is None:  # ipc: the store is the whole group
            return WeightGroup(
                None,
                rank,
                world_size,
                epoch,
                torch.device(device),
                store if rank == 0 else None,
                op_timeout_s=max(timeout_s, 0.1),
                connected=True,
                transport=transport,
                ipc_store=prefix,
            )
        if backend == "gloo":
            # gloo listens on the address its host name resolves to (a cluster node's network
            # address) unless told: on the interface that reaches the learner instead, which is
            # loopback when ``sync.host`` is
            opts_gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts_gloo._timeout = timeout
            opts_gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(host, port))]
            pg: Any = dist.ProcessGroupGloo(prefix, rank, world_size, opts_gloo)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            # NCCL's own watchdog tears the process down at this timeout: past our poll's
            # (WeightGroup.finish), which aborts the group first
            opts._timeout = timeout + timedelta(seconds=NCCL_WATCHDOG_GRACE_S)
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    except (RanksMissing, RanksLeft):  # rank 0's: it names the absent ranks, which the learner acts on
        raise
    except (RuntimeError, OSError, dist.DistStoreError) as err:
        raise WeightSyncError(
            f"could not join the {transport} weight group at {host}:{port} as rank {rank}/{world_size}: {err}"
        ) from err
    return WeightGroup(
        pg,
        rank,
        world_size,
        epoch,
        torch.device(device),
        store if rank == 0 else None,
        op_timeout_s=max(timeout_s, 0.1),
        connected=backend == "gloo",  # gloo connects every pair while the group is built
        transport=transport,
    )


def _local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (``host`` itself on the learner): no
    packet is sent, a UDP socket's connect only picks the route."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def _all_joined(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    ranks_left: Callable[[], list[int]] | None = None,
) -> None:
    """A barrier on the rendezvous store before the group is built: NCCL builds its communicator
    at the first broadcast, in a call that waits for every rank with no timeout at all, so a rank
    that never came (dead, or its announcement lost) would hang rank 0 for good (one that passes
    the barrier and dies before the first broadcast is ``WeightGroup._first_broadcast``'s).

    Each rank also leaves its own mark, so that rank 0, when the wait runs out, can name the ranks
    that never came (``RanksMissing``). A rank known gone (``ranks_left``, asked every
    ``LEFT_CHECK_S``) ends the wait at once instead."""
    store.set(f"arrived/{rank}", "1")
    store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + LEFT_CHECK_S
    while (joined := store.add("joined", 0)) < world_size:
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + LEFT_CHECK_S
            if rank == 0 and ranks_left is not None and (left := ranks_left()):
                store.set("abandoned", "1")  # the ranks waiting here give up too, and say so
                raise RanksLeft(f"ranks {left} left (their generators stopped) before the weight group was built", left)
            if rank != 0 and store.check(["abandoned"]):
                raise WeightSyncError("rank 0 gave up the weight group's rendezvous: a rank it named will not come")
        if time.monotonic() > deadline:
            message = f"{joined} of {world_size} ranks joined the weight group within {timeout_s:g}s"
            if rank != 0:
                raise WeightSyncError(message)
            missing = [r for r in range(world_size) if not store.check([f"arrived/{r}"])]
            raise RanksMissing(f"{message}; never came: ranks {missing}", missing)
        time.sleep(0.005)


def join_announced(ready: WeightsReady, rank: int, device: torch.device | str = "cpu") -> WeightGroup:
    """A generator's side: join the group ``ready`` announces, as ``rank``, by its deadline."""
    timeout = ready.due - time.time()
    if timeout <= 0:
        raise WeightSyncError(f"the deadline of version {ready.version} passed before this worker could join")
    return join_group(
        ready.transport,
        ready.master_addr,
        ready.master_port,
        rank,
        ready.world_size,
        ready.epoch,
        timeout,
        device=device,
    )


def receive(group: WeightGroup, ready: WeightsReady) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive every bucket of ``ready``, yielding named tensors bucket by bucket.

    Double-buffered: the next bucket is already on the wire while the caller loads this one, so
    at most two buckets are held at a time (``ipc``: each bucket is copied out of rank 0's shared
    buffers into memory of its own, which the caller may keep).
    """
    if group.transport == "ipc":
        from flywheel.weights_ipc import receive_ipc, sync_prefix

        yield from receive_ipc(group, ready, sync_prefix(ready.version, ready.sync_stamp))
        return

    def post(layout: BucketLayout) -> tuple[BucketLayout, torch.Tensor, Any]:
        buf = _recv_buffer(group, layout.nbytes, pooled)
        return layout, buf, group.start(buf)

    pooled = pooled_buffer_bytes(ready.buckets)

    layouts = iter(ready.buckets)
    first = next(layouts, None)
    current = post(first) if first is not None else None
    while current is not None:
        layout, buf, work = current
        group.finish(work)
        following = next(layouts, None)
        current = post(following) if following is not None else None
        yield from unpack_bucket(buf, layout)


def pooled_buffer_bytes(buckets: list[BucketLayout]) -> int:
    """The size of the receive buffers kept between buckets and syncs: the largest bucket of
    several tensors (about ``sync.bucket_mb``). A tensor bigger than a bucket comes alone, in a
    buffer of its own that is not kept: pooled buffers that size (an untied 152k x 3584
    embedding is 1.1 GB in bf16) would hold up to four times it for good, on the GPU, outside
    vLLM's memory budget."""
    shared = [b.nbytes for b in buckets if len(b.names) > 1]
    return max(shared) if shared else max((b.nbytes for b in buckets), default=0)


def _recv_buffer(group: WeightGroup, nbytes: int, pooled: int) -> torch.Tensor:
    """A buffer for the next bucket: a pooled one that nothing references any more, or a new one.

    The consumer may keep views of a bucket after it asked for the next (vLLM's layer-wise reload
    holds a layer's tensors until the layer is complete), so a buffer is reused only once its
    storage has no other user. Reuse saves the page faults of fresh memory, which on CPUs cost
    as much as the transfer itself. A bucket over ``pooled`` bytes gets a buffer of its own.
    """
    if nbytes > pooled:
        return torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    for i, buf in enumerate(group.recv_pool):
        # 2 = the pooled tensor + the temporary storage object of this call; a live view adds 1
        if buf.numel() >= nbytes and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2:
            del group.recv_pool[i]
            group.recv_pool.append(buf)  # most recently used last
            return buf[:nbytes]
    buf = torch.empty(pooled, dtype=torch.uint8, device=group.device)
    group.recv_pool.append(buf)
    if len(group.recv_pool) > 4:
        group.recv_pool.pop(0)  # forget the oldest; whoever still holds its views keeps it alive
    return buf[:nbytes]


def send(group: WeightGroup, buckets: list[BucketLayout], tensors: dict[str, torch.Tensor]) -> float:
    """Rank 0: broadcast every bucket, packing the next one while the last is on the wire.

    Returns the seconds spent.
    """
    start = time.perf_counter()
    if group.transport == "ipc":
        from flywheel.weights_ipc import send_ipc

        send_ipc(group, buckets, tensors, group.sync_prefix)
        return time.perf_counter() - start

    def as_it_is(layout: BucketLayout) -> torch.Tensor | None:
        """A bucket of one tensor goes as it is, with no copy, where it can."""
        only = tensors[layout.names[0]] if len(layout.names) == 1 else None
        if only is not None and only.is_contiguous() and only.device == group.device:
            return only.detach().reshape(-1).view(torch.uint8)
        return None

    # the two packing buffers: as large as the largest bucket packed, not the largest tensor
    packed = max((b.nbytes for b in buckets if as_it_is(b) is None), default=-1)
    # (-1: none is packed; 0: only buckets of empty tensors are, which still need a buffer)
    if packed >= 0 and (not group.send_buffers or group.send_buffers[0].numel() < max(packed, 1)):
        group.send_buffers = [torch.empty(max(packed, 1), dtype=torch.uint8, device=group.device) for _ in range(2)]
    in_flight: tuple[torch.Tensor, Any] | None = None  # the buffer must outlive its work
    for i, layout in enumerate(buckets):
        buf = as_it_is(layout)
        if buf is None:
            buf = pack_bucket([tensors[n] for n in layout.names], layout, out=group.send_buffers[i % 2])
        work = group.start(buf)
        if in_flight is not None:
            group.finish(in_flight[1])
        in_flight = (buf, work)
    if in_flight is not None:
        group.finish(in_flight[1])
    return time.perf_counter() - start
