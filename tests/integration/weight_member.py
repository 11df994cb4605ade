"""A generator's side of the weight sync without vLLM, as a process of its own: it joins through
a real ``SyncLink``, builds the announced gloo group with ``join_group`` and takes each broadcast
with ``receive`` (what ``generators/worker_ext.py`` does inside a vLLM worker), then acks. It
prints ``loaded VERSION SUM`` for each set of weights it took, the sum of every value received.

    python -m tests.integration.weight_member ANNOUNCE_PORT JOIN_PORT GENERATOR_ID [refuses]

``refuses``: it takes every broadcast whole, then acks an error, as a generator whose vLLM
loader refuses the weights does.
"""

from __future__ import annotations

import sys
import time

from flywheel.weights import WeightGroup, WeightSyncError, join_announced, receive
from generators.sync_link import SyncLink


def main(announce_port: int, join_port: int, generator_id: str, refuses: bool = False) -> None:
    link = SyncLink("127.0.0.1", announce_port, join_port, generator_id, workers=1)
    version = 0
    group: WeightGroup | None = None
    while True:
        link.join(version, every_s=0.1)
        for ready, _ in link.poll():
            if generator_id not in ready.ranks:
                continue
            started = time.perf_counter()
            try:
                if group is None or group.epoch != ready.epoch:
                    if group is not None:
                        group.close()
                    group = join_announced(ready, ready.ranks[generator_id])
                total = sum(float(t.sum()) for _, t in receive(group, ready))
                if refuses:
                    raise WeightSyncError("vLLM could not load the weights: KeyError: 'w'")
            except WeightSyncError as err:
                group = None
                link.ack(ready.version, ready.epoch, f"{type(err).__name__}: {err}", time.perf_counter() - started)
                continue
            version = ready.version
            link.ack(version, ready.epoch, None, time.perf_counter() - started)
            print(f"loaded {version} {total:g}", flush=True)
        time.sleep(0.02)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["refuses"])
