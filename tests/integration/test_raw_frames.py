"""The ceiling ``bench/hub_throughput.py`` measures beside the hub: frames relayed raw into Redis
arrive at the consumer at the rate offered, each acknowledged (after its write) once."""

from __future__ import annotations

from pathlib import Path

from bench.raw_frames import run_raw_frames


def test_raw_frames_reach_the_consumer_at_the_offered_rate(tmp_path: Path) -> None:
    offered = 400_000.0  # tokens/s over both generators: far below this machine's ceiling
    run = run_raw_frames(tmp_path, 2, warmup=1.0, seconds=4.0, tokens_per_s=offered, chunks=32, chunk_tokens=(16, 64))
    # The pacing holds the rate up, never past it. Below it, a machine busy with the other test
    # worker's processes (CI runs two on two cores) slows it as far as 29% in a 4 s window, seen
    # once: the rate this machine reaches is the benchmark's to say, with nothing else running;
    # here the floor only says that frames flow, at a tenth of the offered rate.
    assert 0.1 * offered < run["consumer_tokens_per_s"] < 1.3 * offered, run
    assert 0 < run["ack_ms_p50"] <= run["ack_ms_p99"] < 1000, run
