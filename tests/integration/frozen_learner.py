"""A learner that freezes mid-broadcast: it announces a sync, sends the first of its buckets, then
stops itself with SIGSTOP (what a stalled or swapped-out process looks like to its peers).

    python -m tests.integration.frozen_learner MODEL ANNOUNCE_PORT JOIN_PORT VERSION TIMEOUT_S

Run by tests/integration/test_deadlines.py, which kills it afterwards.
"""

from __future__ import annotations

import os
import signal
import sys

import learner.weight_sync as weight_sync
from flywheel.config import SyncConfig
from learner.weight_sync import WeightBroadcaster


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir, announce, join, version, timeout_s = sys.argv[1:6]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    real_send = weight_sync.send

    def send_one_bucket_then_freeze(group, buckets, tensors):  # type: ignore[no-untyped-def]
        real_send(group, buckets[:1], tensors)
        print("frozen after 1 of", len(buckets), "buckets", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return 0.0

    weight_sync.send = send_one_bucket_then_freeze
    cfg = SyncConfig(announce_port=int(announce), join_port=int(join), timeout_s=float(timeout_s), bucket_mb=0.05)
    wb = WeightBroadcaster(cfg)
    assert wb.wait_for_members(1, timeout_s=300), "no generator joined"  # its engine starts first (slow under CI load)
    print("syncing", flush=True)
    wb.sync(int(version), model.state_dict().items())


if __name__ == "__main__":
    main()
