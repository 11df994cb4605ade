"""The run report of ``flywheel run``: PNG plots (reward curve, staleness histogram, throughput
over time) and a JSON summary, in ``<run_dir>/report``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "learner_metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        # a learner restarted from a checkpoint trains the steps after it again: the last run of a
        # step is the one the policy kept, and counting both would count its tokens twice
        by_step.pop(row.get("step"), None)
        by_step[row.get("step")] = row
    return list(by_step.values())


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _learner_time_shares(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The learner's idle share of its step time and its tokens per busy second, weighted by each
    step's length (a mean of per-step shares would count a 10 s wait as much as a 0.1 s one)."""
    step_s = [r.get("perf/step_s", 0.0) for r in rows]
    idle_s = sum(r.get("perf/idle_frac", 0.0) * s for r, s in zip(rows, step_s, strict=True))
    total = sum(step_s)
    busy = total - idle_s
    tokens = sum(r.get("perf/tokens", 0.0) for r in rows)
    return {
        "learner_idle_frac": idle_s / total if total > 0 else 0.0,
        "learner_tokens_per_s": tokens / busy if busy > 0 else 0.0,
    }


def _from_first_nonzero(xs: list[float]) -> list[float]:
    """The samples from the generators' first token on: start-up is no throughput, idle gaps are."""
    first = next((i for i, x in enumerate(xs) if x > 0), len(xs))
    return list(xs[first:])


def loop_figures(rows: list[dict[str, Any]], timeline: Any) -> dict[str, float]:
    """Both sides over the learner's training window (its first step's start to its last step's
    end), from the learner's metrics and the hub's counters the launcher sampled:

    - ``learner_tokens_per_s_wall``: tokens trained on (prompts and responses) per second of window;
    - ``generator_tokens_per_s_wall``: tokens generated per second of window;
    - ``generator_no_work_frac``: share of samples at which no lease was out (nothing to generate);
    - ``generator_blocked_frac``: share of the window the staleness bound kept free slots empty.
    """
    rows = [r for r in rows if r["time"] >= timeline.start_wall]  # this launch's (a resumed run kept the file)
    if not rows:
        return {}
    start = rows[0]["time"] - rows[0].get("perf/step_s", 0.0) - timeline.start_wall
    end = rows[-1]["time"] - timeline.start_wall
    out = {
        "train_window_s": end - start,
        "learner_step_s": _mean([r.get("perf/step_s", 0.0) for r in rows]),
        "learner_tokens": sum(r.get("perf/tokens", 0.0) for r in rows),
    }
    out["learner_tokens_per_s_wall"] = out["learner_tokens"] / max(end - start, 1e-9)
    inside = [i for i, t in enumerate(timeline.t) if start <= t <= end]
    if len(inside) >= 2:
        first, last = inside[0], inside[-1]
        seconds = timeline.t[last] - timeline.t[first]
        out["generator_tokens"] = _counted([timeline.tokens_in[i] for i in inside])
        out["generator_tokens_per_s_wall"] = out["generator_tokens"] / seconds
        out["generator_no_work_frac"] = _mean([float(timeline.active_leases[i] == 0) for i in inside])
        out["generator_blocked_frac"] = _counted([timeline.admission_blocked_s[i] for i in inside]) / seconds
    return out


def _counted(samples: list[float]) -> float:
    """What a hub counter counted over its samples. The hub keeps its counters in memory, so a
    restart (its own, or Redis's) starts them from zero again: a sample below the one before is
    a restart, and counts from zero."""
    total = 0.0
    for before, now in zip(samples, samples[1:], strict=False):
        total += now - before if now >= before else now
    return total


def write_report(
    run_dir: Path,
    cfg: FlywheelConfig,
    wall_s: float,
    timeline: Any,
    eval_start: dict[str, Any] | None,
    eval_end: dict[str, Any] | None,
) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rows = load_metrics(run_dir)
    steps = [r["step"] for r in rows]
    rewards = [r.get("reward/mean", 0.0) for r in rows]
    staleness: Counter[int] = Counter()
    for r in rows:
        for k, v in r.items():
            if k.startswith("staleness/"):
                staleness[int(k.split("/")[1])] += int(v)
    window = max(1, len(rewards) // 10)
    summary: dict[str, Any] = {
        "run": cfg.run.name,
        "max_staleness": cfg.async_.max_staleness,
        "wall_s": wall_s,
        "steps": steps[-1] if steps else 0,
        "reward_first": _mean(rewards[:window]),
        "reward_last": _mean(rewards[-window:]),
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        **_learner_time_shares(rows),
        "generator_tokens_per_s": _mean(_from_first_nonzero(timeline.gen_tokens_per_s)),
        **loop_figures(rows, timeline),
    }
    if eval_start is not None:
        summary["accuracy_start"] = eval_start["accuracy"]
    if eval_end is not None:
        summary["accuracy_end"] = eval_end["accuracy"]
    if eval_start is not None and eval_end is not None:
        summary["accuracy_gain"] = eval_end["accuracy"] - eval_start["accuracy"]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, lw=0.8, alpha=0.5, label="batch mean reward")
    if len(rewards) >= window > 1:
        smooth = [_mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({window} steps)")
    for ev, name, x in ((eval_start, "eval start", 0), (eval_end, "eval end", steps[-1] if steps else 0)):
        if ev is not None:
            ax.scatter(
                [x], [ev["accuracy"]], marker="D", zorder=3, label=f"{name}: {ev['accuracy']:.0%} greedy accuracy"
            )
    ax.set(xlabel="learner step (policy version)", ylabel="reward", title=f"reward (η = {cfg.async_.max_staleness})")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ks = sorted(staleness)
    ax.bar([str(k) for k in ks], [staleness[k] for k in ks])
    ax.set(xlabel="staleness (learner version − group version)", ylabel="groups trained on", title="staleness")
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)
    plt.close(fig)

    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(timeline.t, timeline.gen_tokens_per_s, label="generators → hub tokens/s")
    if rows:
        ax1.plot(
            [r["time"] - timeline.start_wall for r in rows],
            [r.get("perf/tokens_per_s", 0) for r in rows],
            label="learner tokens/s",
        )
    ax1.set(xlabel="seconds since start", ylabel="tokens/s", title="throughput")
    ax1.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
