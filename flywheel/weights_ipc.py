"""The weight sync's ``ipc`` transport: the learner and its generators on one GPU.

NCCL refuses a communicator whose two ranks sit on one device, and gloo would take the weights
through host memory twice. Here rank 0 packs each bucket into one of two GPU buffers that every
receiver has opened as a CUDA IPC handle, and the receivers copy it out, device to device. The
rendezvous store carries the handshake (the keys of one sync under its own prefix):

- ``gen``: the generation of rank 0's two buffers (a new one whenever they are allocated again,
  for bigger buckets); ``buffers/{gen}/{rank}`` (under the group, not the sync): their IPC
  handles, shared for that receiver (each share has its own reference count, which the
  receiver's storage gives back when it is freed). A receiver opens them once a generation and
  keeps them open between syncs: opening a handle costs milliseconds, a sync's whole budget on
  a small model;
- ``ready/{i}``: rank 0 packed bucket ``i`` (into buffer ``i % 2``, its stream synchronised);
- ``done/{i}/{rank}``: that receiver copied it out; rank 0 reuses the buffer for bucket ``i + 2``
  only once every receiver has said so;
- ``big/{i}/{rank}``: a bucket larger than the two buffers (one tensor bigger than a bucket: an
  untied embedding) goes through a buffer of its own, shared for that bucket only and freed once
  every receiver copied it: buffers kept at that size would hold twice it on the GPU for good.

Rank 0 deletes a sync's keys once every receiver is done with them: a group serves syncs for as
long as its membership holds, and its store would otherwise grow by a few keys a bucket each time.

The same bucket layout as the process-group transports, and the same timeouts: every wait on
the store ends by the sync's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import msgspec
import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from flywheel.weights import WeightGroup
    from flywheel.wire import BucketLayout, WeightsReady


def sync_prefix(version: int, stamp: float) -> str:
    """One sync's keys: a group serves many syncs, and a catch-up sync re-sends a version.
    ``stamp`` is ``WeightsReady.sync_stamp``, the same number on both sides."""
    return f"ipc/{version}/{int(stamp * 1e6)}"


def _wait(store: dist.Store, keys: list[str], group: WeightGroup, what: str) -> None:
    from flywheel.weights import WeightSyncError

    left = (group.deadline - time.time()) if group.deadline is not None else group.op_timeout_s
    left = max(0.1, min(left, group.op_timeout_s))
    try:
        store.wait(keys, timedelta(seconds=left))
    except (RuntimeError, OSError) as err:  # DistStoreError (a RuntimeError) on timeout
        raise WeightSyncError(
            f"ipc weight sync: {what} did not come within {left:.1f}s (rank {group.rank}/{group.world_size}): {err}"
        ) from err


def _share(buf: torch.Tensor) -> bytes:
    """The CUDA IPC handle of ``buf``'s storage, for one receiver, as bytes."""
    storage = buf.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return msgspec.msgpack.encode([device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync])


def _open(raw: bytes, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the storage another process shared (``_share``), on ``device``."""
    from flywheel.weights import WeightSyncError

    try:
        _, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = msgspec.msgpack.decode(raw)
        index = device.index if device.index is not None else torch.cuda.current_device()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync
        )
    except (RuntimeError, ValueError, msgspec.DecodeError) as err:
        raise WeightSyncError(
            f"could not open the learner's CUDA IPC buffer on {device}: {err}. sync.transport ipc needs the "
            "learner and the generator on the same GPU; across GPUs use nccl"
        ) from err
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (size,), (1,))


def send_ipc(group: WeightGroup, buckets: list[BucketLayout], tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Rank 0: every bucket through the two shared buffers, by the handshake above."""
    from flywheel.weights import pack_bucket

    store = group.ipc_store
    assert store is not None
    from flywheel.weights import pooled_buffer_bytes

    size = pooled_buffer_bytes(buckets)
    receivers = range(1, group.world_size)
    if not group.send_buffers or group.send_buffers[0].numel() < size:
        group.send_buffers = [torch.empty(max(size, 1), dtype=torch.uint8, device=group.device) for _ in range(2)]
        group.ipc_generation += 1
        for rank in receivers:
            shares = msgspec.msgpack.encode([_share(b) for b in group.send_buffers])
            store.set(f"buffers/{group.ipc_generation}/{rank}", shares)
    store.set(f"{prefix}/gen", str(group.ipc_generation))
    stream = torch.cuda.current_stream(group.device)
    capacity = group.send_buffers[0].numel()
    for i, layout in enumerate(buckets):
        if i >= 2:  # buffer i % 2 last held bucket i - 2: every receiver must have copied it out
            _wait(store, [f"{prefix}/done/{i - 2}/{r}" for r in receivers], group, f"the copies of bucket {i - 2}")
        if layout.nbytes <= capacity:
            pack_bucket([tensors[n] for n in layout.names], layout, out=group.send_buffers[i % 2])
            stream.synchronize()  # the receivers read it from their own streams, in other processes
            store.set(f"{prefix}/ready/{i}", "1")
            continue
        own = pack_bucket([tensors[n] for n in layout.names], layout, device=group.device)
        stream.synchronize()
        for rank in receivers:
            store.set(f"{prefix}/big/{i}/{rank}", _share(own))
        store.set(f"{prefix}/ready/{i}", "1")
        _wait(store, [f"{prefix}/done/{i}/{r}" for r in receivers], group, f"the copies of bucket {i}")
        del own  # freed once the receivers closed it too (their storages hold its reference counts)
    last = [f"{prefix}/done/{i}/{r}" for i in range(max(0, len(buckets) - 2), len(buckets)) for r in receivers]
    if last:
        _wait(store, last, group, "the copies of the last buckets")
    _forget(store, prefix, buckets, receivers, capacity)


def _forget(store: dist.Store, prefix: str, buckets: list[BucketLayout], receivers: range, capacity: int) -> None:
    """Delete a finished sync's keys (every receiver has copied every bucket out)."""
    keys = [f"{prefix}/gen"]
    for i, layout in enumerate(buckets):
        keys.append(f"{prefix}/ready/{i}")
        keys += [f"{prefix}/done/{i}/{r}" for r in receivers]
        if layout.nbytes > capacity:
            keys += [f"{prefix}/big/{i}/{r}" for r in receivers]
    for key in keys:
        store.delete_key(key)


def receive_ipc(group: WeightGroup, ready: WeightsReady, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver: each bucket copied out of rank 0's shared buffers into memory of its own, as
    named tensors (views of that copy: the loader may keep them)."""
    from flywheel.weights import unpack_bucket

    store = group.ipc_store
    assert store is not None
    _wait(store, [f"{prefix}/gen"], group, "the learner's buffers")
    generation = int(store.get(f"{prefix}/gen"))
    if group.ipc_generation != generation:
        group.ipc_opened = []  # the last generation's: closed, their reference counts given back
        raw = store.get(f"buffers/{generation}/{group.rank}")
        group.ipc_opened = [_open(share, group.device) for share in msgspec.msgpack.decode(raw)]
        group.ipc_generation = generation
    shared = group.ipc_opened
    stream = torch.cuda.current_stream(group.device)
    capacity = shared[0].numel()
    for i, layout in enumerate(ready.buckets):
        _wait(store, [f"{prefix}/ready/{i}"], group, f"bucket {i}")
        mine = torch.empty(layout.nbytes, dtype=torch.uint8, device=group.device)
        if layout.nbytes <= capacity:
            mine.copy_(shared[i % 2][: layout.nbytes])
        else:  # a bucket bigger than the buffers came in one of its own
            own = _open(store.get(f"{prefix}/big/{i}/{group.rank}"), group.device)
            mine.copy_(own[: layout.nbytes])
        stream.synchronize()  # copied before rank 0 may write the buffer again
        if layout.nbytes > capacity:
            del own  # closed: its reference count goes back to rank 0
        store.set(f"{prefix}/done/{i}/{group.rank}", "1")
        yield from unpack_bucket(mine, layout)
