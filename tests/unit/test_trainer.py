"""One GRPO step in plain torch, on completions the real HF engine sampled from tiny-random."""

from __future__ import annotations

import copy

import pytest
import torch

from rlgate.rollout.engines import SamplingParams, collect
from rlgate.training.grpo import LossConfig, group_advantages
from rlgate.training.policy_step import (
    PolicyTrainer,
    StepSettings,
    TrainBatch,
    collate,
    has_dropout,
    token_logprobs,
)


def test_collate_aligns_everything_to_the_predicted_token():
    record = {
        "input_ids": [5, 6, 7, 8],
        "loss_mask": [0, 0, 1, 1],
        "logprobs": [0.0, 0.0, -1.0, -2.0],
        "versions": [-1, -1, 3, 3],
    }
    batch = collate(
        [
            record,
            {
                **record,
                "input_ids": [5, 6, 7],
                "loss_mask": [0, 1, 1],
                "logprobs": [0, -0.5, -1.5],
                "versions": [-1, 2, 2],
            },
        ],
        [1.0, -1.0],
        pad_id=0,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert batch.behaviour_logp.tolist() == [[0.0, -1.0, -2.0], [-0.5, -1.5, 0.0]]
    assert batch.versions.tolist() == [[-1, 3, 3], [2, 2, -1]]


@pytest.fixture(scope="module")
async def sampled(hf_engine, prompts):
    """4 prompts x 4 samples from the engine, with rewards: 1 when the completion holds token 403."""
    records, rewards, groups = [], [], []
    for group, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=group, ignore_eos=True)
        for completion in await collect(hf_engine.generate(prompt, params), n=4):
            records.append(
                {
                    "input_ids": prompt + completion.token_ids,
                    "loss_mask": [0] * len(prompt) + [1] * len(completion.token_ids),
                    "logprobs": [0.0] * len(prompt) + completion.logprobs,
                    "versions": [-1] * len(prompt) + completion.versions,
                }
            )
            rewards.append(float(403 in completion.token_ids) + 0.1 * completion.token_ids.count(220))
            groups.append(group)
    advantages = group_advantages(torch.tensor(rewards), torch.tensor(groups))
    return collate(records, advantages.tolist())


def make_trainer(model, optimizer=torch.optim.AdamW, **settings) -> PolicyTrainer:
    model = copy.deepcopy(model)
    return PolicyTrainer(model, optimizer(model.parameters(), lr=1e-3), StepSettings(**settings))


def sequence_logprobs(model, batch: TrainBatch) -> torch.Tensor:
    with torch.no_grad():
        return (token_logprobs(model, batch) * batch.loss_mask).sum(-1)


@pytest.mark.parametrize("variety_loss", ["ppo_clip", "cispo"])
def test_a_step_moves_probability_towards_positive_advantages(sampled, reference_model, variety_loss):
    trainer = make_trainer(reference_model, loss=LossConfig(aggregation="token_mean"), variety_loss=variety_loss)
    before = sequence_logprobs(trainer.model, sampled)
    metrics = trainer.step(sampled, version=0)
    change = sequence_logprobs(trainer.model, sampled) - before
    positive, negative = sampled.advantages > 0, sampled.advantages < 0
    assert positive.any() and negative.any()
    assert change[positive].mean() > change[negative].mean()
    # the engine's behaviour logprobs are the trainer's own, for tokens sampled by this version
    assert metrics["logprob_mismatch_max"] < 1e-4 and metrics["stale_tokens_dropped"] == 0
    assert metrics["trained_tokens"] == float(sampled.loss_mask.sum())


@pytest.mark.gpu
def test_a_step_on_a_gpu_model_takes_the_batch_collated_on_the_cpu(sampled, reference_model):
    """The batch is collated on the CPU; a worker's model is on its GPU (Ray Train
    moves it, and wraps it in nothing with one worker): the step moves the batch."""
    on_cpu = make_trainer(reference_model)
    on_gpu = make_trainer(copy.deepcopy(reference_model).cuda())
    cpu, gpu = on_cpu.step(sampled, version=0), on_gpu.step(sampled, version=0)
    assert gpu["trained_tokens"] == cpu["trained_tokens"] and abs(gpu["loss"] - cpu["loss"]) < 1e-3


def test_a_bf16_autocast_step_learns_the_same_way_at_bf16_precision(sampled, reference_model):
    """[training] bf16: the forward and backward run in bfloat16, the weights stay float32."""
    trainer = make_trainer(reference_model, loss=LossConfig(aggregation="token_mean"), bf16=True)
    before = sequence_logprobs(trainer.model, sampled)
    metrics = trainer.step(sampled, version=0)
    change = sequence_logprobs(trainer.model, sampled) - before
    assert change[sampled.advantages > 0].mean() > change[sampled.advantages < 0].mean()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # the engine sampled in float32: bf16's 8-bit mantissa shows in the mismatch, within its rounding
    assert 1e-4 < metrics["logprob_mismatch_max"] < 0.5


def test_tokens_older_than_the_staleness_bound_are_dropped(sampled, reference_model):
    sampled_tokens = float(sampled.loss_mask.sum())
    too_old = make_trainer(reference_model, max_staleness=1).step(sampled, version=3)  # sampled at 0 < 3 - 1
    assert too_old.get("trained_tokens") == 0 and too_old["stale_tokens_dropped"] == sampled_tokens
    fresh_enough = make_trainer(reference_model, max_staleness=3, variety_loss="decoupled_ppo").step(sampled, version=3)
    assert fresh_enough["stale_tokens_dropped"] == 0 and fresh_enough["trained_tokens"] == sampled_tokens


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_give_the_same_update_as_one_batch(sampled, reference_model, aggregation):
    loss = LossConfig(aggregation=aggregation, clip_high=0.28)
    # SGD: the update is linear in the gradient (Adam would magnify float rounding of tiny gradients)
    whole = make_trainer(reference_model, torch.optim.SGD, loss=loss, grad_accumulation=1)
    split = make_trainer(reference_model, torch.optim.SGD, loss=loss, grad_accumulation=4)
    whole.step(sampled, version=0)
    split.step(sampled, version=0)
    for a, b in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(a, b, atol=1e-7)


@pytest.mark.parametrize("variety_loss", ["ppo_clip", "cispo", "decoupled_ppo"])
def test_one_update_takes_its_proximal_policy_from_the_training_pass(sampled, reference_model, variety_loss):
    """With one update per batch the training forward, detached, is the proximal
    policy: the same update and mismatch as a separate no-grad pass, one pass fewer."""
    fused = make_trainer(reference_model, torch.optim.SGD, variety_loss=variety_loss, grad_accumulation=2)
    separate = make_trainer(reference_model, torch.optim.SGD, variety_loss=variety_loss, grad_accumulation=2)
    separate.dropout = True  # as for a model with dropout: the no-grad pass in eval mode first
    forwards = []
    fused.model.register_forward_hook(lambda *_: forwards.append(1))
    fused_metrics, separate_metrics = fused.step(sampled, version=0), separate.step(sampled, version=0)
    assert len(forwards) == 2  # one per micro-batch, none before
    for a, b in zip(fused.model.parameters(), separate.model.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    for key in ("logprob_mismatch_mean", "logprob_mismatch_max", "loss"):
        assert fused_metrics[key] == pytest.approx(separate_metrics[key], abs=1e-6), key
    assert fused_metrics["logprob_mismatch_max"] < 1e-4


def test_dropout_anywhere_in_the_model_is_found(reference_model):
    """A dropout module (a LoRA adapter's) or a config's attention dropout makes
    training mode differ from eval mode; the reference model has neither."""
    assert not has_dropout(reference_model)
    with_module = copy.deepcopy(reference_model)
    with_module.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.05), with_module.lm_head)
    assert has_dropout(with_module)
    with_config = copy.deepcopy(reference_model)
    with_config.config.attention_dropout = 0.1
    assert has_dropout(with_config)


def test_several_updates_per_batch_use_the_ratio_clip(sampled, reference_model):
    trainer = make_trainer(reference_model, updates_per_batch=3, loss=LossConfig(clip_low=0.05, clip_high=0.05))
    metrics = trainer.step(sampled, version=0)
    assert metrics["loss_clip_fraction"] > 0  # after the first update the ratio leaves [0.95, 1.05] somewhere


async def test_logprobs_are_scored_at_the_sampling_temperature(hf_engine, prompts, reference_model):
    params = SamplingParams(max_tokens=12, temperature=0.6, n=2, seed=7, ignore_eos=True)
    records = []
    for completion in await collect(hf_engine.generate(prompts[0], params), n=2):
        n = len(prompts[0])
        records.append(
            {
                "input_ids": prompts[0] + completion.token_ids,
                "loss_mask": [0] * n + [1] * len(completion.token_ids),
                "logprobs": [0.0] * n + completion.logprobs,
                "versions": [-1] * n + completion.versions,
                "temperatures": [1.0] * n + [0.6] * len(completion.token_ids),
            }
        )
    batch = collate(records, [1.0, -1.0])
    mask = batch.loss_mask > 0
    with torch.no_grad():
        scored = token_logprobs(reference_model, batch)
        at_one = token_logprobs(reference_model, collate([{**r, "temperatures": []} for r in records], [1.0, -1.0]))
    assert (scored - batch.behaviour_logp)[mask].abs().max() < 1e-4  # the distribution the engine sampled from
    assert (at_one - batch.behaviour_logp)[mask].abs().max() > 1e-2  # temperature 1 would not be
    metrics = make_trainer(reference_model).step(batch, version=0)
    assert metrics["logprob_mismatch_max"] < 1e-4


@pytest.mark.parametrize("rows,world", [(8, 2), (7, 2), (5, 3), (1, 4)])
def test_every_row_goes_to_one_worker_and_every_worker_runs_as_many(rows, world):
    """The worker's share of a batch: rows dealt round-robin, each exactly once;
    shorter shares padded with rows that carry no loss, so every worker runs the
    same number of passes (DDP's all-reduce waits for all of them)."""
    from rlgate.training.policy_step import shard

    batch = [({"seq": i, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, float(i + 1)) for i in range(rows)]
    shares = [shard(batch, rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # as many rows each
    real = [(r["seq"], a) for share in shares for r, a in share if any(r["loss_mask"])]
    assert sorted(real) == [(i, float(i + 1)) for i in range(rows)]  # each row once, with its advantage
    padding = [(r, a) for share in shares for r, a in share if not any(r["loss_mask"])]
    assert len(padding) == world * -(-rows // world) - rows and all(a == 0.0 for _, a in padding)


def test_a_steps_loss_metrics_cover_every_micro_batch(sampled, reference_model):
    """The loss_* figures came from the last micro-batch alone: with gradient
    accumulation they changed though the update was the same."""
    settings = dict(loss=LossConfig(aggregation="token_mean"))
    whole = make_trainer(reference_model, **settings).step(sampled, version=0)
    parts = make_trainer(reference_model, grad_accumulation=2, **settings).step(sampled, version=0)
    for name in ("loss_entropy", "loss_ratio", "trained_tokens", "loss"):
        assert parts[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name


def test_metrics_across_ranks_sum_shares_weight_means_and_take_maxima():
    from rlgate.training.policy_step import across_ranks

    ranks = {
        1: {"loss": 0.25, "trained_tokens": 30.0, "loss_entropy": 2.0, "logprob_mismatch_max": 0.3, "compute_s": 2.0},
        0: {"loss": 0.5, "trained_tokens": 10.0, "loss_entropy": 1.0, "logprob_mismatch_max": 0.1, "compute_s": 1.0},
    }
    ranks[0]["grad_norm"] = ranks[1]["grad_norm"] = 0.7
    combined = across_ranks(ranks)
    assert combined["loss"] == 0.75 and combined["trained_tokens"] == 40.0 and combined["grad_norm"] == 0.7
    assert combined["loss_entropy"] == pytest.approx(1.75) and combined["logprob_mismatch_max"] == 0.3
    assert combined["compute_s"] == 2.0
