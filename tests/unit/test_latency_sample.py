"""A generator's ack latencies are sampled alike over the whole run, in bounded memory."""

from __future__ import annotations

from generators.hub_link import LatencySample


def test_the_sample_covers_the_whole_run_in_bounded_memory() -> None:
    sample = LatencySample(cap=1000)
    seen = 0
    for size in [1, 7, 250, 3, 999, 64] * 40:  # acks confirm uneven numbers of chunks
        sample.add([float(i) for i in range(seen, seen + size)])
        seen += size
    assert sample.count == seen
    assert len(sample.values) < 1000
    # exactly the chunks whose index is a multiple of the stride: as many early as late
    assert sample.values == [float(i) for i in range(0, seen, sample.every)]
    assert sample.values[-1] > seen - sample.every - 1  # the end of the run is in it (a cap kept the start only)


def test_a_reset_forgets_the_warm_up() -> None:
    sample = LatencySample(cap=8)
    sample.add([9.0] * 20)
    sample.reset()
    sample.add([0.5, 0.25])
    assert sample.values == [0.5, 0.25] and sample.count == 2 and sample.every == 1
