"""Advantage estimators and losses against values computed by hand (in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algos import (
    PolicyLossConfig,
    advantages,
    aggregate,
    gae,
    group_advantages,
    kl_estimate,
    policy_loss,
    uniform_groups,
    value_loss,
)

T = torch.tensor


def close(a: torch.Tensor, b: list[float] | list[list[float]], tol: float = 1e-4) -> None:
    assert torch.allclose(a.float(), T(b), atol=tol), f"{a} != {b}"


def test_group_estimators() -> None:
    r = T([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.86603
    close(group_advantages(r, "grpo"), [[0.86603, -0.86603, -0.86603, 0.86603]])
    close(group_advantages(r, "dr_grpo"), [[0.5, -0.5, -0.5, 0.5]])
    # rloo: r_i minus the mean of the others: 1 - 0 = 1; 0 - (1 + 0) / 2 = -0.5
    close(group_advantages(T([[1.0, 0.0, 0.0]]), "rloo"), [[1.0, -0.5, -0.5]])
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):  # grpo's std of one sample was NaN
        with pytest.raises(ValueError, match="n_samples_per_prompt to 2 or more"):
            group_advantages(T([[1.0], [0.0]]), estimator)
    with pytest.raises(ValueError, match="group estimator"):
        group_advantages(r, "gae")


def test_group_advantage_is_spread_over_real_tokens_only() -> None:
    mask = T([[1, 1, 0], [1, 0, 0]]).float()
    adv, returns = advantages("dr_grpo", T([[2.0, 0.0]]), mask)
    close(adv, [[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    assert returns is None


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_kl_in_the_reward_reaches_the_group_estimators(estimator: str) -> None:
    """KL in the reward: each sample's reward less kl_coef times its summed KL (it was dropped)."""
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    kl = T([[2.0, 3.0], [1.0, 7.0]])  # summed over real tokens: 5 and 1 (the padded 7 never counts)
    adv, _ = advantages(estimator, T([[1.0, 1.0]]), mask, kl_BT=kl, kl_coef=0.5)
    # rewards 1 - 2.5 = -1.5 and 1 - 0.5 = 0.5: the sample with more KL is the worse one
    by_hand = group_advantages(T([[-1.5, 0.5]]), estimator)[0]
    close(adv, [[float(by_hand[0])] * 2, [float(by_hand[1]), 0.0]])
    assert by_hand[0] < 0 < by_hand[1]


def test_gae_by_hand() -> None:
    rewards = T([[0.0, 0.0, 1.0, 0.0]])
    values = T([[0.5, 0.5, 0.5, 9.0]])  # the padded position's value must not leak in
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # gamma 1, lambda 0.5: delta2 = 1 - 0.5 = 0.5; delta1 = 0 + 0.5 - 0.5 = 0; delta0 = 0
    # A2 = 0.5, A1 = 0 + 0.5 * 0.5 = 0.25, A0 = 0.125; returns = A + V
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    close(adv, [[0.125, 0.25, 0.5, 0.0]])
    close(ret, [[0.625, 0.75, 1.0, 0.0]])
    with pytest.raises(ValueError, match="critic"):
        advantages("gae", T([[1.0]]), mask)


def test_gae_advantages_are_whitened_over_the_step_as_verl_and_openrlhf_do() -> None:
    """Raw GAE values made the update's size follow the reward's scale and the critic's error."""
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    values = T([[0.5, 0.5, 0.5, 9.0]])
    raw, _ = gae(T([[0.0, 0.0, 1.0, 0.0]]), values, mask, gamma=1.0, lam=0.5)
    adv, ret = advantages("gae", T([[1.0]]), mask, values_BT=values, gamma=1.0, lam=0.5)
    real = adv[mask > 0]
    assert float(real.mean()) == pytest.approx(0.0, abs=1e-6) and float(real.std(unbiased=False)) == pytest.approx(
        1.0, rel=1e-4
    )
    assert torch.argsort(real).tolist() == torch.argsort(raw[mask > 0]).tolist() and adv[0, 3] == 0.0
    assert ret is not None
    close(ret, [[0.625, 0.75, 1.0, 0.0]])  # the critic's targets stay the raw returns


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_an_aborted_sample_is_out_of_its_groups_baseline(estimator: str) -> None:
    """Its reward scores a partial answer the engine cut: in the baseline, rewards [1, 1, 1, 0
    (aborted)] gave the three real samples +0.5 each (GRPO), a contrast that is not there."""
    valid = torch.tensor([[True, True, True, False], [True, False, True, True]])
    rewards = T([[1.0, 1.0, 1.0, 0.0], [1.0, 5.0, 0.0, 0.0]])
    adv = group_advantages(rewards, estimator, valid_GN=valid)
    close(adv[0], [0.0, 0.0, 0.0, 0.0])  # no contrast among the real three
    by_hand = group_advantages(T([[1.0, 0.0, 0.0]]), estimator)[0]  # group 2 without its aborted sample
    close(adv[1], [float(by_hand[0]), 0.0, float(by_hand[1]), float(by_hand[2])])
    lone = group_advantages(T([[1.0, 0.0]]), estimator, valid_GN=torch.tensor([[True, False]]))
    close(lone, [[0.0, 0.0]])  # one valid sample has no group to compare with
    mask = torch.ones(8, 2)
    token_adv, _ = advantages(estimator, rewards, mask, valid_B=valid.reshape(-1))
    close(token_adv[:, 0], adv.reshape(-1).tolist())


def test_reinforce_pp_returns_are_whitened_over_the_batch() -> None:
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # returns (gamma 1): [[1, 1], [0, -]] -> real tokens 1, 1, 0: mean 2/3, var 2/9, std 0.4714
    adv, _ = advantages("reinforce_pp", T([[1.0], [0.0]]), mask)
    close(adv, [[0.70711, 0.70711], [-1.41421, 0.0]])
    # with the group baseline, rewards become r - mean (0.5, -0.5) before the returns
    adv_b, _ = advantages("reinforce_pp_baseline", T([[1.0, 0.0]]), mask)
    close(adv_b, [[0.70711, 0.70711], [-1.41421, 0.0]])
    # two groups of different means: the baseline is each group's own (one group alone cannot
    # show it: whitening takes a shared shift out); r - mean = [0.5, -0.5], [0, 0]
    one_token = T([[1.0]] * 4)
    adv_b2, _ = advantages("reinforce_pp_baseline", T([[1.0, 0.0], [1.0, 1.0]]), one_token)
    close(adv_b2, [[1.41421], [-1.41421], [0.0], [0.0]])
    adv_nb, _ = advantages("reinforce_pp", T([[1.0], [0.0], [1.0], [1.0]]), one_token)
    close(adv_nb, [[0.57735], [-1.73205], [0.57735], [0.57735]])
    # KL in the reward: -0.1 * kl on every token
    kl = T([[1.0, 1.0], [1.0, 0.0]])
    adv_kl, _ = advantages("reinforce_pp", T([[1.0], [0.0]]), mask, kl_BT=kl, kl_coef=0.1)
    # token rewards [[-0.1, 0.9], [-0.1, -]] -> returns [[0.8, 0.9], [-0.1, -]]
    vals = T([0.8, 0.9, -0.1])
    expected = (vals - vals.mean()) / vals.std(unbiased=False)
    close(adv_kl, [[float(expected[0]), float(expected[1])], [float(expected[2]), 0.0]], tol=1e-3)


def test_kl_estimators() -> None:
    logp, ref = T([-1.0]), T([-2.0])
    close(kl_estimate(logp, ref, "k1"), [1.0])
    close(kl_estimate(logp, ref, "k2"), [0.5])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-1.0) - 1 + 1])  # exp(ref - logp) - 1 - (ref - logp)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(logp, ref, "k4")
    # a token the policy now all but rules out (log-ratio -95): exp(95) overflowed to inf, and
    # masked or not (inf * 0 = NaN) it made the step's loss NaN
    far = kl_estimate(T([-100.0, -1.0]), T([-5.0, -1.0]), "k3")
    assert torch.isfinite(far).all() and math.isfinite(aggregate(far[None], T([[0.0, 1.0]]), "token_mean").item())


def test_aggregations() -> None:
    loss = T([[1.0, 2.0], [3.0, 7.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    close(aggregate(loss, mask, "token_mean"), 2.0)  # (1 + 2 + 3) / 3
    close(aggregate(loss, mask, "seq_mean_token_mean"), 2.25)  # (1.5 + 3) / 2
    close(aggregate(loss, mask, "seq_mean_token_sum_norm"), 1.5)  # 6 / (2 * 2)


def _loss(ratio: float, adv: float, **cfg: object) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    behav = T([[-1.0]])
    logp = (behav + math.log(ratio)).requires_grad_()
    loss, metrics = policy_loss(logp, None, behav, T([[adv]]), T([[1.0]]), PolicyLossConfig(correction="none", **cfg))  # type: ignore[arg-type]
    loss.backward()
    assert logp.grad is not None
    return loss, metrics, logp.grad


def test_clipped_surrogate_dual_clip_and_clip_higher() -> None:
    loss, metrics, grad = _loss(1.5, 1.0)  # -min(1.5, 1.2) = -1.2, clipped: no gradient
    close(loss, -1.2)
    assert metrics["clip_frac"] == 1.0 and float(grad) == 0.0
    loss, metrics, grad = _loss(1.5, -1.0)  # -min(-1.5, -1.2) = 1.5, unclipped: gradient ratio * -A
    close(loss, 1.5)
    close(grad, [[1.5]])
    loss, _, _ = _loss(1.5, 1.0, clip_high=0.28)  # clip-higher: -min(1.5, 1.28)
    close(loss, -1.28)
    loss, _, grad = _loss(4.0, -1.0, dual_clip=3.0)  # -min(-4, -1.2) = 4, bounded at 3 * |A|
    close(loss, 3.0)
    assert float(grad) == 0.0


def test_decoupled_clips_around_the_proximal_policy_and_truncates_the_behaviour_weight() -> None:
    behav = T([[-1.0]])
    prox = behav + math.log(2.0)  # prox / behaviour = 2, truncated at 1.5
    logp = (prox + math.log(1.1)).requires_grad_()  # ratio to prox 1.1: inside the clip range
    cfg = PolicyLossConfig(correction="decoupled", is_cap=1.5)
    loss, metrics = policy_loss(logp, prox, behav, T([[1.0]]), T([[1.0]]), cfg)
    close(loss, -1.1 * 1.5)
    assert metrics["behav_weight_max"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="proximal"):
        policy_loss(logp, None, behav, T([[1.0]]), T([[1.0]]), cfg)


def test_tis_weights_the_gradient_by_the_truncated_ratio() -> None:
    behav = T([[-1.0]])
    logp = (behav + math.log(3.0)).requires_grad_()  # pi / mu = 3, truncated at 2
    loss, _ = policy_loss(logp, None, behav, T([[0.5]]), T([[1.0]]), PolicyLossConfig(correction="tis", is_cap=2.0))
    loss.backward()
    assert logp.grad is not None
    close(logp.grad, [[-2.0 * 0.5]])  # d/dlogp of -w * A * logp


def test_gspo_uses_the_length_normalised_sequence_ratio() -> None:
    behav = T([[-1.0, -1.0]])
    logp = (behav + T([[math.log(2.0), 0.0]])).requires_grad_()  # sequence ratio exp(log 2 / 2) = 1.414
    cfg = PolicyLossConfig(correction="none", ratio_level="sequence")
    loss, metrics = policy_loss(logp, None, behav, T([[1.0, 1.0]]), T([[1.0, 1.0]]), cfg)
    close(loss, -1.2)  # both tokens clipped at 1 + 0.2
    assert metrics["ratio_mean"] == pytest.approx(math.sqrt(2.0), rel=1e-4)


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
@pytest.mark.parametrize("advantage", [1.0, 0.0, -1.0])
def test_a_token_the_sampler_gave_no_probability_gets_no_gradient_and_no_nan(correction: str, advantage: float) -> None:
    """Its behaviour log-probability arrives as the generator's floor (-1e9): under `none` the
    ratio was exp(1e9) = inf, the loss NaN or inf and the gradient NaN, into the weights."""
    behav = T([[-1.0, -1e9]])
    logp = T([[-1.2, -3.0]]).requires_grad_()
    prox = logp.detach().clone() if correction == "decoupled" else None
    cfg = PolicyLossConfig(correction=correction)
    loss, metrics = policy_loss(logp, prox, behav, T([[advantage, advantage]]), T([[1.0, 1.0]]), cfg)
    loss.backward()
    assert logp.grad is not None and torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0.0  # the invalid token: no gradient
    alone, _ = policy_loss(
        logp.detach()[:, :1], None if prox is None else prox[:, :1], behav[:, :1], T([[advantage]]), T([[1.0]]), cfg
    )
    close(loss, float(alone) / 2)  # the valid token's loss, over both tokens (it still counts in the mean)
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_cap_mode_mask_drops_the_tokens_over_the_cap_as_areal_does() -> None:
    """AReaL's decoupled PPO filters out tokens whose behaviour weight exceeds the cap; truncation
    (the default) gives them the cap instead."""
    behav = T([[-1.0, -1.0]])
    prox = T([[-1.0 + math.log(3.0), -1.0 + math.log(1.5)]])  # behaviour weights 3 (over the cap 2) and 1.5
    logp = prox.clone().requires_grad_()
    for mode, weights in (("truncate", [2.0, 1.5]), ("mask", [0.0, 1.5])):
        cfg = PolicyLossConfig(correction="decoupled", is_cap=2.0, cap_mode=mode)
        _, metrics = policy_loss(logp, prox, behav, T([[1.0, 1.0]]), T([[1.0, 1.0]]), cfg)
        assert metrics["behav_weight_mean"] == pytest.approx(sum(weights) / 2, rel=1e-5), mode


def test_value_loss_clipping() -> None:
    # v 2, old 1, return 3, clip 0.5: unclipped (2-3)^2 = 1, clipped v 1.5 -> 2.25; 0.5 * max = 1.125
    close(value_loss(T([[2.0]]), T([[1.0]]), T([[3.0]]), T([[1.0]]), clip=0.5), 1.125)
    close(value_loss(T([[2.0]]), T([[1.0]]), T([[3.0]]), T([[1.0]]), clip=None), 0.5)


def test_dynamic_filtering_finds_groups_without_signal() -> None:
    assert uniform_groups(T([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])).tolist() == [True, False, True]
    # an aborted sample's reward scores a partial answer, which the advantages leave out: a group
    # whose valid samples agree, or with one valid sample, has no signal either
    rewards = T([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    valid = torch.tensor(
        [[True, True, True, False], [False, True, True, True], [True, False, False, False], [True] * 4]
    )
    assert uniform_groups(rewards, valid).tolist() == [True, True, True, False]
    assert (group_advantages(rewards, "grpo", valid_GN=valid)[:3] == 0).all()


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        advantages("ppo2", T([[1.0]]), T([[1.0]]))
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        policy_loss(T([[0.0]]), None, T([[0.0]]), T([[1.0]]), T([[1.0]]), PolicyLossConfig(correction="magic"))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(T([[1.0]]), T([[1.0]]), "median")


def test_the_loss_settings_come_from_the_runs_algo_section() -> None:
    from flywheel.config import load_config

    cfg = load_config(
        ["--algo.off_policy.correction", "none", "--algo.off_policy.is_cap", "3", "--algo.loss.clip_high", "0.28"]
    )
    loss = PolicyLossConfig.from_config(cfg)
    assert (loss.correction, loss.is_cap, loss.clip_low, loss.clip_high) == ("none", 3.0, 0.2, 0.28)
    assert (loss.ratio_level, loss.aggregation) == (cfg.algo.loss.ratio_level, cfg.algo.loss.aggregation)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae", "grpo"])
def test_a_batch_of_empty_responses_gets_empty_advantages_not_an_error(estimator: str) -> None:
    """A rank whose sequences all have empty completions (a prompt that filled the model's
    context ends with no token) has a [B, 0] mask: the token estimators raised on it."""
    rewards_GN = torch.tensor([[1.0, 0.0]])
    mask_BT = torch.zeros(2, 0)
    values = torch.zeros(2, 0) if estimator == "gae" else None
    from learner import algos

    adv, returns = algos.advantages(estimator, rewards_GN, mask_BT, values_BT=values)
    assert adv.shape == (2, 0)
    assert returns is None or returns.shape == (2, 0)
