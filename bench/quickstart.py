"""The quickstart as a benchmark: ``flywheel run configs/quickstart.yaml`` end to end, then the
figures BENCHMARKS.md names (accuracy before and after, wall time) from the run's report.

    python bench/quickstart.py [--sync] [--from-summary runs/quickstart/report/summary.json]
    python bench/quickstart.py --quick   # the code path: 6 steps after a 5-step warm start

``--sync`` also runs it at η = 0 (synchronous) for the side-by-side comparison;
``--from-summary`` rebuilds the result file from a finished run's report instead of running.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# --quick: the recipe cut down to its code path (warm start, generation, training, evaluation)
QUICK = ("--sft.steps", "5", "--train.total_steps", "6", "--train.checkpoint_every", "3", "--task.eval_prompts", "20")


def run(run_dir: Path, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(ROOT / "configs" / "quickstart.yaml")]
    subprocess.run([*cmd, "--launch.run_dir", str(run_dir), "--launch.display", "false", *overrides], check=True)
    summary: dict = json.loads((run_dir / "report" / "summary.json").read_text())
    return summary


def result(summary: dict) -> dict:
    return {
        "accuracy_start": summary["accuracy_start"],
        "accuracy_end": summary["accuracy_end"],
        "accuracy_gain": summary["accuracy_end"] - summary["accuracy_start"],
        "wall_s": summary["wall_s"],
        "steps": summary["steps"],
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "learner_idle_frac": summary["learner_idle_frac"],
        "staleness_histogram": summary["staleness_histogram"],
    }


def headline(out: dict[str, Any]) -> dict[str, float]:
    """BENCHMARKS.md's keys (and the gain its target is on)."""
    return {k: out[k] for k in ("accuracy_start", "accuracy_end", "accuracy_gain", "wall_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sync", action="store_true", help="also run at max_staleness 0")
    p.add_argument("--from-summary", default=None, help="a finished run's report/summary.json")
    p.add_argument(
        "--quick", action="store_true", help="the same run cut to 6 steps (the code path; its accuracy means nothing)"
    )
    p.add_argument("--out", default=None, help="(default bench/results/quickstart.json; quick: quickstart_quick.json)")
    args = p.parse_args()
    # a quick look never overwrites the recorded full run
    args.out = args.out or str(
        ROOT / "bench" / "results" / ("quickstart_quick.json" if args.quick else "quickstart.json")
    )
    short = QUICK if args.quick else ()
    if args.from_summary:
        out = {"benchmark": "quickstart", **result(json.loads(Path(args.from_summary).read_text()))}
    else:
        name = "bench-quickstart" + ("-quick" if args.quick else "")
        out = {"benchmark": "quickstart", **result(run(ROOT / "runs" / name, *short))}
        if args.sync:
            sync = run(ROOT / "runs" / f"{name}-sync", *short, "--async.max_staleness", "0")
            out["sync"] = result(sync)
            out["async_vs_sync_wall"] = sync["wall_s"] / out["wall_s"]
    out = {"benchmark": "quickstart", "headline": headline(out), **out}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
