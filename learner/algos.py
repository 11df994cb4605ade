"""Advantage estimators and losses of the learner: pure functions over tensors.

Shape suffixes: ``_GN`` groups x samples per group (outcome rewards), ``_BT`` sequences x response
tokens (padded; ``mask_BT`` is 1 on real tokens), ``_B`` one value per sequence.

Policies in the losses: ``logprobs`` are the current policy's (with gradient), ``behav_logprobs``
the generator's that sampled the tokens (the behaviour policy, possibly several versions old),
``prox_logprobs`` the proximal policy's: the learner's weights at the start of this step, without
gradient (decoupled PPO, AReaL; with one update per step the trainer takes them from the step's
own forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig

Estimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
Correction = Literal["decoupled", "tis", "none"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ESTIMATORS: tuple[str, ...] = Estimator.__args__  # type: ignore[attr-defined]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
SumReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the data-parallel ranks


# --------------------------------------------------------------------------- rewards and advantages


def token_rewards(
    rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Outcome reward on each sequence's last real token, minus ``kl_coef * kl`` on every token
    (KL in the reward, as PPO/REINFORCE++ do)."""
    out = torch.zeros_like(mask_BT, dtype=torch.float32)
    if mask_BT.shape[1] == 0:  # every response empty (a prompt that filled the context): no token to reward
        return out
    last = mask_BT.long().cumsum(1).argmax(1)  # index of the last real token
    out[torch.arange(len(rewards_B)), last] = rewards_B.float()
    if kl_BT is not None and kl_coef:
        out = out - kl_coef * kl_BT.float() * mask_BT
    return out


def group_advantages(
    rewards_GN: torch.Tensor, estimator: str, eps: float = 1e-6, valid_GN: torch.Tensor | None = None
) -> torch.Tensor:
    """Outcome advantages from each group's rewards (one value per sample).

    ``valid_GN`` (False: a sample the engine aborted, whose reward scores a partial answer)
    leaves samples out of their group's statistics, and gives them 0; a group with fewer than two
    valid samples gets 0 throughout."""
    r = rewards_GN.float()
    if r.shape[1] < 2:  # the std of one sample is NaN, and every baseline is the sample itself
        raise ValueError(
            f"{estimator} compares the samples of a group, and these groups hold {r.shape[1]}: "
            "set data.n_samples_per_prompt to 2 or more (the hub's and the learner's)"
        )
    if estimator not in ("grpo", "dr_grpo", "reinforce_pp_baseline", "rloo"):
        raise ValueError(f"{estimator!r} is not a group estimator; choose one of {GROUP_ESTIMATORS}")
    v = torch.ones_like(r) if valid_GN is None else valid_GN.float()
    n = v.sum(1, keepdim=True)
    mean = (r * v).sum(1, keepdim=True) / n.clamp(min=1)
    if estimator == "grpo":  # std with Bessel's correction
        std = (((r - mean) ** 2 * v).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        adv = (r - mean) / (std + eps)
    elif estimator == "rloo":
        adv = (r - mean) * n / (n - 1).clamp(min=1)  # r_i - mean of the others
    else:
        adv = r - mean  # Dr. GRPO: no std division (it biases toward easy and hard prompts)
    return adv * v * (n >= 2)


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rewards_BT, dtype=torch.float32)
    running = torch.zeros(rewards_BT.shape[0], dtype=torch.float32)
    for t in reversed(range(rewards_BT.shape[1])):
        running = rewards_BT[:, t] + gamma * running * mask_BT[:, t]
        out[:, t] = running
    return out * mask_BT


def whiten(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8, reduce: SumReduce | None = None
) -> torch.Tensor:
    """Normalise over every real token of the batch (REINFORCE++'s global normalisation).

    ``reduce`` sums a tensor over the data-parallel ranks: the mean and variance are then the
    whole step's, not each rank's share of it."""
    masked = values_BT.double() * mask_BT
    sums = torch.stack([mask_BT.sum().double(), masked.sum(), (masked * values_BT.double()).sum()])
    if reduce is not None:
        sums = reduce(sums)
    n, total, squares = sums.tolist()
    n = max(n, 1.0)
    mean = total / n
    var = max(squares / n - mean * mean, 0.0)
    return ((values_BT - mean) / math.sqrt(var + eps) * mask_BT).float()


def gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns (advantages_BT, returns_BT)."""
    adv = torch.zeros_like(rewards_BT, dtype=torch.float32)
    running = torch.zeros(rewards_BT.shape[0], dtype=torch.float32)
    next_value = torch.zeros(rewards_BT.shape[0], dtype=torch.float32)
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t]
        delta = rewards_BT[:, t] + gamma * next_value - values_BT[:, t]
        running = (delta + gamma * lam * running) * m
        adv[:, t] = running
        next_value = torch.where(m > 0, values_BT[:, t], next_value)
    return adv, (adv + values_BT) * mask_BT


def advantages(
    estimator: str,
    rewards_GN: torch.Tensor,
    mask_BT: torch.Tensor,
    values_BT: torch.Tensor | None = None,
    kl_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 0.95,
    reduce: SumReduce | None = None,
    valid_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages for any estimator (sequences in group order: B = G * N).

    ``valid_B`` False marks a sample the engine aborted: out of its group's baseline (the group
    estimators), advantage 0 everywhere.

    With ``kl_BT`` and ``kl_coef`` (KL in the reward), the token estimators take the KL on every
    token's reward; the group estimators, which see one reward per sample, take each sample's
    reward less ``kl_coef`` times its summed KL (verl's outcome form of the same penalty).

    ``reduce`` (sums over the data-parallel ranks) makes reinforce_pp's whitening the whole step's.

    Returns (advantages_BT, returns_BT for the critic or None).
    """
    rewards_B = rewards_GN.reshape(-1).float()
    valid_GN = None if valid_B is None else valid_B.reshape(rewards_GN.shape)
    keep_B1 = torch.ones(rewards_B.shape[0], 1) if valid_B is None else valid_B.float().reshape(-1, 1)
    if estimator in ("grpo", "dr_grpo", "rloo"):
        if kl_BT is not None and kl_coef:
            penalty_B = (kl_BT.float() * mask_BT).sum(1)
            rewards_GN = rewards_GN.float() - kl_coef * penalty_B.reshape(rewards_GN.shape)
        adv_B = group_advantages(rewards_GN, estimator, valid_GN=valid_GN).reshape(-1, 1)
        return adv_B * mask_BT, None
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        if estimator == "reinforce_pp_baseline":
            rewards_B = group_advantages(rewards_GN, estimator, valid_GN=valid_GN).reshape(-1)
        returns = discounted_returns(token_rewards(rewards_B, mask_BT, kl_BT, kl_coef), mask_BT, gamma)
        return whiten(returns, mask_BT * keep_B1, reduce=reduce) * keep_B1, None
    if estimator == "gae":
        if values_BT is None:
            raise ValueError("gae needs a critic: set algo.critic.enabled true (or pick a critic-free estimator)")
        adv, returns = gae(token_rewards(rewards_B, mask_BT, kl_BT, kl_coef), values_BT, mask_BT, gamma, lam)
        # whitened over the step's tokens, as verl and OpenRLHF do: the update's size then does not
        # follow the reward's scale and the critic's error (the returns the critic fits are kept)
        return whiten(adv, mask_BT * keep_B1, reduce=reduce) * keep_B1, returns
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")


def uniform_groups(rewards_GN: torch.Tensor, valid_GN: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic filtering: True for groups with no advantage signal: whose valid samples' rewards
    are all equal, or with fewer than two valid samples (``valid_GN``: as ``group_advantages``
    takes it, which gives such groups 0 throughout)."""
    if valid_GN is None:
        return (rewards_GN == rewards_GN[:, :1]).all(1)
    first = rewards_GN.gather(1, valid_GN.int().argmax(1, keepdim=True))  # the first valid sample's
    return ((rewards_GN == first) | ~valid_GN).all(1) | (valid_GN.sum(1) < 2)


# --------------------------------------------------------------------------- KL, entropy, aggregation


K3_LOG_RATIO_BOUND = 20.0  # as verl bounds it


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logprobs_BT - ref_logprobs_BT
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # unbiased and always >= 0; exp overflows past a log-ratio of -88 (a token the policy now
        # all but rules out), and one inf, even masked (inf * 0), makes the step's loss NaN
        log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; choose k1, k2 or k3")


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """token_mean: every token weighs the same; seq_mean_token_mean: every sequence weighs the same;
    seq_mean_token_sum_norm: token sum over a constant (B x T), Dr. GRPO's length-unbiased form."""
    if mode == "token_mean":
        return (loss_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_seq = (loss_BT * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)
        return per_seq.mean()
    if mode == "seq_mean_token_sum_norm":
        return (loss_BT * mask_BT).sum() / (mask_BT.shape[0] * mask_BT.shape[1])
    raise ValueError(
        f"unknown loss aggregation {mode!r}; choose token_mean, seq_mean_token_mean or seq_mean_token_sum_norm"
    )


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------- losses


# The generator sends a token the sampler gave no probability (vLLM's -inf) as -1e9
# (generators/service.py MIN_LOGPROB): anything this low is no log-probability to divide by.
INVALID_LOGPROB = -1e8


@dataclass
class PolicyLossConfig:
    correction: str = "decoupled"  # decoupled | tis | none
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # clip-higher (DAPO) when larger than clip_low
    dual_clip: float | None = None  # c > 1: bounds the loss of negative advantages at c * |A|
    is_cap: float = 2.0  # truncation of the behaviour importance weight
    cap_mode: str = "truncate"  # truncate: weights above is_cap count as is_cap; mask: their tokens count 0 (AReaL)
    ratio_level: str = "token"  # token | sequence (GSPO: the length-normalised sequence ratio)
    aggregation: str = "token_mean"

    @classmethod
    def from_config(cls, cfg: FlywheelConfig) -> PolicyLossConfig:
        """The loss settings of a run's ``algo`` section."""
        loss, off_policy = cfg.algo.loss, cfg.algo.off_policy
        return cls(
            correction=off_policy.correction,
            clip_low=loss.clip_low,
            clip_high=loss.clip_high,
            dual_clip=loss.dual_clip,
            is_cap=off_policy.is_cap,
            cap_mode=off_policy.cap_mode,
            ratio_level=loss.ratio_level,
            aggregation=loss.aggregation,
        )


def _capped(weight: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    if cfg.cap_mode == "mask":
        return torch.where(weight <= cfg.is_cap, weight, torch.zeros_like(weight))
    if cfg.cap_mode == "truncate":
        return weight.clamp(max=cfg.is_cap)
    raise ValueError(f"unknown cap_mode {cfg.cap_mode!r}; choose truncate or mask")


def policy_loss(
    logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor | None,
    behav_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``policy_loss_terms`` with its metrics as Python floats."""
    loss, metrics = policy_loss_terms(logprobs_BT, prox_logprobs_BT, behav_logprobs_BT, advantages_BT, mask_BT, cfg)
    return loss, {k: float(v) for k, v in metrics.items()}


def policy_loss_terms(
    logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor | None,
    behav_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with an off-policy correction for stale samples. Returns (loss, metrics).

    - ``none``: PPO around the behaviour policy, ratio pi/mu.
    - ``decoupled``: PPO around the proximal policy (ratio pi/prox) times the behaviour weight
      prox/mu truncated at ``is_cap`` (no gradient): the trust region is the learner's own last
      policy however stale the samples are.
    - ``tis``: no clipping; the policy gradient weighted by pi/mu truncated at ``is_cap``.

    ``cap_mode`` ``mask`` gives a weight above ``is_cap`` 0 instead (AReaL's decoupled PPO drops
    those tokens). A token whose behaviour log-probability is the generator's floor (the sampler
    gave it none: ``INVALID_LOGPROB``) has no ratio at all: its loss is 0 (its weight was +inf,
    and under ``none`` the loss NaN). (The trainer leaves such tokens out of its mask as well:
    no other loss term takes them, nor does the step's normalisation count them.)
    """
    mask = mask_BT.float()
    valid = behav_logprobs_BT > INVALID_LOGPROB
    # an invalid token's behaviour log-probability set to the policy's own: finite everywhere,
    # so no inf reaches exp (a NaN gradient through torch.where's masked branch otherwise)
    behav_logprobs_BT = torch.where(valid, behav_logprobs_BT, logprobs_BT.detach())
    behav_weight = torch.ones_like(logprobs_BT)
    if cfg.correction == "decoupled":
        if prox_logprobs_BT is None:
            raise ValueError("decoupled correction needs the proximal log-probabilities")
        anchor = prox_logprobs_BT.detach()
        behav_weight = _capped(torch.exp(prox_logprobs_BT - behav_logprobs_BT), cfg).detach()
    elif cfg.correction in ("none", "tis"):
        anchor = behav_logprobs_BT.detach()
    else:
        raise ValueError(f"unknown off-policy correction {cfg.correction!r}; choose decoupled, tis or none")
    log_ratio = logprobs_BT - anchor
    if cfg.ratio_level == "sequence":
        seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        # GSPO: every token carries its sequence's ratio as value, its own log-probability's gradient
        log_ratio = seq.detach() + logprobs_BT - logprobs_BT.detach()
    elif cfg.ratio_level != "token":
        raise ValueError(f"unknown ratio level {cfg.ratio_level!r}; choose token or sequence")
    ratio = torch.exp(log_ratio)
    adv = advantages_BT.detach()
    if cfg.correction == "tis":
        weight = _capped(ratio, cfg).detach()
        loss_BT = -weight * adv * logprobs_BT
        clipped = (ratio > cfg.is_cap).float()
    else:
        surr1 = ratio * adv
        surr2 = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        loss_BT = -torch.min(surr1, surr2)
        clipped = (surr2 < surr1).float()
        if cfg.dual_clip is not None:
            if cfg.dual_clip <= 1:
                raise ValueError(f"dual_clip must be > 1, got {cfg.dual_clip}")
            bounded = torch.min(loss_BT, -cfg.dual_clip * adv)
            loss_BT = torch.where(adv < 0, bounded, loss_BT)
        loss_BT = loss_BT * behav_weight
    loss_BT = loss_BT * valid
    loss = aggregate(loss_BT, mask, cfg.aggregation)
    # 0-d tensors on the loss's device: the trainer sums them over micro-batches and reads them
    # once per step (a float() here would stall the host on the GPU at every micro-batch)
    metrics = {
        "clip_frac": masked_mean(clipped, mask).detach(),
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "behav_weight_mean": masked_mean(behav_weight, mask),
        "behav_weight_max": (behav_weight * mask).max() if mask.numel() else mask.new_zeros(()),
    }
    return loss, metrics


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float | None,
    aggregation: str = "token_mean",
) -> torch.Tensor:
    """0.5 * squared error, with PPO's value clipping around the values at sampling time."""
    err = (values_BT - returns_BT) ** 2
    if clip is not None:
        clipped = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
        err = torch.max(err, (clipped - returns_BT) ** 2)
    return 0.5 * aggregate(err, mask_BT.float(), aggregation)
