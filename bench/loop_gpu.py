"""The whole loop on two GPUs: ``flywheel run configs/gpu_2x.yaml`` (a 0.49B Llama, the DeepSpeed
learner on GPU 0, a vLLM generator on GPU 1, async GRPO at η = 2), then each side's throughput
and idle shares over the learner's training window.

Where the figures come from:
- the run report's summary.json (``flywheel/report.py``): learner tokens/s and step time, the
  generator's tokens/s and idle shares from the hub's counters (tokens in, leases out,
  admission-blocked seconds), the staleness histogram, reward and accuracy before and after;
- the learner's log: the weight sync of every step (broadcast plus the generator's reload and ack);
- the generator's log: how long each weight update paused it;
- nvidia-smi, sampled every 0.5 s: each GPU's utilisation over the window.

    python bench/loop_gpu.py [--timeout-s 540] [-- --train.total_steps 300 ...]
    python bench/loop_gpu.py --from-run runs/bench-loop-gpu     # rebuild the result from a finished run

Writes bench/results/loop_gpu.json and copies summary.json and the report's PNGs into
bench/results/loop_gpu/.

On the H200 machine (no network) it ran with the vLLM payload unpacked to /tmp/vsite (see
shared/gpu/VLLM_ON_H200.md), deepspeed, hjson and redis wheels installed to /tmp/pyx, and Debian's
redis-server on PATH; the environment VLLM_ON_H200.md names, plus:

    export PYTHONPATH=/tmp/vsite:/tmp/pyx:$PWD PATH=/tmp/redis/bin:$PATH
    timeout 565 python3 bench/loop_gpu.py --timeout-s 520
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYNC_LINE = re.compile(r"weights v(\d+) -> (\d+) generators in ([\d.]+)s")
UPDATE_LINE = re.compile(r"now serving weights v(\d+) \(update took ([\d.]+)s")


def run_loop(recipe: Path, run_dir: Path, timeout_s: float, overrides: list[str]) -> int:
    """The launcher as a child process (its output in <run_dir>.bench/launcher.log); SIGTERM at
    the timeout, which shuts the run down and still writes its report. The benchmark's own files
    stay out of the run directory, which the launcher sets aside if it finds one there."""
    own = bench_dir(run_dir)
    own.mkdir(parents=True, exist_ok=True)
    smi = shutil.which("nvidia-smi")
    sampler = None
    if smi is not None:
        query = "--query-gpu=timestamp,index,utilization.gpu,memory.used"
        with (own / "gpu_util.csv").open("w") as f:
            sampler = subprocess.Popen([smi, query, "--format=csv,noheader,nounits", "-lms", "500"], stdout=f)
    cmd = [sys.executable, "-m", "flywheel.cli", "run", str(recipe), "--launch.run_dir", str(run_dir)]
    cmd += ["--launch.display", "false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log_path = own / "launcher.log"
    print(f"loop_gpu: {' '.join(cmd)}\n  output: {log_path}", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"loop_gpu: {timeout_s:g}s passed: stopping the run (its report is still written)", flush=True)
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    if sampler is not None:
        sampler.terminate()
        sampler.wait(timeout=10)
    print("\n".join(log_path.read_text(errors="replace").splitlines()[-40:]), flush=True)
    return proc.returncode


def bench_dir(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".bench")


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def gpu_utilisation(path: Path, start: float, end: float) -> dict[str, float]:
    """Mean utilisation (%) of each GPU between two wall-clock times, from the nvidia-smi samples."""
    per_gpu: dict[str, list[float]] = {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            util = float(parts[2])
        except ValueError:
            continue
        if start <= t <= end:
            per_gpu.setdefault(f"gpu{parts[1]}", []).append(util)
    return {gpu: _mean(xs) for gpu, xs in sorted(per_gpu.items())}


def collect(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if x.strip()]
    logs = run_dir / "logs"
    sync_s = [float(m[3]) for m in SYNC_LINE.finditer((logs / "learner.log").read_text(errors="replace"))]
    gen_log = logs / "generator0.log"
    update_s = (
        [float(m[2]) for m in UPDATE_LINE.finditer(gen_log.read_text(errors="replace"))] if gen_log.exists() else []
    )
    step_s = [r["perf/step_s"] for r in rows]
    waited = sum(r["perf/idle_frac"] * r["perf/step_s"] for r in rows)
    start, end = rows[0]["time"] - rows[0]["perf/step_s"], rows[-1]["time"]
    window = summary.get("train_window_s", end - start)
    gen_keys = ("generator_tokens", "generator_no_work_frac", "generator_blocked_frac")
    return {
        "steps": summary["steps"],
        "wall_s": summary["wall_s"],
        "train_window_s": window,
        "learner": {
            "step_s_mean": _mean(step_s),
            "step_s_p50": _percentile(step_s, 50),
            "step_s_p90": _percentile(step_s, 90),
            "tokens_per_s_busy": summary["learner_tokens_per_s"],
            "tokens_per_s_wall": summary.get("learner_tokens_per_s_wall"),
            "tokens": summary.get("learner_tokens"),
            "idle_frac": waited / sum(step_s),
            "idle_frac_of_step_time": summary["learner_idle_frac"],
        },
        "generator": {
            "tokens_per_s_wall": summary.get("generator_tokens_per_s_wall"),
            "tokens_per_s_hub_gauge": summary["generator_tokens_per_s"],
            **{k.removeprefix("generator_"): summary.get(k) for k in gen_keys},
            "weight_update_frac": sum(update_s) / window if window else None,
        },
        "weight_sync": {
            "syncs": len(sync_s),
            "learner_s_mean": _mean(sync_s),
            "learner_s_p50": _percentile(sync_s, 50),
            "learner_s_max": max(sync_s, default=0.0),
            "generator_update_s_mean": _mean(update_s),
            "share_of_learner_step": sum(sync_s) / sum(step_s),
        },
        "gpu_utilisation_pct": gpu_utilisation(bench_dir(run_dir) / "gpu_util.csv", start, end),
        "staleness_histogram": summary["staleness_histogram"],
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "accuracy_start": summary.get("accuracy_start"),
        "accuracy_end": summary.get("accuracy_end"),
    }


def show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    le, ge, ws = result["learner"], result["generator"], result["weight_sync"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def num(x: float | None, fmt: str = ".0f") -> str:
        return "-" if x is None else format(x, fmt)

    t = Table(title="flywheel loop on 2 GPUs (learner GPU 0, generator GPU 1)")
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("learner steps", str(result["steps"])),
        ("wall time (whole run / training window)", f"{result['wall_s']:.0f} s / {result['train_window_s']:.0f} s"),
        ("learner step time (mean / p50 / p90)", f"{le['step_s_mean']:.3f} / {le['step_s_p50']:.3f} / {le['step_s_p90']:.3f} s"),
        ("learner tokens/s (while busy / over the window)", f"{num(le['tokens_per_s_busy'])} / {num(le['tokens_per_s_wall'])}"),
        ("learner idle (waiting for a batch)", pct(le["idle_frac"])),
        ("generator tokens/s (over the window)", num(ge["tokens_per_s_wall"])),
        ("generator with no lease out", pct(ge["no_work_frac"])),
        ("generator slots kept empty by the staleness bound", pct(ge["blocked_frac"])),
        ("generator paused for weight updates", pct(ge["weight_update_frac"])),
        ("weight sync per step (learner side, mean / max)", f"{ws['learner_s_mean']:.3f} / {ws['learner_s_max']:.3f} s"),
        ("weight sync share of the learner step", pct(ws["share_of_learner_step"])),
        ("GPU utilisation (nvidia-smi)", ", ".join(f"{k} {v:.0f}%" for k, v in result["gpu_utilisation_pct"].items()) or "-"),
        ("staleness histogram (groups)", json.dumps(result["staleness_histogram"])),
        ("reward (first / last tenth of steps)", f"{result['reward_first']:.3f} / {result['reward_last']:.3f}"),
        ("greedy accuracy (start / end)", f"{pct(result['accuracy_start'])} / {pct(result['accuracy_end'])}"),
    ]  # fmt: skip
    for what, value in rows:
        t.add_row(what, value)
    Console().print(t)


def machine() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    gpus = []
    if smi is not None:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        gpus = out.stdout.split("\n")[:-1] if out.returncode == 0 else []
    return {"platform": platform.platform(), "gpus": gpus, "cpus": os.cpu_count()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(ROOT / "configs" / "gpu_2x.yaml"))
    p.add_argument("--run-dir", default=str(ROOT / "runs" / "bench-loop-gpu"))
    p.add_argument("--timeout-s", type=float, default=3600.0, help="stop the run (SIGTERM) after this long")
    p.add_argument("--from-run", default=None, help="a finished run directory: rebuild the result, run nothing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "loop_gpu.json"))
    p.add_argument(
        "--files", default=str(ROOT / "bench" / "results" / "loop_gpu"), help="summary.json and PNGs go here"
    )
    p.add_argument("overrides", nargs="*", help="flags passed to flywheel run (after --)")
    args = p.parse_args()
    run_dir = Path(args.from_run or args.run_dir).resolve()
    code = 0 if args.from_run else run_loop(Path(args.recipe), run_dir, args.timeout_s, args.overrides)
    if not (run_dir / "report" / "summary.json").exists():
        print(
            f"loop_gpu: the run wrote no report (launcher exit code {code}); see {bench_dir(run_dir) / 'launcher.log'}"
        )
        return 1
    result = {
        "benchmark": "loop_gpu",
        "launcher_exit_code": code,
        **collect(run_dir),
        "config": {"recipe": os.path.relpath(args.recipe, ROOT), "overrides": args.overrides},
        "machine": machine() if not args.from_run else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    files = Path(args.files)
    files.mkdir(parents=True, exist_ok=True)
    for f in ["summary.json", *(x.name for x in (run_dir / "report").glob("*.png"))]:
        shutil.copy(run_dir / "report" / f, files / f)
    show(result)
    print(f"written: {out}, {files}/")
    return code


if __name__ == "__main__":
    sys.exit(main())
