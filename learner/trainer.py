"""The learner: DeepSpeed training on batches claimed from the hub, one policy version per step.

The loop (``Trainer.run``) is short and delegates: claim a batch under the staleness bound ->
``train_step`` (proximal / reference log-probabilities, advantages, micro-batches by token
budget, one optimizer step) -> publish the new version -> broadcast weights every
``async.sync_every`` steps -> checkpoint -> report.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flywheel.config import FlywheelConfig
from flywheel.hub_client import Batch, BatchClient, BatchTimeout, ClaimsAhead
from flywheel.netsec import redis_client
from flywheel.staleness import StalenessPolicy
from flywheel.watchdog import WATCHDOG
from learner import algos
from learner.batching import (
    MicroBatch,
    Sequence,
    build_micro_batch,
    entropy_at,
    pad_rows,
    plan_micro_batches,
    sequences,
    to_rows,
    token_logprobs,
)

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: Counter[int] = field(default_factory=Counter)


def ds_config(cfg: FlywheelConfig, on_gpu: bool) -> dict[str, Any]:
    bf16 = cfg.ds.dtype == "bf16" or (cfg.ds.dtype == "auto" and on_gpu)
    zero: dict[str, Any] = {"stage": cfg.ds.zero_stage, "overlap_comm": on_gpu, "contiguous_gradients": True}
    if cfg.ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        # one sequence-packed micro-batch per forward; accumulation boundaries are set by hand
        # because the number of micro-batches per step follows the token budget
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def lr_lambda(cfg: FlywheelConfig) -> Any:
    t = cfg.train

    def f(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps))
        if t.lr_schedule == "linear":
            return 1.0 - (1.0 - t.min_lr_ratio) * progress
        return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class Trainer:
    def __init__(self, cfg: FlywheelConfig, rank: int, world: int) -> None:
        import deepspeed

        self.cfg = cfg
        self.rank, self.world = rank, world
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        conf = ds_config(cfg, self.on_gpu)
        self._hf_ds_config = None
        if cfg.ds.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(conf)  # from_pretrained then loads straight into shards
        model = self._load_model()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.999), weight_decay=cfg.train.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=conf
        )
        self.ref = self._load_reference() if cfg.algo.kl.coef > 0 else None
        self.critic = self._build_critic(conf) if cfg.algo.critic.enabled else None
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        t = cfg.train
        self.packing = t.packing is True or (
            t.packing == "auto" and t.attn_implementation in ("flash_attention_2", "flex_attention")
        )
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.version = 0
        self.redis = redis_client(cfg.redis)
        policy = StalenessPolicy(cfg.async_.max_staleness, cfg.async_.groups_per_step)
        claims_log = None
        if cfg.train.run_dir:
            Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
            claims_log = str(Path(cfg.train.run_dir) / f"claims.rank{rank}.log")
        self.client = BatchClient(
            self.redis, cfg.run.name, policy, claims_log=claims_log, redis_outage_s=cfg.redis.connect_timeout_s
        )
        n_groups = max(1, cfg.async_.groups_per_step // self.world)
        self.claims = ClaimsAhead(self.client, n_groups, cfg.train.batch_timeout_s)
        self.broadcaster = None
        if rank == 0:
            from learner.weight_sync import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg.sync, device=self.device, security=cfg.security)
        self.loss_cfg = algos.PolicyLossConfig(
            correction=cfg.algo.off_policy.correction,
            clip_low=cfg.algo.loss.clip_low,
            clip_high=cfg.algo.loss.clip_high,
            dual_clip=cfg.algo.loss.dual_clip,
            is_cap=cfg.algo.off_policy.is_cap,
            ratio_level=cfg.algo.loss.ratio_level,
            aggregation=cfg.algo.loss.aggregation,
        )

    # ------------------------------------------------------------------ models

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = (
            torch.bfloat16
            if (self.cfg.ds.dtype == "bf16" or (self.cfg.ds.dtype == "auto" and self.on_gpu))
            else torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(
            self.cfg.train.model, dtype=dtype, attn_implementation=self.cfg.train.attn_implementation
        )
        if self.cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model

    def _build_critic(self, conf: dict[str, Any]) -> Any:
        """A value model: the policy's backbone with a scalar head, in its own DeepSpeed engine."""
        import deepspeed
        from transformers import AutoModelForTokenClassification

        c = self.cfg.algo.critic
        model = AutoModelForTokenClassification.from_pretrained(
            c.model or self.cfg.train.model,
            num_labels=1,
            dtype=self.engine.module.dtype,
            attn_implementation=self.cfg.train.attn_implementation,
        )
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=self.cfg.train.weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf)
        return engine

    def _load_reference(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(
            self.cfg.algo.kl.reference or self.cfg.train.model, dtype=self.engine.module.dtype
        )
        ref.requires_grad_(False)
        return ref.to(self.device).eval()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        total = self.cfg.train.total_steps
        if self.version > 0:
            self.sync_weights()  # a resumed learner: bring the generators to its version first
        reporter = self._reporter()
        try:
            self._loop(total, reporter)
        finally:
            if hasattr(reporter, "close"):
                reporter.close()  # wandb's files and the metrics file are complete even after an error
        if self.cfg.train.checkpoint_dir:
            self.save_checkpoint()
        if self.cfg.train.export_dir:
            self.export(Path(self.cfg.train.export_dir))

    def _loop(self, total: int, reporter: Any) -> None:
        while self.version < total:
            t0 = time.perf_counter()
            batch = self.claim()
            waited = time.perf_counter() - t0
            if self.version + 1 < total:
                self.claims.claim_ahead(self.version + 1)  # loads while this step trains
            stats = self.train_step(batch)
            if stats is None:
                continue  # every group was filtered out: no signal, no step
            self.version += 1
            stats.version = self.version
            if self.rank == 0:
                self.client.set_version(self.version)
            if self.version % self.cfg.async_.sync_every == 0 or self.version == total:
                self.sync_weights()
            if self.cfg.train.checkpoint_every and self.version % self.cfg.train.checkpoint_every == 0:
                self.save_checkpoint()
            step_s = time.perf_counter() - t0
            stats.metrics.update(
                {
                    "perf/step_s": step_s,
                    "perf/idle_frac": waited / step_s,
                    "perf/tokens_per_s": stats.metrics["perf/tokens"] / max(step_s - waited, 1e-9),
                    "watchdog/overdue": float(sum(WATCHDOG.overdue.values())),
                }
            )
            reporter(stats)

    def claim(self) -> Batch:
        try:
            with WATCHDOG.wait(f"claim of the batch for v{self.version}", self.cfg.run.watchdog_s):
                return self.claims.claim(self.version)
        except BatchTimeout as err:
            raise RuntimeError(f"learner v{self.version}: {err}") from err

    # ------------------------------------------------------------------ one optimizer step

    def loss_on(self, batch: Batch) -> float:
        """The policy loss this learner would optimise on ``batch`` now, without a step."""
        stats = self.train_step(batch, apply=False)
        assert stats is not None, "every group of the batch was filtered out"
        return stats.metrics["loss/policy"]

    def train_step(self, batch: Batch, apply: bool = True) -> StepStats | None:
        seqs, rewards_GN = sequences(batch)
        stats = StepStats(self.version)
        stats.staleness.update(g.staleness for g in batch.groups)
        has_signal = True
        if self.cfg.algo.dynamic_filtering:
            keep = ~algos.uniform_groups(rewards_GN)
            stats.metrics["batch/groups_filtered"] = float((~keep).sum())
            has_signal = bool(keep.any())
            if has_signal:
                kept = set(torch.nonzero(keep).flatten().tolist())
                seqs = [s for s in seqs if s.group in kept]
                rewards_GN = rewards_GN[keep]
            else:  # nothing to learn here, but this rank still joins the step's collectives
                seqs = [s for s in seqs if s.group == 0]
                rewards_GN = rewards_GN[:1]
            if self._agree_max(int(has_signal)) == 0:
                return None  # no rank has a group with signal: no step
        mbs = [
            build_micro_batch(seqs, idx, self.packing, self.pad_id)
            for idx in plan_micro_batches(
                [len(s.prompt) + len(s.response) for s in seqs], self.cfg.train.micro_batch_tokens
            )
        ]
        # Every rank must run as many forwards and backwards as the busiest one (ZeRO's collectives
        # pair up across ranks); the extra ones repeat a micro-batch with a zero weight.
        weights = [1.0 if has_signal else 0.0] * len(mbs)
        extra = self._agree_max(len(mbs)) - len(mbs) if apply else 0
        mbs += [mbs[-1]] * extra
        weights += [0.0] * extra
        resp_mask = pad_rows([np.ones(len(s.response)) for s in seqs])
        prox = self._logprobs_no_grad(self.engine, seqs, mbs, resp_mask.shape[1]) if self._needs_prox() else None
        ref = self._logprobs_no_grad(self.ref, seqs, mbs, resp_mask.shape[1]) if self.ref is not None else None
        old_values = self._values(seqs, mbs, resp_mask.shape[1]) if self.critic is not None else None
        kl_in_reward = ref if (ref is not None and self.cfg.algo.kl.in_reward) else None
        kl_ref = None
        if kl_in_reward is not None:
            assert prox is not None
            kl_ref = algos.kl_estimate(prox, kl_in_reward, self.cfg.algo.kl.estimator)
        adv, returns = algos.advantages(
            self.cfg.algo.advantage.estimator,
            rewards_GN,
            resp_mask,
            values_BT=old_values,
            kl_BT=kl_ref,
            kl_coef=self.cfg.algo.kl.coef if kl_ref is not None else 0.0,
            gamma=self.cfg.algo.advantage.gamma,
            lam=self.cfg.algo.advantage.lam,
        )
        self._optimize(seqs, mbs, weights, adv, prox, ref, resp_mask, stats, apply)
        if self.critic is not None:
            assert old_values is not None and returns is not None
            self._fit_critic(mbs, weights, old_values, returns, resp_mask, stats, apply)
        behav = pad_rows([s.behav_logprobs for s in seqs])
        stats.metrics.update(
            {
                "reward/mean": float(rewards_GN.mean()),
                "reward/std": float(rewards_GN.std()) if rewards_GN.numel() > 1 else 0.0,
                "adv/mean": float(algos.masked_mean(adv, resp_mask)),
                "adv/std": float(adv[resp_mask > 0].std()) if resp_mask.sum() > 1 else 0.0,
                "adv/max": float(adv[resp_mask > 0].max()) if resp_mask.sum() else 0.0,
                "batch/groups": float(len(rewards_GN)),
                "batch/response_len": float(resp_mask.sum(1).mean()),
                "batch/staleness_mean": float(np.mean([s.staleness for s in seqs])),
                "batch/dropped_stale": float(batch.dropped),
                "perf/tokens": float(sum(mb.tokens for mb in mbs)),
                "lr": float(self.engine.get_lr()[0]),
            }
        )
        if prox is not None:
            stats.metrics["offpolicy/prox_minus_behav"] = float(algos.masked_mean(prox - behav, resp_mask))
        return stats

    def _agree_max(self, value: int) -> int:
        """The largest ``value`` over the data-parallel ranks."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _values(self, seqs: list[Sequence], mbs: list[MicroBatch], width: int) -> torch.Tensor:
        """The critic's values of every response position before this step (no gradient)."""
        out = torch.zeros((len(seqs), width), dtype=torch.float32)
        with torch.no_grad():
            for mb in mbs:
                rows, _ = to_rows(self._forward(self.critic, mb)[..., 0].float().cpu(), mb)
                out[mb.seq_index, : rows.shape[1]] = rows
        return out

    def _fit_critic(
        self,
        mbs: list[MicroBatch],
        weights: list[float],
        old_values: torch.Tensor,
        returns: torch.Tensor,
        resp_mask: torch.Tensor,
        stats: StepStats,
        apply: bool,
    ) -> None:
        assert self.critic is not None
        step_tokens = max(float(resp_mask.sum()), 1.0)
        clip = self.cfg.algo.critic.value_clip
        total, err = 0.0, 0.0
        for k, (mb, weight) in enumerate(zip(mbs, weights, strict=True)):
            with torch.enable_grad() if apply else torch.no_grad():
                values, mask = to_rows(self._forward(self.critic, mb)[..., 0].float(), mb)
                mask = mask.to(values.device)
                w = mask.shape[1]
                old = old_values[mb.seq_index, :w].to(values.device)
                ret = returns[mb.seq_index, :w].to(values.device)
                loss = algos.value_loss(values, old, ret, mask, clip) * (float(mask.sum()) / step_tokens) * weight
            if apply:
                self.critic.set_gradient_accumulation_boundary(k == len(mbs) - 1)
                self.critic.backward(loss)
                self.critic.step()
            total += float(loss.detach())
            err += float(((values.detach() - ret) ** 2 * mask).sum()) * weight
        stats.metrics["critic/value_loss"] = total
        stats.metrics["critic/value_mean"] = float(algos.masked_mean(old_values, resp_mask))
        stats.metrics["critic/return_mse"] = err / step_tokens

    def _needs_prox(self) -> bool:
        return self.cfg.algo.off_policy.correction == "decoupled" or (
            self.ref is not None and self.cfg.algo.kl.in_reward
        )

    def _forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        out = model(
            input_ids=mb.input_ids.to(self.device),
            position_ids=mb.position_ids.to(self.device),
            attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(self.device),
            use_cache=False,
        )
        return out.logits

    @torch.no_grad()
    def _logprobs_no_grad(self, model: Any, seqs: list[Sequence], mbs: list[MicroBatch], width: int) -> torch.Tensor:
        out = torch.zeros((len(seqs), width), dtype=torch.float32)
        for mb in mbs:
            lp = token_logprobs(self._forward(model, mb), mb.targets.to(self.device), self.temperature).cpu()
            rows, _ = to_rows(lp, mb)
            out[mb.seq_index, : rows.shape[1]] = rows
        return out

    def _optimize(
        self,
        seqs: list[Sequence],
        mbs: list[MicroBatch],
        weights: list[float],
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
        resp_mask: torch.Tensor,
        stats: StepStats,
        apply: bool = True,
    ) -> None:
        algo = self.cfg.algo
        step_tokens = float(resp_mask.sum())
        step_seqs, step_width = len(seqs), resp_mask.shape[1]
        sums: Counter[str] = Counter()
        self.engine.train()
        for k, (mb, weight) in enumerate(zip(mbs, weights, strict=True)):
            with torch.enable_grad() if apply else torch.no_grad():
                loss, m, n, ent_mean, kl_mean = self._micro_loss(
                    seqs, mb, adv, prox, ref, step_tokens, step_seqs, step_width
                )
            if weight == 0.0:
                loss, n = loss * 0.0, 0.0  # padding: same collectives, no gradient, not counted
            if apply:
                self.engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
                self.engine.backward(loss)
                self.engine.step()
            sums["tokens"] += n
            sums["loss"] += float(loss.detach())
            sums["entropy"] += ent_mean * n
            sums["kl"] += kl_mean * n
            for key in ("clip_frac", "ratio_mean", "behav_weight_mean"):
                sums[key] += m[key] * n
            sums["behav_weight_max"] = max(sums["behav_weight_max"], m["behav_weight_max"])
        self._record(sums, stats, len(mbs), ref is not None and not algo.kl.in_reward)

    def _micro_loss(
        self,
        seqs: list[Sequence],
        mb: MicroBatch,
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
        step_tokens: float,
        step_seqs: int,
        step_width: int,
    ) -> tuple[torch.Tensor, dict[str, float], float, float, float]:
        """One micro-batch's share of the step loss, its metrics, tokens, mean entropy, mean KL."""
        algo = self.cfg.algo
        idx = mb.seq_index
        logits = self._forward(self.engine, mb)
        lp, mask = to_rows(token_logprobs(logits, mb.targets.to(self.device), self.temperature), mb)
        w = mask.shape[1]
        mask = mask.to(lp.device)
        behav = pad_rows([seqs[i].behav_logprobs for i in idx], w).to(lp.device)
        a = adv[idx, :w].to(lp.device)
        p = prox[idx, :w].to(lp.device) if prox is not None else None
        loss, m = algos.policy_loss(lp, p, behav, a, mask, self.loss_cfg)
        kl_mean = 0.0
        if ref is not None and not algo.kl.in_reward:
            kl = algos.kl_estimate(lp, ref[idx, :w].to(lp.device), algo.kl.estimator)
            loss = loss + algo.kl.coef * algos.aggregate(kl, mask, self.loss_cfg.aggregation)
            kl_mean = float(algos.masked_mean(kl.detach(), mask))
        ent_rows, _ = to_rows(entropy_at(logits, mb, grad=algo.entropy_coef > 0), mb)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * algos.aggregate(ent_rows, mask, self.loss_cfg.aggregation)
        loss = loss * self._share(mb, mask, step_tokens, step_seqs, step_width)
        return loss, m, float(mask.sum()), float(algos.masked_mean(ent_rows.detach(), mask)), kl_mean

    def _record(self, sums: Counter[str], stats: StepStats, micro_batches: int, with_kl: bool) -> None:
        n = max(sums["tokens"], 1.0)
        stats.metrics.update(
            {
                "loss/policy": sums["loss"],
                "policy/entropy": sums["entropy"] / n,
                "policy/clip_frac": sums["clip_frac"] / n,
                "policy/ratio_mean": sums["ratio_mean"] / n,
                "offpolicy/behav_weight_mean": sums["behav_weight_mean"] / n,
                "offpolicy/behav_weight_max": sums["behav_weight_max"],
                "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                "perf/micro_batches": float(micro_batches),
            }
        )
        if with_kl:
            stats.metrics["policy/kl"] = sums["kl"] / n

    def _share(self, mb: MicroBatch, mask: torch.Tensor, step_tokens: float, step_seqs: int, step_width: int) -> float:
        """Scale a micro-batch's loss so the step's loss is the aggregation over the whole batch."""
        mode = self.loss_cfg.aggregation
        if mode == "token_mean":
            return float(mask.sum()) / max(step_tokens, 1.0)
        if mode == "seq_mean_token_mean":
            return len(mb.seq_index) / step_seqs
        return (mask.shape[0] * mask.shape[1]) / (step_seqs * step_width)

    # ------------------------------------------------------------------ weights out

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every parameter in full on every rank (ZeRO-3 gathers its shards for the duration)."""
        module = self.engine.module
        if self.cfg.ds.zero_stage == 3:
            import deepspeed

            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield {n: p.data for n, p in module.named_parameters()}
        else:
            yield {n: p.data for n, p in module.named_parameters()}

    def sync_weights(self) -> None:
        with self.full_weights() as weights:
            if self.broadcaster is None:
                return
            with WATCHDOG.wait(f"weight sync v{self.version}", self.cfg.run.watchdog_s):
                report = self.broadcaster.sync(self.version, weights.items())
        if report.members:
            log.info(
                "weights v%d -> %d generators in %.3fs (%.1f MB, %d buckets)%s",
                self.version,
                len(report.acked),
                report.total_s,
                report.nbytes / 1e6,
                report.buckets,
                f"; evicted {report.evicted}" if report.evicted else "",
            )

    def export(self, out: Path) -> None:
        """The trained policy as an HF checkpoint (what generators or evaluation load)."""
        with self.full_weights() as weights:
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                self.engine.module.save_pretrained(out, state_dict={n: t.detach().cpu() for n, t in weights.items()})
                with contextlib.suppress(OSError, ValueError):
                    from transformers import AutoTokenizer

                    AutoTokenizer.from_pretrained(self.cfg.train.model).save_pretrained(out)
                (out / "flywheel_version").write_text(str(self.version))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> None:
        directory = self.cfg.train.checkpoint_dir
        if not directory:
            return
        state = {"version": self.version, "hub_counters": self.client.counters() if self.rank == 0 else {}}
        with WATCHDOG.wait(f"checkpoint v{self.version}", self.cfg.run.watchdog_s):
            self.engine.save_checkpoint(directory, tag=f"v{self.version}", client_state=state)
            if self.critic is not None:
                self.critic.save_checkpoint(str(Path(directory) / "critic"), tag=f"v{self.version}")
        log.info("checkpoint v%d saved in %s", self.version, directory)

    def load_checkpoint(self) -> bool:
        """Resume from the latest checkpoint, if any, and continue the version sequence."""
        directory = self.cfg.train.checkpoint_dir
        loaded = bool(directory) and (Path(str(directory)) / "latest").exists()
        if loaded:
            _, state = self.engine.load_checkpoint(directory)
            if state is None:
                raise RuntimeError(f"could not load the checkpoint in {directory}")
            self.version = int(state["version"])
            if self.critic is not None:
                self.critic.load_checkpoint(str(Path(str(directory)) / "critic"), tag=f"v{self.version}")
            log.info("resumed from %s at version %d", directory, self.version)
        published = self.client.get_version()
        if published > self.version:
            # A learner that died published versions past its last checkpoint, and generators may
            # serve those weights. A version names one set of weights, never two: these get the
            # next number, and what was generated since counts as stale under the usual bound.
            log.warning(
                "the hub is at version %d, past this checkpoint's %d: continuing as version %d",
                published,
                self.version,
                published + 1,
            )
            self.version = published + 1
        if self.rank == 0:
            self.client.set_version(self.version)
        return loaded

    # ------------------------------------------------------------------ reporting

    def _reporter(self) -> Any:
        from learner.report import Reporter

        return Reporter(self.cfg, self.rank) if self.rank == 0 else (lambda stats: None)

    def close(self) -> None:
        self.claims.close()
        if self.broadcaster is not None:
            self.broadcaster.close()


def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
