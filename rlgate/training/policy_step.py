"""One GRPO training step on one worker, in plain torch (no Ray).

``train_driver.py`` runs this inside Ray Train workers; tests run it directly.

Records from the TrajectoryStore become a :class:`TrainBatch` aligned to
*predicted* tokens: position ``t`` holds the token ``input_ids[t + 1]``, its
loss-mask bit, its behaviour logprob and the policy version that sampled it.
A step then:

1. drops every sampled token older than ``version - max_staleness`` (counted);
2. takes the proximal log-probs of the current weights (with one update per
   batch and no dropout, each micro-batch's own training forward, detached;
   otherwise a no-grad pass before the first update) and reports the
   train/rollout mismatch on tokens sampled by this very version;
3. takes ``updates_per_batch`` optimizer steps, each over ``grad_accumulation``
   micro-batches whose losses are normalised by the *global* token or
   sequence count, so splitting (micro-batches, data-parallel workers) does
   not change the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlgate.sessions.trajectory import TrajectoryRecord
from rlgate.training.grpo import LossConfig, PolicyBatch, denominator, policy_loss


@dataclass
class TrainBatch:
    """[B, T] tensors aligned to predicted tokens (T = longest sequence - 1)."""

    input_ids: torch.Tensor  # [B, T + 1] right-padded inputs
    attention_mask: torch.Tensor  # [B, T + 1]
    loss_mask: torch.Tensor  # [B, T] 1 on sampled tokens to train on
    behaviour_logp: torch.Tensor  # [B, T]
    versions: torch.Tensor  # [B, T] -1 on tokens the model did not sample
    advantages: torch.Tensor  # [B]
    temperatures: torch.Tensor  # [B, T] the sampling temperature of each token (1 where not sampled)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice) -> TrainBatch:
        return TrainBatch(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    def to(self, device: torch.device) -> TrainBatch:
        """The batch on ``device`` (collated on the CPU; the model may be on a GPU)."""
        return TrainBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def shard(rows: list, rank: int, world: int) -> list:
    """Rank ``rank``'s share of ``rows``, padded so every rank gets as many rows
    (and so runs as many forward/backward passes): padding rows have no loss."""
    mine = rows[rank::world]
    width = math.ceil(len(rows) / world)
    padding = {**rows[0][0], "loss_mask": [0] * len(rows[0][0]["loss_mask"])}
    return mine + [(padding, 0.0)] * (width - len(mine))


def collate(records: list[TrajectoryRecord], advantages: list[float], pad_id: int = 0) -> TrainBatch:
    """Records (``input_ids``, ``loss_mask``, ``logprobs``, ``versions``, and
    ``temperatures`` when present) to a TrainBatch."""
    width = max(len(r["input_ids"]) for r in records)
    rows = len(records)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width - 1))
    behaviour = torch.zeros((rows, width - 1))
    versions = torch.full((rows, width - 1), -1, dtype=torch.long)
    temperatures = torch.ones((rows, width - 1))
    for row, record in enumerate(records):
        n = len(record["input_ids"])
        ids[row, :n] = torch.tensor(record["input_ids"])
        attention[row, :n] = 1
        mask[row, : n - 1] = torch.tensor(record["loss_mask"][1:], dtype=torch.float32)
        behaviour[row, : n - 1] = torch.tensor(record["logprobs"][1:], dtype=torch.float32)
        versions[row, : n - 1] = torch.tensor(record["versions"][1:])
        if record.get("temperatures"):
            temperatures[row, : n - 1] = torch.tensor(record["temperatures"][1:], dtype=torch.float32)
    advantages_t = torch.tensor(advantages, dtype=torch.float32)
    return TrainBatch(ids, attention, mask, behaviour, versions, advantages_t, temperatures)


def token_logprobs(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """[B, T] log-probs of each predicted token under ``model`` (float32), from
    the distribution it was sampled from: logits over the sampling temperature
    (greedy tokens, temperature 0, are scored at 1)."""
    return logprobs_and_entropy(model, batch)[0]


def logprobs_and_entropy(model: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` and the [B, T] entropy of each of those distributions."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    temperatures = torch.where(batch.temperatures > 0, batch.temperatures, torch.ones_like(batch.temperatures))
    all_logp = torch.log_softmax(logits / temperatures[..., None], dim=-1)
    entropy = -(all_logp.exp() * all_logp).sum(-1)
    return all_logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1), entropy


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether training mode changes ``model``'s outputs: a dropout module (a
    LoRA adapter's, say) or a ``*dropout`` / ``*pdrop`` setting in its config
    above zero (transformers applies attention dropout functionally)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")}
    return any(
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        for config in configs.values()
        for key, value in config.to_dict().items()
        if key.endswith(("dropout", "pdrop"))
    )


@dataclass
class StepSettings:
    variety_loss: str = "ppo_clip"  # a key of rlgate.training.grpo.POLICY_LOSSES
    loss: LossConfig = LossConfig()
    max_staleness: int = 0
    updates_per_batch: int = 1
    grad_accumulation: int = 1
    max_grad_norm: float = 1.0
    bf16: bool = False  # bfloat16 autocast around the forward passes (weights stay float32)


class PolicyTrainer:
    """Owns a model and its optimizer; ``step`` is one GRPO update."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        settings: StepSettings,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.model, self.optimizer, self.settings, self.reference = model, optimizer, settings, reference
        self.dropout = has_dropout(model)

    def step(
        self, batch: TrainBatch, version: int, global_normaliser: float | None = None, scale: float = 1.0
    ) -> dict[str, float]:
        """Train on ``batch`` as the policy at ``version``; return metrics.

        ``global_normaliser`` is the loss denominator over every worker's part
        of the batch (default: this part alone); ``scale`` multiplies the loss,
        e.g. by the world size to undo data-parallel gradient averaging.
        """
        s = self.settings
        on = next(self.model.parameters()).device
        batch, device = batch.to(on), on.type
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=s.bf16)
        sampled = batch.versions >= 0
        stale = sampled & (batch.versions < version - s.max_staleness) & (batch.loss_mask > 0)
        mask = batch.loss_mask * (~stale).float()
        # One update and no dropout: the weights do not move before the last micro-batch's backward, so each
        # micro-batch's own forward, detached, is its proximal policy and no separate pass is needed (as TRL
        # does with num_iterations = 1). Otherwise a no-grad pass before the first update, in eval mode.
        single = s.updates_per_batch == 1 and not self.dropout
        with torch.no_grad(), autocast:
            self.model.eval()
            proximal = torch.zeros_like(mask) if single else token_logprobs(self.model, batch)
            reference = token_logprobs(self.reference, batch) if self.reference is not None else None
        whole = global_normaliser or denominator(s.loss.aggregation, mask.shape[0], float(mask.sum()), mask.shape[1])
        self.model.train()
        losses = []
        for _ in range(s.updates_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            weighted: dict[str, float] = {}  # the update's loss metrics over every micro-batch, by tokens
            tokens = 0.0
            for part in torch.arange(len(batch)).tensor_split(s.grad_accumulation):
                if len(part) == 0:
                    continue
                rows = slice(int(part[0]), int(part[-1]) + 1)
                micro = batch.rows(rows)
                with autocast:
                    logp, entropy = logprobs_and_entropy(self.model, micro)
                if single:
                    proximal[rows] = logp.detach()
                loss, metrics = policy_loss(
                    PolicyBatch(
                        logp=logp,
                        entropy=entropy,
                        old_logp=proximal[rows],
                        advantages=micro.advantages,
                        mask=mask[rows],
                        behaviour_logp=micro.behaviour_logp,
                        ref_logp=reference[rows] if reference is not None else None,
                    ),
                    s.loss,
                    s.variety_loss,
                    normaliser=whole,
                )
                (loss * scale).backward()
                total += loss.item()
                part_tokens = float(mask[rows].sum())
                for name, value in metrics.items():
                    weighted[name] = weighted.get(name, 0.0) + value * part_tokens
                tokens += part_tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
            self.optimizer.step()
            losses.append(total)
        self.model.eval()
        current = (batch.versions == version) & (mask > 0)
        mismatch = (proximal - batch.behaviour_logp).abs()[current]
        return {
            "loss": losses[-1],
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            "trained_tokens": float(mask.sum()),
            "stale_tokens_dropped": float(stale.sum()),
            "logprob_mismatch_mean": float(mismatch.mean()) if mismatch.numel() else 0.0,
            "logprob_mismatch_max": float(mismatch.max()) if mismatch.numel() else 0.0,
            **{f"loss_{k}": v / tokens if tokens else 0.0 for k, v in weighted.items()},
        }


_SUMMED = ("loss", "trained_tokens", "stale_tokens_dropped")  # each rank's share of the batch
_BY_TOKENS = ("logprob_mismatch_mean",)  # and every loss_* metric: means over each rank's tokens


def across_ranks(results: dict[int, dict[str, float]]) -> dict[str, float]:
    """One step's metrics over every worker's part of the batch: shares summed, means
    weighted by each rank's tokens, maxima (``*_max``, times, memory) the largest,
    the rest (the gradient norm, all-reduced) rank 0's."""
    ranks = [results[rank] for rank in sorted(results)]
    combined = dict(ranks[0])
    tokens = sum(r.get("trained_tokens", 0.0) for r in ranks)
    for name in combined:
        values = [r[name] for r in ranks if name in r]
        if name in _SUMMED:
            combined[name] = sum(values)
        elif name in _BY_TOKENS or name.startswith("loss_"):
            weights = [r.get("trained_tokens", 0.0) for r in ranks if name in r]
            combined[name] = sum(v * w for v, w in zip(values, weights)) / tokens if tokens else values[0]
        elif name.endswith(("_max", "_s", "_mib")):
            combined[name] = max(values)
    return combined
