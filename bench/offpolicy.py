"""Off-policy correction under staleness (issue 7): ``decoupled``, ``tis`` and ``none`` at η = 0, 4, 8
on two synthetic tasks, in one process (``bench/results/offpolicy.json``, ``offpolicy.png``).

Faithful to the loop, without its processes: the policy versions the hub and the generators would
hold are kept as a history of weight snapshots (the last η + 1); each learner step trains on a
batch sampled by the policy η versions ago (``--staleness max``: every group as stale as the bound
allows, the worst case; ``uniform``: each group's version drawn from the η + 1 allowed, a mix like
the hub serves), with the behaviour log-probabilities recorded at sampling time as the generator
does. The update is the learner's, from its own parts (``LocalLearner``): ``learner.batching``
micro-batch and log-probabilities, ``learner.algos`` advantages and policy loss with the config's
correction (``decoupled``: clipped around the proximal policy, the learner's weights before the
update, recomputed without gradient, times the behaviour weight prox / behaviour truncated at
``algo.off_policy.is_cap``), one AdamW step per batch with the learner's gradient clipping;
DeepSpeed, the hub and the weight broadcast are left out. Sampling is a plain HF ``generate``
(temperature 1, no top-k/top-p), seeded the same for every run, so runs differ only in the
correction and η (and in rounding: see the README on how far that goes).

Tasks: ``add`` is the quickstart recipe (``configs/quickstart.yaml``: single-digit sums, 40
supervised warm-start steps on reference answers, GRPO with 32 prompts x 8 samples); ``add3`` is
the same recipe with three addends ("What is 3 + 5 + 7? Answer:", sums to 27): 1,000 distinct
prompts, 200 of them held out for the greedy evaluation and never trained on. Both are scored by
the arithmetic verifier of the reward service (the first integer of the completion is the sum).

    python bench/offpolicy.py                 # the sweep: 18 runs, 56 CPU-minutes (README: wall time)
    python bench/offpolicy.py --quick         # the code path: 2 steps per correction on add at η = 0 and 8
    python bench/offpolicy.py --corrections decoupled none --etas 0 8 --seeds 0 1 2 --eta0-once \
        --out bench/results/offpolicy_seeds.json   # the seed replicates of the README
    python bench/offpolicy.py --tasks add --corrections none --etas 8 --steps 50   # one run

Finished runs are kept in ``--work`` (``runs/offpolicy``) and not run again: an interrupted sweep
resumes where it stopped. One torch thread per run: on a shared 2-core machine two threads per
process spinning at OpenMP barriers made the same work up to 80 times slower.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import resource
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
from learner.batching import (  # noqa: E402
    MicroBatch,
    build_micro_batch,
    entropy_at,
    pad_rows,
    sequences,
    to_rows,
    token_logprobs,
)
from reward_service.builtins import arithmetic as arithmetic_reward  # noqa: E402

CORRECTIONS = ("decoupled", "tis", "none")
COLOURS = {"decoupled": "tab:blue", "tis": "tab:green", "none": "tab:red"}
STYLES = {0: ":", 4: "--", 8: "-"}
WARM_SEED = 0  # the quickstart's run.seed: its model and warm start


# --------------------------------------------------------------------------- tasks


def add3_prompt(a: int, b: int, c: int) -> str:
    return f"What is {a} + {b} + {c}? Answer:"


def add3_triples(seed: int) -> list[tuple[int, ...]]:
    triples = list(itertools.product(range(10), repeat=3))
    random.Random(seed + 1).shuffle(triples)
    return triples


def add3_eval_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """The first ``n`` of the 1,000 triples in a seeded order: held out, never trained on."""
    return [{"prompt": add3_prompt(*t), "answer": str(sum(t))} for t in add3_triples(seed)[:n]]


def add3_rows(n: int, seed: int = 0, held_out: int = 0) -> list[dict[str, str]]:
    """``n`` training prompts drawn from the triples ``add3_eval_rows(held_out)`` does not hold."""
    rng = random.Random(seed)
    pool = add3_triples(seed)[held_out:]
    rows = []
    for _ in range(n):
        t = rng.choice(pool)
        rows.append({"prompt": add3_prompt(*t), "answer": str(sum(t))})
    return rows


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
        "a + b + c (harder; 200 held-out triples)",
        lambda c: add3_rows(c.task.prompts, c.task.seed, held_out=c.task.eval_prompts),
        lambda c: add3_eval_rows(c.task.eval_prompts, c.task.seed),
        ("--task.eval_prompts", "200"),
    ),
}


def recipe(
    task: Task, args: argparse.Namespace, correction: str = "decoupled", eta: int = 0, seed: int | None = None
) -> FlywheelConfig:
    """The quickstart recipe for ``task`` with the sweep's settings; ``run.seed`` is ``args.seed``
    (the RL run's sampling and prompt order) unless ``seed`` is given."""
    over = [*task.overrides, "--algo.off_policy.correction", correction, "--async.max_staleness", str(eta)]
    over += ["--train.lr", str(args.lr), "--train.total_steps", str(args.steps)]
    over += ["--run.seed", str(args.seed if seed is None else seed)]
    over += list(getattr(args, "overrides", []))
    return load_config(over, recipe=ROOT / "configs" / "quickstart.yaml")


# --------------------------------------------------------------------------- the learner, in process


class LocalLearner:
    """The learner's update (``learner/trainer.py`` ``train_step``) on one CPU process, from the
    learner's own parts: ``learner.batching`` turns the batch into a padded micro-batch and token
    log-probabilities; ``learner.algos`` gives the advantages and the policy loss, with the
    correction, clip range and behaviour-weight cap of the config (as the trainer builds its
    ``PolicyLossConfig``); the proximal log-probabilities of ``decoupled`` are recomputed without
    gradient with the weights before the update, as the trainer does; one AdamW step per batch with
    ``train.grad_clip``. The recipes' token budget (4,096) holds a whole batch, so the trainer too
    takes it as one micro-batch. DeepSpeed, the hub and the weight broadcast are left out."""

    def __init__(self, cfg: FlywheelConfig, model: Any) -> None:
        t = cfg.train
        if t.lr_schedule != "constant" or t.warmup_steps or cfg.algo.kl.coef > 0 or cfg.algo.critic.enabled:
            raise ValueError("the in-process learner takes a constant learning rate, no KL penalty and no critic")
        self.cfg, self.model = cfg, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.999), weight_decay=t.weight_decay)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.version = 0
        self.loss_cfg = algos.PolicyLossConfig.from_config(cfg)

    def token_logprobs(self, mb: MicroBatch, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[sequences, response tokens] log-probabilities, mask and entropy under the current weights."""
        with torch.enable_grad() if grad else torch.no_grad():
            logits = self.model(
                input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask, use_cache=False
            ).logits
            lp, mask = to_rows(token_logprobs(logits, mb.targets, self.temperature), mb)
            entropy, _ = to_rows(entropy_at(logits.detach(), mb, grad=False, temperature=self.temperature), mb)
        return lp, mask, entropy

    def train_step(self, batch: Batch) -> dict[str, float]:
        seqs, rewards_GN = sequences(batch)
        mb = build_micro_batch(seqs, list(range(len(seqs))), packed=False, pad_id=self.pad_id)
        self.model.train()
        # the weights before the update: decoupled's proximal policy; for every correction, how far
        # the behaviour policy is from the learner (the importance weight current / behaviour)
        before, mask, _ = self.token_logprobs(mb, grad=False)
        behav = pad_rows([s.behav_logprobs for s in seqs], mask.shape[1])
        a = self.cfg.algo.advantage
        adv, _ = algos.advantages(a.estimator, rewards_GN, mask, gamma=a.gamma, lam=a.lam)
        prox = before if self.loss_cfg.correction == "decoupled" else None
        lp, _, entropy = self.token_logprobs(mb, grad=True)
        loss, m = algos.policy_loss(lp, prox, behav, adv, mask, self.loss_cfg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip))
        self.optimizer.step()
        self.version += 1
        w, cap = torch.exp(before - behav), self.loss_cfg.is_cap
        return {
            "reward/mean": float(rewards_GN.mean()),
            "loss/policy": float(loss.detach()),
            "grad_norm": grad_norm,
            "policy/entropy": float(algos.masked_mean(entropy, mask)),
            "policy/clip_frac": m["clip_frac"],
            "policy/ratio_mean": m["ratio_mean"],
            "offpolicy/behav_weight_mean": m["behav_weight_mean"],
            "offpolicy/behav_weight_max": m["behav_weight_max"],
            "batch/staleness_mean": float(np.mean([s.staleness for s in seqs])),
            "w_trunc_mean": float(algos.masked_mean(w.clamp(max=cap), mask)),
            "w_max": float((w * mask).max()),
            "w_above_cap": float(algos.masked_mean((w > cap).float(), mask)),
            "abs_log_w": float(algos.masked_mean((before - behav).abs(), mask)),
        }


# --------------------------------------------------------------------------- generation and scoring


def sample_groups(
    model: Any,
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


def greedy_accuracy(model: Any, tok: Any, rows: list[dict[str, str]], cfg: FlywheelConfig) -> float:
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


# --------------------------------------------------------------------------- one run


def warm_start(task: Task, args: argparse.Namespace, work: Path) -> Path:
    """The task's supervised warm start (``learner.sft``, as ``flywheel run`` does it) from the
    recipe's model built from code, with the recipe's seed whatever ``--seeds`` (they vary the RL
    runs only); kept in ``work`` and reused by every run."""
    from flywheel.tiny import build_checkpoint
    from learner.sft import warm_start as sft

    cfg = recipe(task, args, seed=WARM_SEED)
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
    curve: list[dict[str, float]]  # per learner step: LocalLearner.train_step's metrics
    accuracy_start: float
    accuracy_end: float
    wall_s: float
    cpu_s: float  # this process's CPU time


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
    learner = LocalLearner(cfg, policy)
    eval_rows, prompts = task.eval_rows(cfg), task.train_rows(cfg)
    start, cpu = time.perf_counter(), time.process_time()
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
        curve.append(learner.train_step(batch))
        history.append((learner.version, snapshot(policy)))
        if (step + 1) % 20 == 0:
            recent = {k: np.mean([m[k] for m in curve[-20:]]) for k in ("reward/mean", "abs_log_w", "w_above_cap")}
            print(
                f"  {label} step {step + 1}: reward {recent['reward/mean']:.2f}, |log w| {recent['abs_log_w']:.3f}, "
                f"w > cap {recent['w_above_cap']:.2%}, {time.perf_counter() - start:.0f}s",
                flush=True,
            )
    acc_end = greedy_accuracy(policy, tok, eval_rows, cfg)
    return Run(curve, acc_start, acc_end, time.perf_counter() - start, time.process_time() - cpu)


def run_one(task: Task, correction: str, eta: int, args: argparse.Namespace, warm: Path) -> dict[str, Any]:
    cfg = recipe(task, args, correction, eta)
    run = train(task, cfg, warm, args.staleness, label=f"{task.name} {correction} η={eta}")
    return {**summarise(task, correction, eta, run), "seed": cfg.run.seed}


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
        "reward_peak": max(smooth([m["reward/mean"] for m in curve], tenth), default=0.0),
        "reward_mean": mean("reward/mean"),  # over every step: how fast it learns
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
        "cpu_s": run.cpu_s,
        "reward_curve": [m["reward/mean"] for m in curve],
        "abs_log_w_curve": [m["abs_log_w"] for m in curve],
        "clip_frac_curve": [m["policy/clip_frac"] for m in curve],
    }


# --------------------------------------------------------------------------- output


def smooth(values: list[float], window: int) -> list[float]:
    return [float(np.mean(values[max(0, i - window + 1) : i + 1])) for i in range(len(values))]


def over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, correction, η): the mean over its seeds of every figure and of the reward
    curve, with the seeds' standard deviation of the last-tenth reward and final accuracy."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        r.setdefault("reward_mean", float(np.mean(r["reward_curve"])))  # results written before it was kept
        groups.setdefault((r["task"], r["correction"], r["eta"]), []).append(r)
    out = []
    for (task, correction, eta), runs in groups.items():
        row: dict[str, Any] = {"task": task, "correction": correction, "eta": eta, "seeds": len(runs)}
        for key, value in runs[0].items():
            if isinstance(value, float) and key not in row:
                row[key] = float(np.mean([r[key] for r in runs]))
        row["w_max"] = max(r["w_max"] for r in runs)
        row["reward_curve"] = np.mean([r["reward_curve"] for r in runs], 0).tolist()
        row["reward_last_sd"] = float(np.std([r["reward_last"] for r in runs]))
        row["reward_mean_sd"] = float(np.std([r["reward_mean"] for r in runs]))
        row["accuracy_end_sd"] = float(np.std([r["accuracy_end"] for r in runs]))
        out.append(row)
    return out


def plot(rows: list[dict[str, Any]], tasks: list[Task], path: Path, window: int) -> None:
    """One panel per task: the batch reward (moving mean; the mean over seeds when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in over_seeds(rows) if r["task"] == task.name):
            seeds = f" ({r['seeds']} seeds)" if r["seeds"] > 1 else ""
            ax.plot(
                smooth(r["reward_curve"], window),
                color=COLOURS[r["correction"]],
                ls=STYLES.get(r["eta"], "-."),
                # wide and pale under the others: decoupled and tis coincide in this learner (README)
                lw=3.2 if r["correction"] == "decoupled" else 1.4,
                alpha=0.5 if r["correction"] == "decoupled" else 1.0,
                label=f"{r['correction']}, η = {r['eta']}{seeds}",
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
    heads = ["task", "correction", "η", "seed", "reward first → last tenth (peak)", "mean reward"]
    heads += ["greedy acc before → after"]
    heads += ["|log w|", "w mean (trunc.)", "w max", "w > cap", "clip frac", "wall s"]
    for h in heads:
        table.add_column(h, justify="left" if h in ("task", "correction") else "right")
    for r in rows:
        table.add_row(
            r["task"],
            r["correction"],
            str(r["eta"]),
            str(r.get("seed", 0)),
            f"{r['reward_first']:.2f} → {r['reward_last']:.2f} ({r['reward_peak']:.2f})",
            f"{np.mean(r['reward_curve']):.3f}",
            f"{r['accuracy_start']:.0%} → {r['accuracy_end']:.0%}",
            f"{r['abs_log_w']:.3f}",
            f"{r['w_trunc_mean']:.3f}",
            f"{r['w_max']:.2f}",
            f"{r['w_above_cap']:.2%}",
            f"{r['clip_frac']:.3f}",
            f"{r['wall_s']:.0f}",
        )
    console = Console(width=180)
    console.print(table)
    means = over_seeds(rows)
    if all(m["seeds"] == 1 for m in means):
        return
    table = Table(title="mean ± standard deviation over seeds")
    for h in (
        "task",
        "correction",
        "η",
        "seeds",
        "reward, last tenth",
        "mean reward",
        "greedy accuracy after",
        "|log w|",
    ):
        table.add_column(h, justify="left" if h in ("task", "correction") else "right")
    for m in means:
        table.add_row(
            m["task"],
            m["correction"],
            str(m["eta"]),
            str(m["seeds"]),
            f"{m['reward_last']:.2f} ± {m['reward_last_sd']:.2f}",
            f"{m['reward_mean']:.3f} ± {m['reward_mean_sd']:.3f}",
            f"{m['accuracy_end']:.0%} ± {m['accuracy_end_sd']:.0%}",
            f"{m['abs_log_w']:.3f}",
        )
    console.print(table)


def headline(rows: list[dict[str, Any]], max_eta: int) -> dict[str, float]:
    """Per task: the spread (max - min) of the last-tenth reward over its η = 0 runs, every seed and
    correction (the corrections take the same update there: the spread is run-to-run noise), and
    per correction, its η = ``max_eta`` last-tenth and mean reward and final greedy accuracy minus
    the η = 0 runs' (means over seeds)."""
    means = over_seeds(rows)
    out: dict[str, float] = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        base = [r for r in means if r["task"] == task and r["eta"] == 0]
        if not base:
            continue
        spread = [r["reward_last"] for r in rows if r["task"] == task and r["eta"] == 0]
        out[f"{task}_eta0_reward_last_spread"] = max(spread) - min(spread)
        for r in means:
            if r["task"] == task and r["eta"] == max_eta:
                for key, name in (
                    ("reward_last", "reward"),
                    ("reward_mean", "mean_reward"),
                    ("accuracy_end", "accuracy"),
                ):
                    out[f"{task}_{r['correction']}_{name}_gap_eta{max_eta}"] = r[key] - float(
                        np.mean([b[key] for b in base])
                    )
    return out


def cached_run(
    name: str, correction: str, eta: int, seed: int, args: argparse.Namespace, warm: Path, work: Path
) -> dict[str, Any]:
    """One run, or its result from ``work`` when this sweep finished it before (an interrupted sweep)."""
    task = TASKS[name]
    args = argparse.Namespace(**{**vars(args), "seed": seed})
    key = f"{name}-{correction}-eta{eta}-lr{args.lr:g}-steps{args.steps}-{args.staleness}-seed{args.seed}"
    cached = work / "runs" / f"{key}{'-' + '_'.join(args.overrides) if args.overrides else ''}.json"
    if cached.exists() and not args.quick and not args.fresh:
        r: dict[str, Any] = json.loads(cached.read_text())
    else:
        r = run_one(task, correction, eta, args, warm)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(r) + "\n")
    r.setdefault("seed", seed)
    print(
        f"{name} {correction} η={eta} seed {seed}: reward {r['reward_first']:.2f} -> {r['reward_last']:.2f}, "
        f"accuracy {r['accuracy_start']:.0%} -> {r['accuracy_end']:.0%} ({r['wall_s']:.0f}s)",
        flush=True,
    )
    return r


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 steps per correction on add at η = 0 and 8 (the code path)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    p.add_argument("--etas", nargs="+", type=int, default=[0, 4, 8])
    p.add_argument("--steps", type=int, default=100, help="learner steps per run")
    p.add_argument(
        "--lr", type=float, default=2e-4, help="learner learning rate (twice the quickstart's 1e-4: a stress)"
    )
    p.add_argument("--staleness", choices=["max", "uniform"], default="max", help="see the module docstring")
    p.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="RL seeds (sampling, prompt order): a run for each"
    )
    p.add_argument(
        "--work", default=str(ROOT / "runs" / "offpolicy"), help="warm-started models and finished runs are kept here"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine, 2 threads spinning at OpenMP barriers ran 80x slower)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once (processes of --threads threads each)")
    p.add_argument(
        "--eta0-once",
        action="store_true",
        help="at η = 0 run the first correction only (the corrections take the same update on fresh batches)",
    )
    p.add_argument("--fresh", action="store_true", help="run again what --work already holds a result of")
    p.add_argument("--out", default=None, help="(default bench/results/offpolicy.json; quick: offpolicy_quick.json)")
    p.add_argument(
        "--from-results",
        action="store_true",
        help="run nothing: recompute the headline, table and figure from the rows in --out (timings kept)",
    )
    args, overrides = p.parse_known_args()
    args.overrides = overrides  # the rest: config flags (--async.groups_per_step 16)
    if args.quick:
        args.steps, args.tasks, args.etas = 2, ["add"], [0, 8]
    # a quick look never overwrites the recorded full run
    args.out = args.out or str(
        ROOT / "bench" / "results" / ("offpolicy_quick.json" if args.quick else "offpolicy.json")
    )
    return args


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (task, η, correction) of ``args``, ``args.jobs`` at a time, in processes of their own."""
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    warm = {name: warm_start(TASKS[name], args, work) for name in args.tasks}
    plan = [(n, c, eta, seed) for seed in args.seeds for n in args.tasks for eta in args.etas for c in args.corrections]
    if args.eta0_once:
        plan = [(n, c, eta, seed) for n, c, eta, seed in plan if eta > 0 or c == args.corrections[0]]
    with ProcessPoolExecutor(
        args.jobs, mp_context=mp.get_context("spawn"), initializer=torch.set_num_threads, initargs=(args.threads,)
    ) as pool:
        futures = [pool.submit(cached_run, n, c, eta, seed, args, warm[n], work) for n, c, eta, seed in plan]
        return [f.result() for f in futures]


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.from_results:  # derived figures of an earlier sweep, recomputed by this code
        result = json.loads(out.read_text())
        rows = result["rows"]
        for r in rows:
            r.setdefault("seed", 0)
        result["headline"] = headline(rows, max(r["eta"] for r in rows))
        print_table(rows)
        out.write_text(json.dumps(result, indent=1) + "\n")
        names = list(dict.fromkeys(r["task"] for r in rows))
        plot(rows, [TASKS[n] for n in names], out.with_suffix(".png"), max(1, result["config"]["steps"] // 10))
        return
    start = time.perf_counter()
    rows = sweep(args)
    print_table(rows)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {
        "benchmark": "offpolicy",
        "headline": headline(rows, max(args.etas)),
        "config": {k: v for k, v in vars(args).items() if k not in ("work", "out", "from_results", "fresh")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": args.threads},
        "wall_s": time.perf_counter() - start,  # of this invocation (runs found in --work are not run again)
        "cpu_s": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, [TASKS[n] for n in args.tasks], out.with_suffix(".png"), max(1, args.steps // 10))
    print(f"sweep: {result['wall_s']:.0f}s; {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
