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
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flywheel.config import FlywheelConfig, check_batch_split
from flywheel.files import write_atomically
from flywheel.hub_client import Batch, BatchClient, BatchTimeout, ClaimsAhead
from flywheel.netsec import redis_client
from flywheel.staleness import StalenessPolicy
from flywheel.watchdog import WATCHDOG
from learner import algos
from learner.batching import (
    MicroBatch,
    Sequence,
    StagedMicroBatch,
    build_micro_batch,
    entropy_at,
    packed_lengths,
    pad_rows,
    plan_micro_batches,
    scatter_rows,
    sequences,
    stage,
    to_rows,
    token_logprobs,
)
from learner.logprobs import linear_logprobs_entropy
from learner.speedups import VARLEN_NAME, compile_regions

if TYPE_CHECKING:
    from learner.weight_sync import OverlappedSync, SyncReport

log = logging.getLogger(__name__)

# While waiting for a batch, how often the learner looks for generators that lack its weights.
CATCH_UP_CHECK_S = 1.0


@dataclass
class StepStats:
    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    staleness: Counter[int] = field(default_factory=Counter)
    # what this rank's means are over ("trained" tokens, "seqs") and the
    # (sum, sum of squares, count) of what gets a pooled std: to combine the ranks' figures
    counts: dict[str, float] = field(default_factory=dict)
    moments: dict[str, tuple[float, float, float]] = field(default_factory=dict)


# How a figure each rank computes on its own share of the batch combines over the ranks (only
# rank 0 reports): a mean weighted by what it averages over, a sum, a max, or the mean over ranks
# (a loss: DeepSpeed averages the ranks' gradients, so the step's loss is the ranks' mean).
RANK_WEIGHTED_MEANS = {
    "policy/entropy": "trained",
    "policy/clip_frac": "trained",
    "policy/ratio_mean": "trained",
    "policy/kl": "trained",
    "offpolicy/behav_weight_mean": "trained",
    "offpolicy/prox_minus_behav": "trained",
    "critic/value_mean": "trained",
    "critic/return_mse": "trained",
    "batch/response_len": "seqs",
    "batch/staleness_mean": "seqs",
}
RANK_SUMS = ("perf/tokens", "batch/groups", "batch/groups_filtered", "batch/aborted", "batch/dropped_stale")
RANK_MAXES = ("offpolicy/behav_weight_max", "adv/max")
RANK_MEANS = ("loss/policy", "critic/value_loss")
# (mean key, std key) of the moments in StepStats.moments
POOLED = {"reward": ("reward/mean", "reward/std"), "adv": ("adv/mean", "adv/std")}


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


def checkpoint_layout(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights under the names and shapes of the model's checkpoint, which is what vLLM loads.

    transformers keeps some models converted in memory (mixture-of-experts layers fused into one
    tensor per layer: Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...), under names vLLM does not know; it
    converts them back when it saves, and so does this. Dense models come back as they are."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without in-memory conversions
        return weights
    converted: dict[str, torch.Tensor] = revert_weight_conversion(model, weights)
    return converted


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
        self.ref = self._load_reference(conf) if cfg.algo.kl.coef > 0 else None
        # Log-probabilities and entropies from the last hidden states through the output
        # projection chunk by chunk (learner/logprobs.py): the [tokens, vocab] logits never exist
        # whole. Needs the head's weight outside its forward, hence not under ZeRO-3 (partitioned
        # parameters), and a head that is a plain bias-free linear map (checked again on the first
        # micro-batch against the model's own logits). ``compile_loss``: the chunks' element-wise
        # work as a few fused kernels (torch.compile, CUDA only). Both are attributes so the
        # benchmark can measure the plain path in the same run.
        self.fused_logprobs = cfg.ds.zero_stage < 3 and _plain_linear_head(model)
        self.compile_loss = self.on_gpu
        # id(model) -> whether its head proved plain on its first micro-batch: the policy's, and a
        # reference's (another checkpoint: its head may be soft-capped where the policy's is not)
        self._fused_head: dict[int, bool] = {}
        # torch.compile of the policy's decoder layers (learner/speedups.py), applied at the first
        # step so the benchmark can turn it off first; GPU only, not under ZeRO-3 (its parameter
        # hooks gather and release weights inside the layers).
        self.compile_regions = self.on_gpu and cfg.ds.zero_stage < 3
        self._compiled = False
        self._batches_without_signal = 0  # claimed since the last step, every group filtered out
        self.critic = self._build_critic(conf) if cfg.algo.critic.enabled else None
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        t = cfg.train
        self.packing = t.packing is True or (
            t.packing == "auto" and t.attn_implementation in ("flash_attention_2", "flex_attention")
        )
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.version = 0
        self.synced_version = 0  # the version of the last weights broadcast (the model loaded: 0)
        self.saved_version: int | None = None  # the version of the newest checkpoint on disk
        self.redis = redis_client(cfg.redis)
        policy = StalenessPolicy(cfg.async_.max_staleness, cfg.async_.groups_per_step)
        claims_log = None
        if cfg.train.run_dir:
            Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
            claims_log = str(Path(cfg.train.run_dir) / f"claims.rank{rank}.log")
        self.client = BatchClient(
            self.redis,
            cfg.run.name,
            policy,
            claims_log=claims_log,
            redis_outage_s=cfg.redis.connect_timeout_s,
            owner=str(rank),
        )
        check_batch_split(cfg.async_.groups_per_step, self.world)
        n_groups = cfg.async_.groups_per_step // self.world
        self.claims = ClaimsAhead(self.client, n_groups, cfg.train.batch_timeout_s)
        self.broadcaster = None
        if rank == 0:
            from learner.weight_sync import WeightBroadcaster

            self.broadcaster = WeightBroadcaster(cfg.sync, device=self.device, security=cfg.security)
        self.overlapped: OverlappedSync | None = None
        # At η = 0 the next batch needs this step's weights at the generators first: nothing to overlap.
        if self.broadcaster is not None and cfg.sync.overlap and cfg.async_.max_staleness > 0:
            from learner.weight_sync import OverlappedSync

            # a sync returns within its deadline; twice that is a thread that is stuck
            self.overlapped = OverlappedSync(self.broadcaster, self._log_sync, 2 * cfg.sync.timeout_s + 30)
        self.loss_cfg = algos.PolicyLossConfig.from_config(cfg)

    # ------------------------------------------------------------------ models

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        dtype = (
            torch.bfloat16
            if (self.cfg.ds.dtype == "bf16" or (self.cfg.ds.dtype == "auto" and self.on_gpu))
            else torch.float32
        )
        self.attn_impl = self._attention_implementation()
        model = AutoModelForCausalLM.from_pretrained(
            self.cfg.train.model,
            config=config_without_dropout(self.cfg.train.model),
            dtype=dtype,
            attn_implementation=self.attn_impl,
        )
        if self.cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model

    def _attention_implementation(self) -> str:
        """``train.attn_implementation``, except that ``flash_attention_2`` without the flash-attn
        package runs on PyTorch's own copy of the FlashAttention-2 varlen kernels (packed rows)."""
        from learner import speedups

        name = self.cfg.train.attn_implementation
        if name != "flash_attention_2" or not self.on_gpu or speedups.flash_attn_installed():
            return name
        if not speedups.varlen_available():
            return name  # transformers says what is missing
        if self.cfg.train.packing is False:
            raise ValueError(
                "train.attn_implementation flash_attention_2 without the flash-attn package runs PyTorch's "
                "varlen kernels, which take packed micro-batches: set train.packing auto or true, or install flash-attn"
            )
        log.warning("flash-attn is not installed: flash_attention_2 runs on PyTorch's FlashAttention-2 varlen kernels")
        return speedups.register_varlen()

    def _build_critic(self, conf: dict[str, Any]) -> Any:
        """A value model: the policy's backbone with a scalar head, in its own DeepSpeed engine."""
        import deepspeed
        from transformers import AutoModelForTokenClassification

        c = self.cfg.algo.critic
        model = AutoModelForTokenClassification.from_pretrained(
            c.model or self.cfg.train.model,
            config=config_without_dropout(c.model or self.cfg.train.model, num_labels=1),
            dtype=self.engine.module.dtype,
            attn_implementation=self.attn_impl,
        )
        model.config.use_cache = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=self.cfg.train.weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf)
        return engine

    def _load_reference(self, conf: dict[str, Any]) -> Any:
        """The frozen KL reference. Under ZeRO-3 it loads as shards (the HfDeepSpeedConfig alive
        makes from_pretrained partition every model), so it runs in a DeepSpeed engine of its own,
        as the critic does, whose hooks gather each layer for its forward: a bare module's
        partitioned weights are empty tensors. Otherwise a plain module on the device."""
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(
            self.cfg.algo.kl.reference or self.cfg.train.model, dtype=self.engine.module.dtype
        )
        ref.requires_grad_(False)
        ref.eval()
        if self.cfg.ds.zero_stage < 3:
            return ref.to(self.device)
        import deepspeed

        # no optimizer: DeepSpeed only shards and gathers it (forward only, in eval mode)
        engine, _, _, _ = deepspeed.initialize(model=ref, config={**conf, "gradient_clipping": 0.0})
        engine.eval()
        return engine

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        total = self.cfg.train.total_steps
        if self.version > 0:
            self.sync_weights()  # a resumed learner: bring the generators to its version first
        reporter = self._reporter()
        try:
            self._loop(total, reporter)
            # the checkpoint and the export before the reporter's close: wandb's finish may wait
            # long on a network in trouble, and the weights must not wait behind it
            if self.cfg.train.checkpoint_dir and self.saved_version != self.version:
                # (never the same tag again: DeepSpeed would rewrite in place the files `latest` names,
                # and a kill during that rewrite would leave no checkpoint to resume from)
                self.save_checkpoint()
            if self.cfg.train.export_dir:
                self.export(Path(self.cfg.train.export_dir))
        finally:
            if hasattr(reporter, "close"):
                reporter.close()  # wandb's files and the metrics file are complete even after an error

    def _loop(self, total: int, reporter: Any) -> None:
        while self.version < (total := self._last_step(total)):
            t0 = time.perf_counter()
            batch = self.claim()
            # Every rank holds its batch before any claims ahead: a claim for the next version
            # drops (and has the hub revoke) what is too stale for it, which a rank still waiting
            # may need at this one. The ranks stop together when one is out of data.
            if self._agree_max(int(batch is None)):
                self._end_out_of_data(batch)
                break
            assert batch is not None
            waited = time.perf_counter() - t0
            if self.version + 1 < total:
                self.claims.claim_ahead(self.version + 1)  # loads while this step trains
            stats = self.train_step(batch)
            if stats is None:  # every group was filtered out: no signal, no step
                self.client.note_finished([g.group_id for g in batch.groups], trained=False)
                self._note_batch_without_signal(batch)
                self._sync_past_the_floor_claimed_ahead()
                continue
            self.version += 1
            stats.version = self.version
            if self.rank == 0:
                self.client.set_version(self.version)
            # The version is out before any rank counts its groups trained: a learner lost in
            # between restarts behind the published version and releases them as untrained; the
            # other order would count a step that no checkpoint holds, and admission would stay
            # that many groups short for the rest of the run.
            self._agree_max(0)
            self.client.note_finished([g.group_id for g in batch.groups], trained=True)
            if self.version % self.cfg.async_.sync_every == 0 or self.version == total:
                self.sync_weights(wait=self.version == total)  # the last one is waited for
            if self.cfg.train.checkpoint_every and self.version % self.cfg.train.checkpoint_every == 0:
                self.save_checkpoint()
            step_s = time.perf_counter() - t0
            stats.metrics.update(
                {
                    "batch/skipped_without_signal": float(self._batches_without_signal),
                    "perf/step_s": step_s,
                    "perf/idle_frac": waited / step_s,
                    "perf/tokens_per_s": stats.metrics["perf/tokens"] / max(step_s - waited, 1e-9),
                    "watchdog/overdue": float(sum(WATCHDOG.overdue.values())),
                }
            )
            self._batches_without_signal = 0
            reporter(stats)

    def _align_lr_schedule(self) -> None:
        """The LR schedule at this version. It counts the steps the weights took, which a resume
        past the published version leaves behind it; train.total_steps counts versions, so a
        linear or cosine decay would end short of its floor."""
        sched = self.engine.lr_scheduler
        if sched is None or sched.last_epoch == self.version:
            return
        lrs = [base * f(self.version) for base, f in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(sched.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched.last_epoch = self.version
        sched._last_lr = lrs

    def _end_out_of_data(self, batch: Batch | None) -> None:
        if batch is not None:  # another rank found none: this share is not trained on
            self.client.note_finished([g.group_id for g in batch.groups], trained=False)
        if self.rank == 0:
            counters = self.client.counters()
            lost = {
                "failed rewards": counters.get("groups_dropped_reward", 0),
                "too stale": counters.get("groups_dropped", 0) - counters.get("groups_dropped_reward", 0),
                "prompts abandoned": counters.get("prompts_abandoned", 0),
            }
            why = ", ".join(f"{n} {what}" for what, n in lost.items() if n > 0)
            log.warning(
                "the prompts are spent (data.epochs %d) before train.total_steps %d: training ends at v%d "
                "(raise data.epochs to train longer)%s",
                self.cfg.data.epochs,
                self.cfg.train.total_steps,
                self.version,
                f"; groups dropped on the way: {why} (the hub's log says why)" if why else "",
            )

    def _note_batch_without_signal(self, batch: Batch) -> None:
        """Say so, or a run whose groups are all solved (or all failed) goes silent: no step, no
        metrics row. The count rides on the next step's metrics."""
        self._batches_without_signal += 1
        rewards = [s.reward for g in batch.groups for s in g.samples]
        log.info(
            "the batch claimed at v%d has no signal (every group's samples share one reward; mean reward "
            "%.3f over %d groups on this rank): no step; %d such batches since the last step",
            self.version,
            float(np.mean(rewards)) if rewards else float("nan"),
            len(batch.groups),
            self._batches_without_signal,
        )

    def _last_step(self, total: int) -> int:
        """``total``, or sooner when ``flywheel finish`` asked (read before every step). A request
        lands far enough ahead for every rank to read it at the same step
        (``flywheel.store.FINISH_SCRIPT``), but a ``--cancel`` is a plain delete: landing between
        two ranks' reads, it would end one rank's training while the other trained on, each in
        a different collective. So the ranks take the earliest step any of them read."""
        finish = self.client.finish_step()
        finish = -self._agree_max(-(total if finish is None else finish))
        if finish >= total:
            return total
        log.info(
            "a finish was requested: training ends at step %d instead of %d (`flywheel finish --cancel` forgets it)",
            finish,
            total,
        )
        return finish

    def claim(self) -> Batch | None:
        """This step's batch, or None once the hub says no more will come (its prompts spent).
        While it waits, generators that joined behind the last sync (or hold no usable weights)
        get the current ones: at η = 0 nobody else could make the batch."""
        timeout_s = self.cfg.train.batch_timeout_s
        deadline = time.monotonic() + timeout_s
        # Only rank 0 broadcasts, so only where it holds the whole model (not ZeRO-3 across ranks,
        # whose gather is a collective the other ranks would have to join).
        catch_up = self.broadcaster is not None and (self.world == 1 or self.cfg.ds.zero_stage < 3)
        with WATCHDOG.wait(f"claim of the batch for v{self.version}", self.cfg.run.watchdog_s):
            while True:
                left = max(deadline - time.monotonic(), 0.0)
                try:
                    return self.claims.claim(self.version, min(CATCH_UP_CHECK_S, left))
                except BatchTimeout as err:
                    if self.client.data_done():
                        return self.claims.take_landed(self.version)  # the last one claimed, if any
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"learner v{self.version}: no batch within {timeout_s:g}s: {err}") from err
                if catch_up:
                    self._catch_up_generators()

    def _sync_past_the_floor_claimed_ahead(self) -> None:
        """After a step that did not happen. The claim made ahead for v+1 raised the hub's floor
        to v+1-η: it leases only to generators with weights that new, and drops ready groups
        older. With async.sync_every = η+1 the fleet may still hold v-η, the weights of the last
        sync; the sync that the step to v+1 would have made does not come, nor does any group
        for the claim at v: the learner would wait out train.batch_timeout_s and fail. So this
        version's weights go out now (every rank is here: the ranks agree there was no step)."""
        ahead = self.claims.ahead_version()
        if ahead is not None and self.synced_version < ahead - self.cfg.async_.max_staleness:
            log.info(
                "no step at v%d, and the claim made ahead for v%d needs weights newer than the fleet's v%d: "
                "sending v%d's now",
                self.version,
                ahead,
                self.synced_version,
                self.version,
            )
            self.sync_weights()

    def _catch_up_generators(self) -> None:
        """Send the current weights to generators that lack them (see ``claim``)."""
        assert self.broadcaster is not None
        if self.overlapped is not None:
            self.overlapped.wait()  # the broadcaster belongs to the sync thread while one is in flight
        behind = self.broadcaster.behind(self.synced_version)
        if behind:
            log.info("generators %s lack the weights of v%d: sending them now", behind, self.version)
            self.sync_weights()

    # ------------------------------------------------------------------ one optimizer step

    def loss_on(self, batch: Batch) -> float:
        """The policy loss this learner would optimise on ``batch`` now, without a step."""
        stats = self.train_step(batch, apply=False)
        assert stats is not None, "every group of the batch was filtered out"
        return stats.metrics["loss/policy"]

    def train_step(self, batch: Batch, apply: bool = True) -> StepStats | None:
        if self.compile_regions and not self._compiled:
            # whole layers when the attention is a graph break (the varlen kernels); flex
            # attention's block mask does not trace well, so there only the norms and MLPs
            n = compile_regions(self.engine.module, whole_layers=self.attn_impl == VARLEN_NAME)
            log.info("compiled %d regions of the policy", n)
        self._compiled = True
        seqs, rewards_GN = sequences(batch)
        claimed_rewards = rewards_GN  # the batch's, before dynamic filtering takes its solved groups out
        stats = StepStats(self.version)
        stats.staleness.update(g.staleness for g in batch.groups)
        has_signal = True
        if self.cfg.algo.dynamic_filtering:
            valid_GN = torch.tensor([[s.finish_reason != "abort" for s in g.samples] for g in batch.groups])
            keep = ~algos.uniform_groups(rewards_GN, valid_GN)
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
        width = resp_mask.shape[1]
        aborted = torch.tensor([s.aborted for s in seqs], dtype=torch.bool)
        trained = self._trained_tokens(seqs, resp_mask, aborted)
        staged = [stage(mb, self.device, trained[mb.seq_index]) for mb in mbs]
        # the proximal log-probabilities need a forward of their own only when the advantage needs
        # them (KL in the reward); for the loss, each micro-batch's own forward gives them (below)
        prox = self._logprobs_no_grad(self.engine, seqs, mbs, staged, width) if self._prox_before_step() else None
        ref = self._logprobs_no_grad(self.ref, seqs, mbs, staged, width) if self.ref is not None else None
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
            reduce=self._sum_over_ranks(has_signal) if (self.world > 1 and apply) else None,
            # its end is the engine's, not the policy's: out of its group's baseline, no gradient
            valid_B=~aborted,
        )
        stats.metrics["batch/aborted"] = float(aborted.sum())
        norms = self._step_norms(trained, has_signal, apply)
        self._optimize(seqs, mbs, staged, weights, adv, prox, ref, resp_mask, norms, stats, apply)
        if self.critic is not None:
            assert old_values is not None and returns is not None
            self._fit_critic(mbs, weights, old_values, returns, trained, norms[0], stats, apply)
        stats.metrics.update(
            {
                "reward/mean": float(claimed_rewards.mean()),
                "reward/std": float(claimed_rewards.std()) if claimed_rewards.numel() > 1 else 0.0,
                "adv/mean": float(algos.masked_mean(adv, resp_mask)),
                "adv/std": float(adv[resp_mask > 0].std()) if resp_mask.sum() > 1 else 0.0,
                "adv/max": float(adv[resp_mask > 0].max()) if resp_mask.sum() else 0.0,
                "batch/groups": float(len(rewards_GN)) if has_signal else 0.0,
                "batch/response_len": float(resp_mask.sum(1).mean()),
                "batch/staleness_mean": float(np.mean([s.staleness for s in seqs])),
                "batch/dropped_stale": float(batch.dropped),
                # (not the zero-weight repeats that pair a rank's collectives with the busiest one's)
                "perf/tokens": float(sum(mb.tokens for mb, w in zip(mbs, weights, strict=True) if w > 0)),
                "lr": float(self.engine.get_lr()[0]),
            }
        )
        stats.counts["seqs"] = float(len(seqs)) if has_signal else 0.0
        stats.moments["reward"] = moments(claimed_rewards)
        stats.moments["adv"] = moments(adv[resp_mask > 0]) if has_signal else (0.0, 0.0, 0.0)
        if self.world > 1 and apply:
            self._whole_step_figures(stats)
        return stats

    def _whole_step_figures(self, stats: StepStats) -> None:
        """Every figure of the step over all ranks (``RANK_*``, ``POOLED``, the staleness
        histogram): each rank trains its share of the batch, and only rank 0 reports. The vector's
        layout is fixed, so ranks whose metrics differ (a rank with nothing to learn) still line up."""
        import torch.distributed as dist

        m, eta = stats.metrics, self.cfg.async_.max_staleness
        weights = ("trained", "seqs")
        summed = [stats.counts.get(w, 0.0) for w in weights]
        summed += [m.get(k, 0.0) * stats.counts.get(w, 0.0) for k, w in RANK_WEIGHTED_MEANS.items()]
        summed += [m.get(k, 0.0) for k in (*RANK_SUMS, *RANK_MEANS)]
        summed += [x for key in POOLED for x in stats.moments.get(key, (0.0, 0.0, 0.0))]
        summed += [float(stats.staleness.get(k, 0)) for k in range(eta + 1)]
        # a rank with nothing to learn trained zero-weight stand-ins: its maxima are not the step's
        trained = stats.counts.get("trained", 0.0) > 0
        maxed = [m.get(k, float("-inf")) if trained else float("-inf") for k in RANK_MAXES]
        t = torch.tensor(summed, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        top = torch.tensor(maxed, dtype=torch.float64, device=self.device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        values = iter(t.tolist())
        total = {w: next(values) for w in weights}
        for k, w in RANK_WEIGHTED_MEANS.items():
            v = next(values)
            if k in m:
                m[k] = v / max(total[w], 1.0)
        for k in RANK_SUMS:
            v = next(values)
            if k in m:
                m[k] = v
        for k in RANK_MEANS:
            v = next(values)
            if k in m:
                m[k] = v / self.world
        for mean_key, std_key in POOLED.values():
            mean, std = pooled_mean_std(next(values), next(values), next(values))
            if mean_key in m:
                m[mean_key], m[std_key] = mean, std
        stale = [next(values) for _ in range(eta + 1)]
        stats.staleness.clear()
        stats.staleness.update({k: int(n) for k, n in enumerate(stale) if n})
        for k, v in zip(RANK_MAXES, top.tolist(), strict=True):
            if k in m:
                m[k] = v

    @staticmethod
    def _trained_tokens(seqs: list[Sequence], resp_mask: torch.Tensor, aborted: torch.Tensor) -> torch.Tensor:
        """[sequences, width]: 1 on the response tokens that train. Not those of a sample the engine
        cut off (its end is not the policy's), nor a token the sampler gave no probability (no
        ratio to take): neither gets any gradient (policy loss, KL, entropy bonus, value loss) nor
        counts in the step's normalisers, where it would only shrink the others' gradients."""
        behav = pad_rows([s.behav_logprobs for s in seqs], resp_mask.shape[1])
        return resp_mask * (~aborted)[:, None] * (behav > algos.INVALID_LOGPROB)

    def _step_norms(self, trained: torch.Tensor, has_signal: bool, apply: bool) -> tuple[float, float]:
        """The step's (trained tokens, sequences with any) that a rank's losses divide by.

        DeepSpeed averages the ranks' gradients, so each rank must divide by the step's totals over
        every rank, over the world size: dividing by its own counts would weigh a token on a rank
        with few tokens more than one on a rank with many, and count a rank with nothing to learn
        (every group filtered out) in the average. At world 1 they are this rank's counts."""
        tokens = float(trained.sum()) if has_signal else 0.0
        seqs = float((trained.sum(1) > 0).sum()) if has_signal else 0.0
        if self.world > 1 and apply:
            import torch.distributed as dist

            t = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            tokens, seqs = (float(x) / self.world for x in t.tolist())
        return max(tokens, 1.0), max(seqs, 1.0)

    def _sum_over_ranks(self, has_signal: bool) -> algos.SumReduce:
        """Sums over the data-parallel ranks, of what this rank holds (nothing, when it trains only
        zero-weight stand-ins because every group of its share was filtered out)."""
        import torch.distributed as dist

        def reduce(t: torch.Tensor) -> torch.Tensor:
            mine = (t if has_signal else torch.zeros_like(t)).to(self.device)
            dist.all_reduce(mine, op=dist.ReduceOp.SUM)
            return mine.cpu()

        return reduce

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
        trained: torch.Tensor,
        step_tokens: float,
        stats: StepStats,
        apply: bool,
    ) -> None:
        assert self.critic is not None
        clip = self.cfg.algo.critic.value_clip
        total, err = 0.0, 0.0
        for k, (mb, weight) in enumerate(zip(mbs, weights, strict=True)):
            with torch.enable_grad() if apply else torch.no_grad():
                values, mask = to_rows(self._forward(self.critic, mb)[..., 0].float(), mb)
                w = mask.shape[1]
                mask = (mask * trained[mb.seq_index, :w]).to(values.device)
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
        stats.metrics["critic/value_mean"] = float(algos.masked_mean(old_values, trained))
        stats.metrics["critic/return_mse"] = err / max(float(trained.sum()), 1.0)

    def _prox_before_step(self) -> bool:
        """Whether the proximal log-probabilities are computed by a separate forward before the step.

        A step is one optimizer update (its micro-batches accumulate), so the proximal policy (the
        weights at the start of the step) is the very policy each micro-batch's forward runs: the
        loss takes its log-probabilities, detached, as the proximal ones. That saves a forward per
        step (a quarter of the learner's compute). Only KL in the reward needs them earlier, for
        the advantages."""
        return self.ref is not None and self.cfg.algo.kl.in_reward

    def _forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        packed = packed_lengths(mb)
        cu_seqlens, longest = (packed[0].to(self.device), packed[1]) if packed is not None else (None, None)
        out = model(
            input_ids=mb.input_ids.to(self.device),
            position_ids=mb.position_ids.to(self.device),
            attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(self.device),
            use_cache=False,
            **self._varlen_kwargs(model, cu_seqlens, longest),
        )
        return out.logits

    def _varlen_kwargs(self, model: Any, cu_seqlens: torch.Tensor | None, longest: int | None) -> dict[str, Any]:
        """Sequence boundaries of a packed row for flash-attention-style kernels (transformers'
        FlashAttentionKwargs): they need not find them from position ids, which costs a host sync."""
        impl = getattr(getattr(_unwrap(model), "config", None), "_attn_implementation", None)
        if cu_seqlens is None or not longest or impl not in ("flash_attention_2", "flash_attention_3", VARLEN_NAME):
            return {}
        return {
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    @torch.no_grad()
    def _logprobs_no_grad(
        self, model: Any, seqs: list[Sequence], mbs: list[MicroBatch], staged: list[StagedMicroBatch], width: int
    ) -> torch.Tensor:
        out = torch.zeros((len(seqs), width), dtype=torch.float32)
        for mb, smb in zip(mbs, staged, strict=True):
            lp, _ = self._token_stats(model, mb, smb, entropy_grad=False)
            out[mb.seq_index, : smb.width] = scatter_rows(lp, smb).cpu()
        return out

    def _token_stats(
        self, model: Any, mb: MicroBatch, smb: StagedMicroBatch, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of every response token of the micro-batch under the sampling temperature, and
        the entropy of the next-token distribution there (also under the temperature): flat [N] on
        the device."""
        inputs = {"input_ids": smb.input_ids, "position_ids": smb.position_ids, "attention_mask": smb.attention_mask}
        inputs.update(self._varlen_kwargs(model, smb.cu_seqlens, smb.max_seqlen))
        key = id(model)
        if self.fused_logprobs and key not in self._fused_head and not _plain_linear_head(_unwrap(model)):
            self._fused_head[key] = False  # a reference whose head is not a plain linear map
        if self.fused_logprobs and self._fused_head.get(key, True):
            # The backbone's last hidden states (the final norm applied: transformers ties
            # hidden_states[-1] to last_hidden_state); the head computes logits for one position
            # only. Going through the engine's forward keeps DeepSpeed's backward hooks.
            out = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1]
            weight = _unwrap(model).get_output_embeddings().weight
            if key not in self._fused_head:
                self._fused_head[key] = _head_is_plain(hidden, weight, out.logits)
                if model is self.engine and not self._fused_head[key]:
                    self.fused_logprobs = False  # the policy's: the plain path for every model
            if self._fused_head[key]:
                lp, ent = linear_logprobs_entropy(
                    hidden[smb.rows_N, smb.cols_N], weight, smb.targets_N, self.temperature, compiled=self.compile_loss
                )
                return lp, ent if entropy_grad else ent.detach()
        # the plain path: the model's [b, L, vocab] logits, log-softmax in fp32 over every position
        logits = model(**inputs, use_cache=False).logits
        lp = token_logprobs(logits, smb.targets, self.temperature)[smb.rows_N, smb.cols_N]
        ent = entropy_at(logits, mb, grad=entropy_grad, temperature=self.temperature)[smb.rows_N, smb.cols_N]
        return lp, ent

    def _optimize(
        self,
        seqs: list[Sequence],
        mbs: list[MicroBatch],
        staged: list[StagedMicroBatch],
        weights: list[float],
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
        resp_mask: torch.Tensor,
        norms: tuple[float, float],
        stats: StepStats,
        apply: bool = True,
    ) -> None:
        algo = self.cfg.algo
        step_tokens, step_seqs = norms
        # every micro-batch's per-token inputs on the device before the first forward
        inputs = [self._loss_inputs(seqs, mb, smb, adv, prox, ref) for mb, smb in zip(mbs, staged, strict=True)]
        # metric sums stay on the device and are read once after the loop: a float() per
        # micro-batch would make the host wait for each backward before queueing the next forward
        sums: dict[str, torch.Tensor] = {}
        tokens = 0.0
        self.engine.train()
        for k, (mb, smb, weight, inp) in enumerate(zip(mbs, staged, weights, inputs, strict=True)):
            with torch.enable_grad() if apply else torch.no_grad():
                loss, m = self._micro_loss(mb, smb, inp, step_tokens, step_seqs)
            n = float(smb.mask_cpu.sum())
            if weight == 0.0:
                loss, n = loss * 0.0, 0.0  # padding: same collectives, no gradient, not counted
            if apply:
                self.engine.set_gradient_accumulation_boundary(k == len(mbs) - 1)
                self.engine.backward(loss)
                self.engine.step()
            tokens += n
            terms = {"loss": loss.detach()}
            means = ("entropy", "kl", "clip_frac", "ratio_mean", "behav_weight_mean", "prox_minus_behav")
            terms.update({key: m[key] * n for key in means if key in m})
            for key, v in terms.items():
                sums[key] = sums[key] + v if key in sums else v
            top = m["behav_weight_max"]
            sums["behav_weight_max"] = torch.maximum(sums["behav_weight_max"], top) if k else top
        keys = list(sums)
        values = torch.stack([sums[key].float() for key in keys]).tolist() if keys else []
        totals: defaultdict[str, float] = defaultdict(float, zip(keys, values, strict=True))
        totals["tokens"] = tokens
        self._record(totals, stats, len(mbs), ref is not None and not algo.kl.in_reward)

    def _loss_inputs(
        self,
        seqs: list[Sequence],
        mb: MicroBatch,
        smb: StagedMicroBatch,
        adv: torch.Tensor,
        prox: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> dict[str, torch.Tensor | None]:
        """A micro-batch's rows of the step's per-token tensors, [sequences, width], on the device."""
        idx, w = mb.seq_index, smb.width

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(self.device, non_blocking=True) if self.on_gpu else t

        return {
            "behav": dev(pad_rows([seqs[i].behav_logprobs for i in idx], w)),
            "adv": dev(adv[idx, :w]),
            "prox": None if prox is None else dev(prox[idx, :w]),
            "ref": None if ref is None else dev(ref[idx, :w]),
        }

    def _micro_loss(
        self,
        mb: MicroBatch,
        smb: StagedMicroBatch,
        inp: dict[str, torch.Tensor | None],
        step_tokens: float,
        step_seqs: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's share of the step loss and its metrics (0-d tensors on the device: the
        policy loss's, the mean entropy and the mean KL)."""
        algo = self.cfg.algo
        lp_N, ent_N = self._token_stats(self.engine, mb, smb, entropy_grad=algo.entropy_coef > 0)
        lp, ent_rows, mask = scatter_rows(lp_N, smb), scatter_rows(ent_N, smb), smb.mask
        behav, a, ref = inp["behav"], inp["adv"], inp["ref"]
        assert behav is not None and a is not None
        prox = inp["prox"]
        if prox is None and algo.off_policy.correction == "decoupled":
            prox = lp.detach()  # one update per step: this forward's weights are the proximal policy
        loss, m = algos.policy_loss_terms(lp, prox, behav, a, mask, self.loss_cfg)
        if prox is not None:
            m["prox_minus_behav"] = algos.masked_mean(prox - behav, mask)
        m["kl"] = mask.new_zeros(())
        if ref is not None and not algo.kl.in_reward:
            kl = algos.kl_estimate(lp, ref, algo.kl.estimator)
            loss = loss + algo.kl.coef * algos.aggregate(kl, mask, self.loss_cfg.aggregation)
            m["kl"] = algos.masked_mean(kl.detach(), mask)
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * algos.aggregate(ent_rows, mask, self.loss_cfg.aggregation)
        m["entropy"] = algos.masked_mean(ent_rows.detach(), mask)
        loss = loss * self._share(mb, smb.mask_cpu, step_tokens, step_seqs)
        return loss, m

    def _record(self, sums: defaultdict[str, float], stats: StepStats, micro_batches: int, with_kl: bool) -> None:
        stats.counts["trained"] = sums["tokens"]
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
        if "prox_minus_behav" in sums:
            stats.metrics["offpolicy/prox_minus_behav"] = sums["prox_minus_behav"] / n

    def _share(self, mb: MicroBatch, mask: torch.Tensor, step_tokens: float, step_seqs: float) -> float:
        """Scale a micro-batch's loss so the step's loss is the aggregation over the whole batch
        (``_step_norms``). Dr. GRPO's token sum divides by a constant, the generation budget
        (``rollout.max_tokens``), not the batch's longest response: that would weigh a token of a
        batch of short answers more than one of a batch of long ones."""
        mode = self.loss_cfg.aggregation
        if mode == "token_mean":
            return float(mask.sum()) / step_tokens
        if mode == "seq_mean_token_mean":
            return len(mb.seq_index) / step_seqs
        budget = max(self.cfg.rollout.max_tokens, mask.shape[1])
        return (mask.shape[0] * mask.shape[1]) / (step_seqs * budget)

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

    def sync_weights(self, wait: bool = True) -> None:
        """Broadcast this version's weights. With ``sync.overlap`` and ``wait=False`` it returns once
        a copy is handed to the sync thread; the next sync (or ``wait=True``) waits for it first."""
        with self.full_weights() as in_memory:
            # on every rank, not rank 0 only: the ranks decide together whether to sync
            # (``_sync_past_the_floor_claimed_ahead``), and under ZeRO-3 the gather above is a collective
            self.synced_version = self.version
            if self.broadcaster is None:
                return
            weights = checkpoint_layout(self.engine.module, in_memory)
            if self.overlapped is not None:
                if not wait:
                    self.overlapped.start(self.version, weights)
                    return
                self.overlapped.wait()
            with WATCHDOG.wait(f"weight sync v{self.version}", self.cfg.run.watchdog_s):
                report = self.broadcaster.sync(self.version, weights.items())
        self._log_sync(report)

    def _log_sync(self, report: SyncReport) -> None:
        if report.members:
            log.info(
                "weights v%d -> %d generators in %.3fs (%.1f MB, %d buckets)%s",
                report.version,
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
            # The critic first: the policy's `latest`, written last, is what a resume reads, so it
            # never names a version whose critic a kill left unwritten.
            if self.critic is not None:
                self.critic.save_checkpoint(str(Path(directory) / "critic"), tag=f"v{self.version}")
            # `latest` only once every rank's shards are written: DeepSpeed has rank 0 write it
            # before the ranks meet, so a rank lost in between would leave it naming a save that
            # cannot load, on every restart.
            self.engine.save_checkpoint(directory, tag=f"v{self.version}", client_state=state, save_latest=False)
            self._agree_max(0)
            if self.rank == 0:
                write_atomically(Path(directory) / "latest", f"v{self.version}", durable=True)
                prune_checkpoints(Path(directory), self.version, self.cfg.train.keep_checkpoints)
        self.saved_version = self.version
        log.info("checkpoint v%d saved in %s", self.version, directory)

    def load_checkpoint(self) -> bool:
        """Resume from the latest checkpoint, if any (``take_over_run`` then continues the
        version sequence)."""
        directory = self.cfg.train.checkpoint_dir
        loaded = bool(directory) and (Path(str(directory)) / "latest").exists()
        if loaded:
            _, state = self.engine.load_checkpoint(directory)
            if state is None:
                raise RuntimeError(f"could not load the checkpoint in {directory}")
            self.version = self.saved_version = int(state["version"])
            if self.critic is not None:
                self.critic.load_checkpoint(str(Path(str(directory)) / "critic"), tag=f"v{self.version}")
            log.info("resumed from %s at version %d", directory, self.version)
        return loaded

    def take_over_run(self) -> None:
        """At every start, resumed or not, before the first claim: take the run's version
        sequence and its claims over from whatever learner came before.

        A fresh learner too: one that died in its first step published no version, yet its
        claims hold admission's window until they are released."""
        # Every rank reads the published version before rank 0 publishes its own (the agreement is
        # a collective): a rank reading after would continue one version further than the others.
        published = self._agree_max(self.client.get_version())
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
            self._align_lr_schedule()
        self.client.release_claimed()  # this rank's own claims, before it makes any
        if self.rank == 0:
            self.client.release_claimed_of_ranks_gone(self.world)
            # The version goes out last: the hub admits on (version - versions_without_batch), and
            # a new version seen beside the old count let it admit a batch past the bound. The
            # other way round it admits less for a moment, never more.
            lost = self.client.release_untrained()
            if lost:
                log.warning("%d groups claimed before this start were never trained on: released to admission", lost)
            skipped = self.client.count_versions_without_batch(self.version)
            if skipped:
                log.info(
                    "%d versions up to v%d trained no batch: the hub's admission counts them out", skipped, self.version
                )
            self.client.set_version(self.version)
        # No rank claims before that release: it counts every claim not yet finished as lost.
        self._agree_max(0)

    # ------------------------------------------------------------------ reporting

    def _reporter(self) -> Any:
        from learner.report import Reporter

        return Reporter(self.cfg, self.rank) if self.rank == 0 else (lambda stats: None)

    def close(self) -> None:
        self.claims.close()
        if self.overlapped is not None:
            with contextlib.suppress(Exception):  # closing after an error: that error is the one to report
                self.overlapped.wait()
        if self.broadcaster is not None:
            self.broadcaster.close()


def config_without_dropout(path: str | None, **overrides: Any) -> Any:
    """The model's config with every dropout probability at 0. The generator samples without
    dropout; a learner forward with it would take each log-probability under a random sub-network,
    and the importance ratios against the behaviour log-probabilities would be noise (OpenRLHF
    and TRL turn it off too). Set in the config, before the model is built: modules copy it then."""
    from transformers import AutoConfig

    if path is None:
        raise ValueError("train.model is required: pass --train.model PATH (an HF causal-LM directory or name)")
    config = AutoConfig.from_pretrained(path, **overrides)
    zeroed = _zero_dropout(config)
    if zeroed:
        log.info("dropout off for training (%s): the generator samples without it", ", ".join(zeroed))
    return config


def _zero_dropout(config: Any, prefix: str = "") -> list[str]:
    from transformers import PretrainedConfig

    zeroed = []
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):  # a multimodal model's text config, say
            zeroed += _zero_dropout(value, f"{prefix}{key}.")
        elif isinstance(value, float) and value > 0 and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
            zeroed.append(f"{prefix}{key}={value:g}")
    return zeroed


def moments(x: torch.Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, count) of ``x``: what ``pooled_mean_std`` combines over ranks."""
    x = x.detach().double().flatten()
    return float(x.sum()), float((x * x).sum()), float(x.numel())


def pooled_mean_std(total: float, squares: float, n: float) -> tuple[float, float]:
    """The mean and the (unbiased, as ``torch.std``) standard deviation of values whose sum, sum of
    squares and count these are; (0, 0) when there are none, std 0 for a single value."""
    if n < 1:
        return 0.0, 0.0
    mean = total / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1))


def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _unwrap(model: Any) -> Any:
    """The transformers model inside a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def _head_is_plain(hidden: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether a model's own logits at the last position are hidden @ weight.T; if not, the fused
    path would compute something else (a scaled or soft-capped head): the plain path it is."""
    with torch.no_grad():
        mine = (hidden[:, -1] @ weight.T).float()
        theirs = logits[:, -1].float()
        ok = bool(torch.allclose(mine, theirs, rtol=2e-2, atol=2e-2 * float(theirs.abs().max().clamp(min=1.0))))
    if not ok:
        log.warning("a model's logits are not its last hidden states @ the head weight: plain log-probabilities for it")
    return ok


def _plain_linear_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are plainly last hidden states @ head weight (no bias, no scale,
    no soft-cap), which the fused log-probabilities assume."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    config = getattr(model, "config", None)
    return not any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def prune_checkpoints(directory: Path, latest: int, keep: int) -> list[int]:
    """Delete the checkpoints (``v{N}``, the critic's too) but the ``keep`` newest up to
    ``latest``. A save a kill left half-written goes in its turn, as it falls out of the newest
    (it is never ``latest``, and a resumed learner never saves its version again). Returns the
    versions deleted."""
    if keep <= 0:
        return []
    versions = sorted(int(p.name[1:]) for p in directory.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    kept = [v for v in versions if v <= latest][-keep:]
    gone = [v for v in versions if v not in kept]
    for v in gone:
        for where in (directory, directory / "critic"):
            shutil.rmtree(where / f"v{v}", ignore_errors=True)
    if gone:
        log.info("deleted checkpoints %s (train.keep_checkpoints %d)", ", ".join(f"v{v}" for v in gone), keep)
    return gone
