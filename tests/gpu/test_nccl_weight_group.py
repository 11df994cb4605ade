"""The weight group on real NCCL (a CUDA GPU; skipped elsewhere). One GPU is enough: the peer
that matters here never reaches NCCL at all.

    python -m pytest tests/gpu          # or, where pytest is missing: python tests/gpu/test_nccl_weight_group.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flywheel.weights import WeightSyncError, host_store, join_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# rank 1: comes to the rendezvous (the barrier every rank passes) and then never to the first
# broadcast, as a generator does that runs out of memory for its buffer or is killed right there
ABSENT_AFTER_THE_BARRIER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from flywheel.weights import _all_joined
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, is_master=False, timeout=timedelta(seconds=30))
_all_joined(dist.PrefixStore("flywheel/weights/7", store), 1, 2, 30)
print("rank 1 passed the barrier", flush=True)
time.sleep(120)
"""


def test_a_rank_that_passes_the_barrier_and_never_broadcasts_does_not_hang_rank_0() -> None:
    """NCCL set its communicator up inside the first broadcast and waited there for rank 1 with
    no timeout: the learner hung for good (its watchdog only logged)."""
    store = host_store("127.0.0.1", 30)
    peer = subprocess.Popen([sys.executable, "-c", ABSENT_AFTER_THE_BARRIER, str(store.port)], cwd=ROOT)
    try:
        group = join_group("nccl", "127.0.0.1", store.port, 0, 2, 7, timeout_s=5, store=store, device="cuda:0")
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="never came to the first broadcast"):
            group.start(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0"))
        took = time.monotonic() - start
        assert took < 20, took
        print(f"rank 0 gave the group up after {took:.1f}s")
    finally:
        peer.kill()
        peer.wait(10)


def test_a_one_rank_nccl_group_broadcasts_through_the_first_broadcasts_thread() -> None:
    store = host_store("127.0.0.1", 30)
    group = join_group("nccl", "127.0.0.1", store.port, 0, 1, 8, timeout_s=30, store=store, device="cuda:0")
    buf = torch.arange(1 << 20, device="cuda:0", dtype=torch.int32).view(torch.uint8)
    for _ in range(3):
        group.finish(group.start(buf))
    assert group.connected
    torch.cuda.synchronize()
    assert torch.equal(buf.view(torch.int32), torch.arange(1 << 20, device="cuda:0", dtype=torch.int32))
    group.close()


if __name__ == "__main__":
    for test in (
        test_a_one_rank_nccl_group_broadcasts_through_the_first_broadcasts_thread,
        test_a_rank_that_passes_the_barrier_and_never_broadcasts_does_not_hang_rank_0,
    ):
        test()
        print(f"passed: {test.__name__}", flush=True)
