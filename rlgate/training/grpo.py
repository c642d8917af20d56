"""GRPO math as pure functions over tensors (torch only; no Ray, no vLLM).

Shapes: ``B`` sequences, ``T`` tokens per (padded) sequence.

* Advantages, group-relative: :func:`group_advantages` with a registry of
  estimators (GRPO mean/std, Dr.GRPO without std, RLOO leave-one-out).
* Policy losses, per token: a registry (PPO-clip with asymmetric clip as in
  DAPO's clip-higher, GSPO's sequence-level ratio, AReaL's decoupled PPO, which
  is also truncated importance sampling against the sampler, and CISPO's
  clipped, detached importance weights on every token),
  then :func:`aggregate` over tokens and sequences, optionally plus a k3 KL
  to a frozen reference.

Aggregation takes an explicit ``normaliser`` so a batch split across
data-parallel workers sums to exactly the full-batch loss: every worker
divides by the *global* token (or sequence) count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

# --- advantages ---------------------------------------------------------------


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sequence group size, group mean and group sample std (ddof=1)."""
    groups, index = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, index, rewards)
    mean = total / count
    squares = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, index, (rewards - mean[index]) ** 2)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return count[index], mean[index], std[index]


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps); a group of one gets 0."""
    count, mean, std = _group_stats(rewards, group_ids)
    return torch.where(count > 1, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr.GRPO: r - group mean, no division by the std (which biases towards easy/hard groups)."""
    count, mean, _ = _group_stats(rewards, group_ids)
    return torch.where(count > 1, rewards - mean, torch.zeros_like(rewards))


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RLOO: r_i minus the mean of the *other* rewards of its group, = G/(G-1) (r_i - mean)."""
    count, mean, _ = _group_stats(rewards, group_ids)
    scale = count / (count - 1).clamp(min=1)
    return torch.where(count > 1, scale * (rewards - mean), torch.zeros_like(rewards))


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo") -> torch.Tensor:
    """Group-relative advantages. ``rewards``: [B] float; ``group_ids``: [B] int."""
    if estimator not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[estimator](rewards.double(), group_ids).to(rewards.dtype)


# --- policy losses --------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    """Settings the policy losses read (the ``[algorithm]`` config maps onto this)."""

    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high (DAPO clip-higher: e.g. 0.28)
    behaviour_weight_cap: float = 5.0  # decoupled PPO: truncate pi_prox / mu at this value
    aggregation: Aggregation = "token_mean"
    kl_coef: float = 0.0  # k3 KL to the reference policy; 0 disables
    entropy_coef: float = 0.0  # bonus on the policy's token entropy (against collapse); 0 disables


@dataclass
class PolicyBatch:
    """One (micro-)batch of the policy-gradient objective.

    ``logp``: [B, T] log-probs under the policy being optimised (with grad).
    ``old_logp``: [B, T] log-probs the ratio is taken against: the behaviour
    policy for plain PPO/GSPO, the *proximal* policy for decoupled PPO.
    ``behaviour_logp``: [B, T] the sampling policy's log-probs (decoupled PPO only).
    ``ref_logp``: [B, T] a frozen reference for the KL term (optional).
    ``entropy``: [B, T] the policy's entropy at each position (with grad; for the bonus).
    ``advantages``: [B] or [B, T]; ``mask``: [B, T] 1 on tokens to train.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    behaviour_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def token_advantages(self) -> torch.Tensor:
        return self.advantages[:, None].expand_as(self.logp) if self.advantages.dim() == 1 else self.advantages


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    was_clipped = (ratio * advantages > clipped * advantages).to(ratio.dtype)
    return loss, was_clipped


def ppo_clip_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """Per-token PPO-clip; asymmetric bounds give DAPO's clip-higher."""
    ratio = torch.exp(batch.logp - batch.old_logp)
    loss, clipped = _clipped(ratio, batch.token_advantages(), cfg)
    return loss, {"clip_fraction": clipped, "ratio": ratio.detach()}


def gspo_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """GSPO: one ratio per sequence, exp of the mean per-token log-ratio, clipped.
    Every token of a sequence carries that sequence's loss, so
    ``seq_mean_token_mean`` gives GSPO's mean over sequences and ``token_mean``
    its length-weighted variant."""
    mask = batch.mask.to(batch.logp.dtype)
    lengths = mask.sum(-1).clamp(min=1)
    log_ratio = ((batch.logp - batch.old_logp) * mask).sum(-1) / lengths
    ratio = torch.exp(log_ratio)
    advantages = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[:, 0]
    loss, clipped = _clipped(ratio, advantages, cfg)
    per_token = loss[:, None] * mask
    return per_token, {
        "clip_fraction": clipped[:, None].expand_as(mask),
        "ratio": ratio.detach()[:, None].expand_as(mask),
    }


def decoupled_ppo_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """AReaL's decoupled PPO: clip the ratio to the *proximal* policy (``old_logp``,
    recomputed by the trainer) and weight by pi_prox / mu, the importance weight
    against the behaviour policy that sampled the tokens, truncated at
    ``behaviour_weight_cap`` (no gradient)."""
    if batch.behaviour_logp is None:
        raise ValueError("decoupled PPO needs behaviour_logp (the sampling policy's logprobs)")
    ratio = torch.exp(batch.logp - batch.old_logp)
    loss, clipped = _clipped(ratio, batch.token_advantages(), cfg)
    weight = torch.exp(batch.old_logp - batch.behaviour_logp).clamp(max=cfg.behaviour_weight_cap).detach()
    return weight * loss, {"clip_fraction": clipped, "ratio": ratio.detach(), "behaviour_weight": weight}


def cispo_loss(batch: PolicyBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1): REINFORCE on every token, weighted by its importance
    ratio against the policy that sampled it (``behaviour_logp``; else
    ``old_logp``), clipped to [1 - clip_low, 1 + clip_high] and detached. Unlike
    PPO's clip, no token's gradient is dropped; the clip only bounds its weight."""
    sampler = batch.behaviour_logp if batch.behaviour_logp is not None else batch.old_logp
    ratio = torch.exp(batch.logp.detach() - sampler)
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = -weight * batch.token_advantages() * batch.logp
    return loss, {"clip_fraction": (weight != ratio).to(ratio.dtype), "ratio": ratio}


POLICY_LOSSES: dict[str, Callable[[PolicyBatch, LossConfig], tuple[torch.Tensor, dict]]] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "cispo": cispo_loss,
}


def denominator(mode: Aggregation, sequences: int, tokens: float, width: int) -> float:
    """The loss denominator that makes :func:`aggregate` a mean over a batch of
    ``sequences`` rows, ``width`` positions wide, holding ``tokens`` trained
    tokens: the one definition, for a micro-batch, a worker's share and the
    driver's whole batch alike (token count, sequence count, or width times
    sequence count)."""
    if mode == "token_mean":
        return float(max(tokens, 1))
    if mode == "seq_mean_token_mean":
        return float(sequences)
    if mode == "seq_mean_token_sum_norm":
        return float(sequences * width)
    raise ValueError(
        f"unknown aggregation {mode!r}; expected token_mean, seq_mean_token_mean or seq_mean_token_sum_norm"
    )


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, normaliser: float | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity to a scalar.

    * ``token_mean``: sum over every masked token / number of masked tokens (DAPO).
    * ``seq_mean_token_mean``: mean over tokens within each sequence, then over sequences (GRPO's original).
    * ``seq_mean_token_sum_norm``: sum over tokens / (T * number of sequences), Dr.GRPO's constant normaliser.

    ``normaliser`` replaces the :func:`denominator` of *this* batch: pass the
    whole batch's when a batch is split across workers or micro-batches.
    """
    mask = mask.to(per_token.dtype)
    if normaliser is None:
        normaliser = denominator(mode, per_token.shape[0], float(mask.sum()), per_token.shape[1])
    masked = per_token * mask
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    return masked.sum() / normaliser


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(r) - r - 1 with r = ref - logp (>= 0)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def policy_loss(
    batch: PolicyBatch, cfg: LossConfig, variant: str = "ppo_clip", normaliser: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of ``variant`` (see ``POLICY_LOSSES``) and its metrics."""
    if variant not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {variant!r}; known: {', '.join(POLICY_LOSSES)}")
    per_token, extras = POLICY_LOSSES[variant](batch, cfg)
    if cfg.kl_coef:
        if batch.ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (a frozen reference policy's logprobs)")
        kl = kl_k3(batch.logp, batch.ref_logp)
        per_token = per_token + cfg.kl_coef * kl
        extras["kl"] = kl.detach()
    if cfg.entropy_coef:
        if batch.entropy is None:
            raise ValueError("entropy_coef > 0 needs the policy's token entropy")
        per_token = per_token - cfg.entropy_coef * batch.entropy
    if batch.entropy is not None:
        extras["entropy"] = batch.entropy.detach()
    loss = aggregate(per_token, batch.mask, cfg.aggregation, normaliser)
    mask = batch.mask.to(per_token.dtype)
    tokens = mask.sum().clamp(min=1)
    metrics = {name: float((value * mask).sum() / tokens) for name, value in extras.items()}
    return loss, metrics
