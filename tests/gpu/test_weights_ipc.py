"""The ``ipc`` weight transport on a real GPU (skipped elsewhere): rank 0 and a receiver process on
one device, where NCCL refuses the pair. Every tensor arrives exactly, through two shared buffers
reused over many buckets, twice in one group (two syncs), and a sync whose buckets never come
ends by its deadline. A bucket bigger than the buffers (one large tensor) goes through a buffer
of its own, and a finished sync leaves no key behind.

    python -m pytest tests/gpu          # or: python tests/gpu/test_weights_ipc.py
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from flywheel.weights import WeightSyncError, host_store, join_group, plan_buckets, receive, send
from flywheel.weights_ipc import sync_prefix
from flywheel.wire import WeightsReady, encode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EPOCH = 11


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(version)
    return {
        "embed": torch.randn(300, 64, generator=g, device="cuda").to(torch.bfloat16),  # 38 KB: a bucket alone
        **{f"layer{i}.w": torch.randn(40, 30, generator=g, device="cuda") for i in range(9)},  # 4.8 KB each
        "norm": torch.ones(7, device="cuda", dtype=torch.float16),
        "steps": torch.arange(5, device="cuda", dtype=torch.int64),
    }


def ready_for(version: int, port: int, deadline: float) -> WeightsReady:
    buckets = plan_buckets(weights(version).items(), bucket_bytes=10_000)
    return WeightsReady(
        version=version,
        buckets=buckets,
        transport="ipc",
        deadline=deadline,
        epoch=EPOCH,
        master_addr="127.0.0.1",
        master_port=port,
        world_size=2,
        ranks={"g": 1},
    )


def _receiver(port: int, readies: list[bytes], out: Any) -> None:
    from flywheel.wire import Decoder

    torch.cuda.set_device(0)
    group = None
    for raw in readies:
        ready = Decoder(WeightsReady).decode(raw)
        assert isinstance(ready, WeightsReady)
        try:
            if group is None:
                group = join_group("ipc", "127.0.0.1", port, 1, 2, EPOCH, 30, device="cuda:0")
            group.deadline = ready.deadline
            got = {name: t.clone().cpu() for name, t in receive(group, ready)}
            out.put(("ok", ready.version, got))
        except WeightSyncError as err:
            out.put(("error", ready.version, str(err)))


def test_two_syncs_through_shared_buffers_arrive_exactly_and_a_missing_one_times_out() -> None:
    store = host_store("127.0.0.1", 30)
    now = time.time()
    readies = [
        ready_for(1, store.port, now + 60),
        ready_for(2, store.port, now + 60),
        ready_for(3, store.port, now + 8),
    ]
    assert len(readies[0].buckets) >= 5  # the two buffers are reused
    # "embed" (38 KB) is bigger than the buffers (the largest bucket of several tensors): its own
    assert any(b.names == ["embed"] for b in readies[0].buckets)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, [encode(r) for r in readies], out))
    proc.start()
    try:
        group = join_group("ipc", "127.0.0.1", store.port, 0, 2, EPOCH, 30, store=store, device="cuda:0")
        for ready in readies[:2]:
            group.deadline = ready.deadline
            group.sync_prefix = sync_prefix(ready.version, ready.deadline)
            seconds = send(group, ready.buckets, weights(ready.version))
            status, version, got = out.get(timeout=60)
            assert (status, version) == ("ok", ready.version), got
            sent = weights(ready.version)
            assert got.keys() == sent.keys()
            for name, t in sent.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t.cpu()), name
            assert seconds < 30
            # every key of the sync is gone once it is done: a group's store does not grow
            prefix = sync_prefix(ready.version, ready.deadline)
            assert not group.ipc_store.check([f"{prefix}/ready/0"]) and not group.ipc_store.check([f"{prefix}/gen"])
        # v3: announced, never sent: the receiver gives up by its deadline, with the reason
        started = time.monotonic()
        status, version, why = out.get(timeout=60)
        assert (status, version) == ("error", 3) and "the learner's buffers did not come" in why, why
        assert time.monotonic() - started < 30
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


if __name__ == "__main__":
    test_two_syncs_through_shared_buffers_arrive_exactly_and_a_missing_one_times_out()
    print("ok")
