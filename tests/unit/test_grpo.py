"""GRPO math against hand-computed numbers, a loop, and batch splits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlgate.training.grpo import LossConfig, PolicyBatch, aggregate, group_advantages, kl_k3, policy_loss

REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 0, 7, 7])


def test_grpo_advantages_by_hand():
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    # group 7: mean 4, sample std sqrt(2 / 1) = 1.41421 -> -+0.707107
    expected = [0.866025, -0.866025, 0.866025, -0.866025, -0.707107, 0.707107]
    assert group_advantages(REWARDS, GROUPS, "grpo").tolist() == pytest.approx(expected, abs=1e-5)


def test_dr_grpo_and_rloo_by_hand():
    assert group_advantages(REWARDS, GROUPS, "dr_grpo").tolist() == [0.5, -0.5, 0.5, -0.5, -1.0, 1.0]
    # RLOO: r_i - mean of the others. Group 0, r=1: others (0, 1, 0) -> 1 - 1/3 = 2/3.
    # Group 7, r=3: other 5 -> -2.
    expected = [2 / 3, -2 / 3, 2 / 3, -2 / 3, -2.0, 2.0]
    assert group_advantages(REWARDS, GROUPS, "rloo").tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_lonely_and_uniform_groups_get_zero(estimator):
    rewards = torch.tensor([4.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([1, 2, 2, 2])  # a group of one, and a group with equal rewards
    assert group_advantages(rewards, groups, estimator).tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_vectorised_advantages_equal_a_plain_loop(estimator):
    rng = random.Random(0)
    rewards = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(60)]
    groups = [rng.randrange(9) for _ in range(60)]
    expected = []
    for reward, group in zip(rewards, groups):
        members = [r for r, g in zip(rewards, groups) if g == group]
        if len(members) == 1:
            expected.append(0.0)
            continue
        mean = sum(members) / len(members)
        if estimator == "grpo":
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            expected.append((reward - mean) / (std + 1e-6))
        elif estimator == "dr_grpo":
            expected.append(reward - mean)
        else:
            others = list(members)
            others.remove(reward)
            expected.append(reward - sum(others) / len(others))
    result = group_advantages(torch.tensor(rewards), torch.tensor(groups), estimator)
    assert result.tolist() == pytest.approx(expected, abs=1e-5)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, dr_grpo, rloo"):
        group_advantages(REWARDS, GROUPS, "ppo")


def batch(ratios, advantages, mask=None, behaviour_shift=0.0, ref_shift=None):
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    logp = (old + torch.log(torch.tensor(ratios))).requires_grad_(True)
    mask = torch.tensor(mask, dtype=torch.float32) if mask is not None else torch.ones_like(old)
    return PolicyBatch(
        logp=logp,
        old_logp=old,
        advantages=torch.tensor(advantages),
        mask=mask,
        behaviour_logp=old - behaviour_shift,
        ref_logp=None if ref_shift is None else old + ref_shift,
    )


def test_ppo_clip_with_clip_higher_by_hand():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    # ratio 1.5, A=+1: clipped at 1.28 -> -1.28.   ratio 1.5, A=-1: -min(-1.5, -1.28) = 1.5
    # ratio 0.5, A=+1: -min(0.5, 0.8) = -0.5.        ratio 0.5, A=-1: -min(-0.5, -0.8) = 0.8
    b = batch([[1.5, 0.5], [1.5, 0.5]], [1.0, -1.0])
    loss, metrics = policy_loss(b, cfg, "ppo_clip")
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4)
    assert metrics["clip_fraction"] == pytest.approx(2 / 4)  # (1.5, +) and (0.5, -) are clipped
    loss.backward()
    grad = b.logp.grad
    # clipped tokens carry no gradient; unclipped ones: d/dlogp of -ratio*A / 4 = -ratio*A/4
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 1.5 / 4, 0.0])


def test_gspo_uses_one_ratio_per_sequence():
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean")
    # sequence ratio = exp(mean(log 1.1, log 1.1, log 0.9)) = (1.1 * 1.1 * 0.9) ** (1/3) = 1.0323
    b = batch([[1.1, 1.1, 0.9]], [2.0])
    loss, _ = policy_loss(b, cfg, "gspo")
    ratio = (1.1 * 1.1 * 0.9) ** (1 / 3)
    assert loss.item() == pytest.approx(-ratio * 2.0, rel=1e-5)


def test_decoupled_ppo_weights_by_proximal_over_behaviour():
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, behaviour_weight_cap=5.0, aggregation="token_mean")
    # pi/pi_prox = 1 (no clipping), pi_prox/mu = exp(0.5) = 1.6487; A = 1 -> loss -1.6487 per token
    b = batch([[1.0, 1.0]], [1.0], behaviour_shift=0.5)
    loss, metrics = policy_loss(b, cfg, "decoupled_ppo")
    assert loss.item() == pytest.approx(-math.exp(0.5), rel=1e-6)
    assert metrics["behaviour_weight"] == pytest.approx(math.exp(0.5), rel=1e-6)
    capped = batch([[1.0]], [1.0], behaviour_shift=3.0)  # exp(3) = 20.1 is truncated at 5
    assert policy_loss(capped, cfg, "decoupled_ppo")[0].item() == pytest.approx(-5.0)
    with pytest.raises(ValueError, match="behaviour_logp"):
        policy_loss(PolicyBatch(b.logp, b.old_logp, b.advantages, b.mask), cfg, "decoupled_ppo")


def test_cispo_weights_every_token_by_its_clipped_ratio_to_the_sampler():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    # ratios to the sampler (behaviour_logp; old_logp is the trainer's own): 1.5 -> weight 1.28, 0.5 -> 0.8
    b = batch([[1.0, 1.0], [1.0, 1.0]], [1.0, -1.0], behaviour_shift=math.log(1.5))
    b.behaviour_logp[:, 1] = b.old_logp[:, 1] - math.log(0.5)
    loss, metrics = policy_loss(b, cfg, "cispo")
    logp = b.logp.detach()
    weights = torch.tensor([[1.28, 0.8], [1.28, 0.8]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    assert loss.item() == pytest.approx(float((-weights * advantages * logp).mean()), rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(1.0) and metrics["ratio"] == pytest.approx(1.0)
    loss.backward()
    # unlike PPO's clip, a clipped token keeps its gradient: -weight * A / 4, the weight held constant
    assert b.logp.grad.flatten().tolist() == pytest.approx((-weights * advantages / 4).flatten().tolist())
    inside = batch([[1.1]], [2.0])  # no sampler given: the ratio to old_logp, within the clip
    inside = PolicyBatch(inside.logp, inside.old_logp, inside.advantages, inside.mask)
    loss, metrics = policy_loss(inside, cfg, "cispo")
    assert (
        loss.item() == pytest.approx(-1.1 * 2.0 * float(inside.logp.detach()), rel=1e-6)
        and metrics["clip_fraction"] == 0
    )


def test_truncated_is_turns_ppo_clip_into_the_capped_behaviour_weight_at_any_staleness():
    from rlgate.config import ConfigError, parse_config

    def loss_of(algorithm: dict, staleness: int = 0) -> str:
        return parse_config({"algorithm": algorithm}).algorithm.resolved(staleness).loss

    assert loss_of({}) == "ppo_clip" and loss_of({}, staleness=1) == "decoupled_ppo"
    assert loss_of({"truncated_is": True}) == "decoupled_ppo"  # the train/inference mismatch, at S = 0
    assert loss_of({"loss": "cispo"}, staleness=2) == "cispo"
    for refused in ({"variety": "gspo", "truncated_is": True}, {"loss": "cispo", "truncated_is": True}):
        with pytest.raises(ConfigError, match="truncated_is applies to the ppo_clip loss"):
            parse_config({"algorithm": refused})


def test_kl_k3_by_hand_and_in_the_loss():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5])
    # r = ref - logp = (0, 0.5): k3 = (0, e^0.5 - 0.5 - 1)
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.0, math.exp(0.5) - 1.5])
    cfg = LossConfig(kl_coef=0.1, aggregation="token_mean")
    b = batch([[1.0, 1.0]], [0.0], ref_shift=0.5)
    loss, metrics = policy_loss(b, cfg, "ppo_clip")
    assert loss.item() == pytest.approx(0.1 * (math.exp(0.5) - 1.5))
    assert metrics["kl"] == pytest.approx(math.exp(0.5) - 1.5)


def test_entropy_bonus_by_hand():
    b = batch([[1.0, 1.0]], [0.0])  # zero advantage: the policy term is 0
    b.entropy = torch.tensor([[0.5, 1.5]])
    loss, metrics = policy_loss(b, LossConfig(entropy_coef=0.1, aggregation="token_mean"), "ppo_clip")
    assert loss.item() == pytest.approx(-0.1 * 1.0)  # minus coef x mean entropy
    assert metrics["entropy"] == pytest.approx(1.0)
    b.entropy = None
    with pytest.raises(ValueError, match="entropy_coef > 0 needs"):
        policy_loss(b, LossConfig(entropy_coef=0.1), "ppo_clip")


def test_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_sum_norm").item() == pytest.approx(10 / (2 * 4))
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregate(per_token, mask, "mean")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("variant", ["ppo_clip", "gspo", "decoupled_ppo", "cispo"])
def test_a_batch_split_across_workers_sums_to_the_full_loss_and_gradient(mode, variant):
    torch.manual_seed(0)
    rows, width = 8, 6
    mask = (torch.rand(rows, width) > 0.3).float()
    mask[:, 0] = 1
    logp = (torch.randn(rows, width) * 0.1 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(rows, width) * 0.2
    behaviour = old + torch.randn(rows, width) * 0.1
    advantages = torch.randn(rows)
    cfg = LossConfig(aggregation=mode, clip_high=0.28)
    full, _ = policy_loss(PolicyBatch(logp, old, advantages, mask, behaviour), cfg, variant)
    (full_grad,) = torch.autograd.grad(full, logp)
    # the global normaliser every worker uses
    normaliser = {"token_mean": mask.sum(), "seq_mean_token_mean": rows, "seq_mean_token_sum_norm": rows * width}[mode]
    parts, grads = [], []
    for part in (slice(0, 3), slice(3, 8)):  # uneven split, as across data-parallel ranks
        piece = logp.detach()[part].clone().requires_grad_(True)
        loss, _ = policy_loss(
            PolicyBatch(piece, old[part], advantages[part], mask[part], behaviour[part]),
            cfg,
            variant,
            normaliser=float(normaliser),
        )
        parts.append(loss)
        grads.append(torch.autograd.grad(loss, piece)[0])
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(torch.cat(grads), full_grad, atol=1e-6)


def test_unknown_loss_and_missing_reference_are_named():
    b = batch([[1.0]], [1.0])
    with pytest.raises(ValueError, match="unknown policy loss 'reinforce'.*ppo_clip, gspo, decoupled_ppo"):
        policy_loss(b, LossConfig(), "reinforce")
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logp"):
        policy_loss(b, LossConfig(kl_coef=0.1), "ppo_clip")
