"""Off-policy correction under staleness (issue 7): ``decoupled``, ``tis`` and ``none`` at η = 0, 4, 8
on two synthetic tasks, in one process (``bench/results/offpolicy.json``, ``offpolicy.png``).

Faithful to the loop, without its processes: the policy versions the hub and the generators would
hold are kept as a history of weight snapshots (the last η + 1); each learner step trains on a
batch sampled by the policy η versions ago (``--staleness max``: every group as stale as the bound
allows, the worst case; ``uniform``: each group's version drawn from the η + 1 allowed, a mix like
the hub serves), with the behaviour log-probabilities recorded at sampling time as the generator
does. The update is the learner's own: ``learner.trainer.Trainer.train_step`` on a hub ``Batch``
(micro-batches, the proximal recompute of ``decoupled`` with the learner's weights before the
update, ``learner.algos`` advantages and policy loss, the behaviour weight truncated at
``algo.off_policy.is_cap``), with DeepSpeed replaced by a plain AdamW with the same gradient
clipping and schedule. Sampling is a plain HF ``generate`` (temperature 1, no top-k/top-p), seeded
the same for every run, so runs differ only in the correction and η.

Tasks: ``add`` is the quickstart recipe (``configs/quickstart.yaml``: single-digit sums, 40
supervised warm-start steps on reference answers, GRPO with 32 prompts x 8 samples); ``add3`` is
the same with three addends ("What is 3 + 5 + 7? Answer:", 1,000 distinct prompts, sums to 27),
with a shorter warm start so the policy starts low. Both are scored by the arithmetic verifier of
the reward service (the first integer of the completion is the sum).

    python bench/offpolicy.py                 # the full sweep (see the README for its wall time)
    python bench/offpolicy.py --quick         # under a minute: a few steps of each configuration
    python bench/offpolicy.py --tasks add --corrections none --etas 8 --steps 50   # one run
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flywheel.config import FlywheelConfig, load_config  # noqa: E402
from flywheel.hub_client import Batch, RolloutGroup, RolloutSample  # noqa: E402
from flywheel.tasks import arithmetic_correct, arithmetic_eval_rows, arithmetic_rows  # noqa: E402
from learner import algos  # noqa: E402
from learner.batching import build_micro_batch, pad_rows, sequences, to_rows, token_logprobs  # noqa: E402
from learner.trainer import Trainer, lr_lambda  # noqa: E402
from reward_service.builtins import arithmetic as arithmetic_reward  # noqa: E402

CORRECTIONS = ("decoupled", "tis", "none")
COLOURS = {"decoupled": "tab:blue", "tis": "tab:green", "none": "tab:red"}
STYLES = {0: ":", 4: "--", 8: "-"}


# --------------------------------------------------------------------------- tasks


def add3_prompt(a: int, b: int, c: int) -> str:
    return f"What is {a} + {b} + {c}? Answer:"


def add3_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = (rng.randint(0, 9) for _ in range(3))
        rows.append({"prompt": add3_prompt(a, b, c), "answer": str(a + b + c)})
    return rows


def add3_eval_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    triples = list(itertools.product(range(10), repeat=3))
    random.Random(seed + 1).shuffle(triples)
    return [{"prompt": add3_prompt(*t), "answer": str(sum(t))} for t in triples[:n]]


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    train_rows: Callable[[FlywheelConfig], list[dict[str, str]]]
    eval_rows: Callable[[FlywheelConfig], list[dict[str, str]]]
    overrides: tuple[str, ...]  # on top of configs/quickstart.yaml


TASKS = {
    "add": Task(
        "add",
        "a + b (the quickstart)",
        lambda c: arithmetic_rows(c.task.prompts, c.task.seed, c.task.max_operand),
        lambda c: arithmetic_eval_rows(c.task.eval_prompts, c.task.seed, c.task.max_operand),
        (),
    ),
    "add3": Task(
        "add3",
        "a + b + c (harder)",
        lambda c: add3_rows(c.task.prompts, c.task.seed),
        lambda c: add3_eval_rows(c.task.eval_prompts, c.task.seed),
        ("--sft.steps", "40", "--task.eval_prompts", "200"),
    ),
}


def recipe(task: Task, args: argparse.Namespace, correction: str = "decoupled", eta: int = 0) -> FlywheelConfig:
    over = [*task.overrides, "--algo.off_policy.correction", correction, "--async.max_staleness", str(eta)]
    over += ["--train.lr", str(args.lr), "--train.total_steps", str(args.steps), "--run.seed", str(args.seed)]
    over += list(getattr(args, "overrides", []))
    return load_config(over, recipe=ROOT / "configs" / "quickstart.yaml")


# --------------------------------------------------------------------------- the learner, in process


class LocalEngine:
    """What ``Trainer`` asks of its DeepSpeed engine, for one CPU process: the learner's AdamW, its
    gradient clipping (``train.grad_clip``) and learning-rate schedule, stepping at the boundary."""

    def __init__(self, model: torch.nn.Module, cfg: FlywheelConfig) -> None:
        self.module = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.999), weight_decay=cfg.train.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.grad_clip = cfg.train.grad_clip
        self.boundary = True
        self.grad_norm = 0.0

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)

    def train(self) -> None:
        self.module.train()

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        if not self.boundary:
            return
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        return self.grad_norm


def local_learner(cfg: FlywheelConfig, model: torch.nn.Module) -> Trainer:
    """A ``Trainer`` whose ``train_step`` runs as in the learner service, on ``LocalEngine``, with no
    hub, no weight broadcast and no reference model or critic (the quickstart recipe has neither)."""
    if cfg.algo.kl.coef > 0 or cfg.algo.critic.enabled:
        raise ValueError("the in-process learner has no reference model or critic: use algo.kl.coef 0, no critic")
    learner = Trainer.__new__(Trainer)  # __init__ would start DeepSpeed, Redis and the weight broadcaster
    learner.cfg = cfg
    learner.rank, learner.world = 0, 1
    learner.on_gpu, learner.device = False, torch.device("cpu")
    learner.engine = LocalEngine(model, cfg)  # type: ignore[assignment]
    learner.ref = learner.critic = None
    learner.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    learner.packing = cfg.train.packing is True  # sdpa: padded micro-batches, as the learner picks
    learner.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    learner.version = 0
    learner.loss_cfg = algos.PolicyLossConfig(
        correction=cfg.algo.off_policy.correction,
        clip_low=cfg.algo.loss.clip_low,
        clip_high=cfg.algo.loss.clip_high,
        dual_clip=cfg.algo.loss.dual_clip,
        is_cap=cfg.algo.off_policy.is_cap,
        ratio_level=cfg.algo.loss.ratio_level,
        aggregation=cfg.algo.loss.aggregation,
    )
    return learner


# --------------------------------------------------------------------------- generation and scoring


def sample_groups(
    model: torch.nn.Module,
    tok: Any,
    rows: list[dict[str, str]],
    cfg: FlywheelConfig,
    version: int,
    learner_version: int,
) -> list[RolloutGroup]:
    """One group of ``data.n_samples_per_prompt`` samples per row from ``model`` (policy ``version``),
    with each token's behaviour log-probability and version as a generator streams them, scored by
    the reward service's arithmetic verifier."""
    n = cfg.data.n_samples_per_prompt
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts for _ in range(n)])
    mask = (
        torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts for _ in range(n)])[:, None]
    ).long()
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.rollout.max_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, width:]
    logits = torch.stack(out.logits, 1).float() / temperature
    lps = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]
    responses: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    for k in range(len(new)):
        length = len(new[k])
        eos = (new[k] == tok.eos_token_id).nonzero()
        if len(eos):
            length = int(eos[0]) + 1  # the stop token is part of the response, as vLLM returns it
        responses.append(new[k, :length].numpy().astype(np.int32))
        logprobs.append(lps[k, :length].numpy().astype(np.float32))
    texts = tok.batch_decode([r.tolist() for r in responses], skip_special_tokens=True)
    scores = arithmetic_reward(
        [r["prompt"] for r in rows for _ in range(n)], texts, [{"answer": r["answer"]} for r in rows for _ in range(n)]
    )
    groups = []
    for g, row in enumerate(rows):
        samples = []
        for k in range(g * n, (g + 1) * n):
            finish = "stop" if responses[k][-1] == tok.eos_token_id else "length"
            samples.append(
                RolloutSample(
                    tokens=responses[k],
                    logprobs=logprobs[k],
                    versions=np.full(len(responses[k]), version, np.int32),
                    finish_reason=finish,
                    reward=scores[k]["reward"],
                    reward_breakdown=scores[k],
                    reward_error=None,
                )
            )
        groups.append(
            RolloutGroup(
                group_id=g,
                version=version,
                staleness=learner_version - version,
                prompt_index=g,
                prompt_tokens=np.asarray(prompts[g], np.int32),
                metadata={"answer": row["answer"]},
                samples=samples,
            )
        )
    return groups


def greedy_accuracy(model: torch.nn.Module, tok: Any, rows: list[dict[str, str]], cfg: FlywheelConfig) -> float:
    """As ``learner.evaluate``: greedy decoding, left padding, the same verifier."""
    tok.padding_side = "left"
    model.eval()
    hits = 0
    for i in range(0, len(rows), 128):
        chunk = rows[i : i + 128]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=min(cfg.rollout.max_tokens, 16), do_sample=False, pad_token_id=tok.pad_token_id
            )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum(arithmetic_correct(t, r["answer"])[0] for t, r in zip(texts, chunk, strict=True))
    return hits / len(rows)


def behaviour_weights(learner: Trainer, batch: Batch) -> dict[str, float]:
    """How off-policy the batch is for the learner, whatever the correction: the importance weight
    current / behaviour of every response token before the update (mean of it truncated at the
    cap, its largest value, the share above the cap)."""
    seqs, _ = sequences(batch)
    mb = build_micro_batch(seqs, list(range(len(seqs))), learner.packing, learner.pad_id)
    with torch.no_grad():
        lp, mask = to_rows(token_logprobs(learner._forward(learner.engine, mb), mb.targets, learner.temperature), mb)
    behav = pad_rows([s.behav_logprobs for s in seqs], mask.shape[1])
    w = torch.exp(lp - behav)
    cap = learner.loss_cfg.is_cap
    return {
        "w_trunc_mean": float(algos.masked_mean(w.clamp(max=cap), mask)),
        "w_max": float((w * mask).max()),
        "w_above_cap": float(algos.masked_mean((w > cap).float(), mask)),
        "abs_log_w": float(algos.masked_mean((lp - behav).abs(), mask)),
    }


# --------------------------------------------------------------------------- one run


def warm_start(task: Task, args: argparse.Namespace, work: Path) -> Path:
    """The task's supervised warm start (``learner.sft``, as ``flywheel run`` does it) from the
    recipe's model built from code; kept in ``work`` and reused by every run."""
    from flywheel.tiny import build_checkpoint
    from learner.sft import warm_start as sft

    cfg = recipe(task, args)
    size = cfg.launch.tiny_model or "small"
    out = work / f"warm-{task.name}-{size}-sft{cfg.sft.steps}-seed{cfg.run.seed}"
    if not (out / "config.json").exists():
        base = build_checkpoint(work / f"base-{size}-seed{cfg.run.seed}", size=size, seed=cfg.run.seed)
        sft(
            cfg.model_copy(update={"train": cfg.train.model_copy(update={"model": str(base)})}),
            out,
            task.train_rows(cfg),
        )
    return out


@dataclass
class Run:
    curve: list[dict[str, float]]  # per learner step: the trainer's metrics plus behaviour_weights'
    accuracy_start: float
    accuracy_end: float
    wall_s: float


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stale_batch(
    history: deque[tuple[int, dict[str, torch.Tensor]]],
    behaviour: torch.nn.Module,
    tok: Any,
    rows: list[dict[str, str]],
    cfg: FlywheelConfig,
    learner_version: int,
    pick: Callable[[int], int],
) -> Batch:
    """The batch the learner at ``learner_version`` claims: each group generated by the policy
    version ``history[pick(len(history))]`` (``history`` holds the versions the bound allows)."""
    picks = [pick(len(history)) for _ in rows]
    groups: list[RolloutGroup | None] = [None] * len(rows)
    for h in sorted(set(picks)):
        version, state = history[h]
        behaviour.load_state_dict(state)  # a generator serving that version
        idx = [i for i, p in enumerate(picks) if p == h]
        for i, g in zip(
            idx, sample_groups(behaviour, tok, [rows[i] for i in idx], cfg, version, learner_version), strict=True
        ):
            g.group_id = g.prompt_index = i
            groups[i] = g
    return Batch(learner_version=learner_version, groups=[g for g in groups if g is not None], dropped=0, wait_s=0.0)


def train(task: Task, cfg: FlywheelConfig, warm: Path, staleness: str = "max", label: str = "") -> Run:
    """``train.total_steps`` learner steps from the warm-started policy, each on a batch generated
    ``async.max_staleness`` versions back (``staleness`` max) or at a version drawn from the allowed
    ones (uniform); greedy accuracy on the task's held-out prompts before and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    tok = AutoTokenizer.from_pretrained(warm)
    policy = AutoModelForCausalLM.from_pretrained(warm)
    behaviour = AutoModelForCausalLM.from_pretrained(warm)
    policy.config.use_cache = False
    learner = local_learner(cfg, policy)
    eval_rows, prompts = task.eval_rows(cfg), task.train_rows(cfg)
    start = time.perf_counter()
    acc_start = greedy_accuracy(policy, tok, eval_rows, cfg)
    history: deque[tuple[int, dict[str, torch.Tensor]]] = deque([(0, snapshot(policy))], cfg.async_.max_staleness + 1)
    pick = (lambda n: 0) if staleness == "max" else rng.randrange  # history[0] is the oldest allowed version
    order: list[int] = []
    curve: list[dict[str, float]] = []
    for step in range(cfg.train.total_steps):
        rows = []
        for _ in range(cfg.async_.groups_per_step):
            order = order or rng.sample(range(len(prompts)), len(prompts))  # an epoch, shuffled
            rows.append(prompts[order.pop()])
        batch = stale_batch(history, behaviour, tok, rows, cfg, learner.version, pick)
        diag = behaviour_weights(learner, batch)
        stats = learner.train_step(batch)
        assert stats is not None, "the in-process learner runs without dynamic filtering"
        learner.version += 1
        history.append((learner.version, snapshot(policy)))
        curve.append({**{k: float(v) for k, v in stats.metrics.items()}, **diag})
        if (step + 1) % 20 == 0:
            recent = {k: np.mean([m[k] for m in curve[-20:]]) for k in ("reward/mean", "abs_log_w", "w_above_cap")}
            print(
                f"  {label} step {step + 1}: reward {recent['reward/mean']:.2f}, |log w| {recent['abs_log_w']:.3f}, "
                f"w > cap {recent['w_above_cap']:.2%}, {time.perf_counter() - start:.0f}s",
                flush=True,
            )
    acc_end = greedy_accuracy(policy, tok, eval_rows, cfg)
    return Run(curve, acc_start, acc_end, time.perf_counter() - start)


def run_one(task: Task, correction: str, eta: int, args: argparse.Namespace, warm: Path) -> dict[str, Any]:
    cfg = recipe(task, args, correction, eta)
    run = train(task, cfg, warm, args.staleness, label=f"{task.name} {correction} η={eta}")
    return summarise(task, correction, eta, run)


def summarise(task: Task, correction: str, eta: int, run: Run) -> dict[str, Any]:
    curve = run.curve
    tenth = max(1, len(curve) // 10)

    def mean(key: str, part: list[dict[str, float]] = curve) -> float:
        return float(np.mean([m[key] for m in part])) if part else 0.0

    stale = curve[eta:] or curve  # past the first η steps, every batch is η versions old
    return {
        "task": task.name,
        "correction": correction,
        "eta": eta,
        "steps": len(curve),
        "reward_first": mean("reward/mean", curve[:tenth]),
        "reward_last": mean("reward/mean", curve[-tenth:]),
        "accuracy_start": run.accuracy_start,
        "accuracy_end": run.accuracy_end,
        "w_trunc_mean": mean("w_trunc_mean", stale),
        "w_max": max((m["w_max"] for m in stale), default=0.0),
        "w_above_cap": mean("w_above_cap", stale),
        "abs_log_w": mean("abs_log_w", stale),
        "behav_weight_mean": mean("offpolicy/behav_weight_mean", stale),
        "behav_weight_max": max((m["offpolicy/behav_weight_max"] for m in stale), default=0.0),
        "clip_frac": mean("policy/clip_frac", stale),
        "entropy_last": mean("policy/entropy", curve[-tenth:]),
        "staleness_mean": mean("batch/staleness_mean"),
        "wall_s": run.wall_s,
        "reward_curve": [m["reward/mean"] for m in curve],
    }


# --------------------------------------------------------------------------- output


def smooth(values: list[float], window: int) -> list[float]:
    return [float(np.mean(values[max(0, i - window + 1) : i + 1])) for i in range(len(values))]


def plot(rows: list[dict[str, Any]], tasks: list[Task], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in rows if r["task"] == task.name):
            ax.plot(
                smooth(r["reward_curve"], window),
                color=COLOURS[r["correction"]],
                ls=STYLES.get(r["eta"], "-."),
                lw=1.6,
                label=f"{r['correction']}, η = {r['eta']}",
            )
        ax.set(xlabel="learner step", ylabel=f"batch reward (moving mean, {window} steps)", title=task.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="off-policy correction under staleness")
    heads = ["task", "correction", "η", "reward first → last tenth", "greedy acc before → after"]
    heads += ["w mean (trunc.)", "w max", "w > cap", "clip frac", "wall s"]
    for h in heads:
        table.add_column(h, justify="left" if h in ("task", "correction") else "right")
    for r in rows:
        table.add_row(
            r["task"],
            r["correction"],
            str(r["eta"]),
            f"{r['reward_first']:.2f} → {r['reward_last']:.2f}",
            f"{r['accuracy_start']:.0%} → {r['accuracy_end']:.0%}",
            f"{r['w_trunc_mean']:.3f}",
            f"{r['w_max']:.2f}",
            f"{r['w_above_cap']:.2%}",
            f"{r['clip_frac']:.3f}",
            f"{r['wall_s']:.0f}",
        )
    Console().print(table)


def headline(rows: list[dict[str, Any]], max_eta: int) -> dict[str, float]:
    """Per task and correction at the largest η: the last-tenth reward minus the η = 0 run's."""
    out: dict[str, float] = {}
    for r in rows:
        if r["eta"] != max_eta:
            continue
        base = next(
            (b for b in rows if b["task"] == r["task"] and b["eta"] == 0 and b["correction"] == r["correction"]), None
        )
        if base is not None:
            out[f"{r['task']}_{r['correction']}_reward_gap_eta{max_eta}"] = r["reward_last"] - base["reward_last"]
            out[f"{r['task']}_{r['correction']}_acc_gap_eta{max_eta}"] = r["accuracy_end"] - base["accuracy_end"]
    return out


def cached_run(
    name: str, correction: str, eta: int, args: argparse.Namespace, warm: Path, work: Path
) -> dict[str, Any]:
    """One run, or its result from ``work`` when this sweep finished it before (an interrupted sweep)."""
    task = TASKS[name]
    key = f"{name}-{correction}-eta{eta}-lr{args.lr:g}-steps{args.steps}-{args.staleness}-seed{args.seed}"
    cached = work / "runs" / f"{key}{'-' + '_'.join(args.overrides) if args.overrides else ''}.json"
    if cached.exists() and not args.quick and not args.fresh:
        r: dict[str, Any] = json.loads(cached.read_text())
    else:
        r = run_one(task, correction, eta, args, warm)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(r) + "\n")
    print(
        f"{name} {correction} η={eta}: reward {r['reward_first']:.2f} -> {r['reward_last']:.2f}, "
        f"accuracy {r['accuracy_start']:.0%} -> {r['accuracy_end']:.0%} ({r['wall_s']:.0f}s)",
        flush=True,
    )
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps per configuration, under a minute in all")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    p.add_argument("--etas", nargs="+", type=int, default=[0, 4, 8])
    p.add_argument("--steps", type=int, default=200, help="learner steps per run")
    p.add_argument("--lr", type=float, default=1e-4, help="learner learning rate (the quickstart's is 1e-4)")
    p.add_argument("--staleness", choices=["max", "uniform"], default="max", help="see the module docstring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=str(ROOT / "runs" / "offpolicy"), help="warm-started models are kept here")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine, 2 threads spinning at OpenMP barriers ran 80x slower)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once (processes of --threads threads each)")
    p.add_argument("--fresh", action="store_true", help="run again what --work already holds a result of")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "offpolicy.json"))
    args, args.overrides = p.parse_known_args()  # the rest: config flags (--async.groups_per_step 16)
    if args.quick:
        args.steps = 3
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    tasks = [TASKS[t] for t in args.tasks]
    start = time.perf_counter()
    warm = {task.name: warm_start(task, args, work) for task in tasks}
    plan = [(t.name, c, eta) for t in tasks for eta in args.etas for c in args.corrections]
    with ProcessPoolExecutor(
        args.jobs, mp_context=mp.get_context("spawn"), initializer=torch.set_num_threads, initargs=(args.threads,)
    ) as pool:
        futures = [pool.submit(cached_run, name, c, eta, args, warm[name], work) for name, c, eta in plan]
        rows = [f.result() for f in futures]
    print_table(rows)
    out = Path(args.out)
    result = {
        "benchmark": "offpolicy",
        "headline": headline(rows, max(args.etas)),
        "config": {k: v for k, v in vars(args).items() if k not in ("work", "out")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": args.threads},
        "wall_s": time.perf_counter() - start,
        "rows": rows,
    }
    if not args.quick:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(rows, tasks, out.with_suffix(".png"), max(1, args.steps // 20))
    print(f"sweep: {result['wall_s']:.0f}s" + ("" if args.quick else f"; {out} and {out.with_suffix('.png')}"))


if __name__ == "__main__":
    main()
