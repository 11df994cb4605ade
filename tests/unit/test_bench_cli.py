"""The benchmarks' own contract (BENCHMARKS.md): each runs with ``--quick`` as well as in full,
and a quick look never overwrites the recorded run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# every benchmark whose JSON BENCHMARKS.md judges and that runs on CPU (the GPU ones need a GPU to look at all)
CPU_BENCHMARKS = ["hub_throughput", "generation", "learner", "reward", "quickstart", "chaos", "fuzz", "async_vs_sync"]
CPU_BENCHMARKS += ["load", "offpolicy"]


@pytest.mark.parametrize("name", CPU_BENCHMARKS)
def test_every_benchmark_has_a_quick_look_that_writes_beside_the_record(name: str) -> None:
    source = (ROOT / "bench" / f"{name}.py").read_text()
    assert re.search(r"add_argument\(\s*\"--quick\"", source), f"bench/{name}.py has no --quick"
    # NAME_quick.json (learner.py builds it: learner_quick.json, learner_gpu_quick.json)
    assert f"{name}_quick.json" in source or "_quick' if args.quick" in source, f"bench/{name}.py: no NAME_quick.json"


def test_the_gpu_sync_benchmark_headlines_the_default_bucket_size() -> None:
    """Its headline was the best of three bucket sizes, none of them the default a run uses."""
    from bench.weight_sync_gpu import BUCKETS_MB, DEFAULT_BUCKET_MB
    from flywheel.config import SyncConfig

    assert SyncConfig().bucket_mb == DEFAULT_BUCKET_MB and DEFAULT_BUCKET_MB in BUCKETS_MB
