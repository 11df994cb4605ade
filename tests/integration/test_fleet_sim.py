"""The fleet simulation behind bench/async_vs_sync.py at a small size: real Redis, the real hub and
reward service, simulated engines in two processes, the learner's claim path. Synchronous
(η = 0) batches are wholly on-policy; asynchronous ones stay within the bound and come faster,
because the fleet no longer waits for each batch's longest response."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from flywheel.tiny import build_tokenizer, write_arithmetic_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "bench" / "async_vs_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_async_beats_sync_on_a_long_tailed_fleet(tmp_path: Path) -> None:
    bench = _bench()
    args = argparse.Namespace(
        steps=6, sync_steps=0, warmup=2, fleet_seqs=64, max_tokens=160, t0=0.01, learner_speed=1.0, update_s=0.02,
        sync_s=0.01, fleet_procs=2, oversubscribe=2.0, keep_stale=False, full_clock_generators=128,
        tokenizer=build_tokenizer(tmp_path / "tok"), data=write_arithmetic_jsonl(tmp_path / "p.jsonl", 500),
    )  # fmt: skip
    sync = bench.run_config(tmp_path, args, 4, 0, args.learner_speed)
    fast = bench.run_config(tmp_path, args, 4, 4, args.learner_speed)
    assert sync["staleness_histogram"] == {0: 6 * sync["groups_per_step"]}  # strictly on-policy
    assert max(fast["staleness_histogram"]) <= 4
    assert sum(fast["staleness_histogram"].values()) == 6 * fast["groups_per_step"]
    assert fast["step_s"] < sync["step_s"] / 1.5, (sync, fast)
    assert fast["fleet_occupancy"] > sync["fleet_occupancy"]
    assert fast["resent_chunks"] == 0 and fast["fleet_tokens_per_s"] > 0
    assert fast["clock_scale"] == 1.0  # 64 slots over 4 engines: the full clock
    assert sync["groups_dropped"] == 0  # at η = 0 nothing is issued that could go stale
