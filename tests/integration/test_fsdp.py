"""``[compute] strategy = "fsdp"``: two trainer workers (processes on gloo, as Ray
Train sets them up on CPU) shard tiny-random with FSDP2 and take a GRPO step
each on their half of the batch; the gathered weights are those of one step
on the whole batch in one process. The same holds with gradient checkpointing.
Ray Train's own workers run it in the FSDP driver run (tests/system/test_training.py)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import free_port


def batch_rows():
    """Eight rows of prompts and sampled tokens with advantages of both signs."""
    rows = []
    for i in range(8):
        prompt = [1 + i, 20, 30 + i, 40]
        rows.append(
            (
                {
                    "input_ids": prompt + [100 + i, 200 + i, 300 + i],
                    "loss_mask": [0] * 4 + [1, 1, 1],
                    "logprobs": [0.0] * 4 + [-6.0, -6.0, -6.0],
                    "versions": [-1] * 4 + [0, 0, 0],
                },
                1.0 if i % 2 else -1.0,
            )
        )
    return rows


def settings():
    from rlgate.training.grpo import LossConfig
    from rlgate.training.policy_step import StepSettings

    return StepSettings(loss=LossConfig(aggregation="token_mean"))


def one_step(model, rows, normaliser=None, scale=1.0):
    from rlgate.training.policy_step import PolicyTrainer, collate

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    batch = collate([r for r, _ in rows], [a for _, a in rows])
    return PolicyTrainer(model, optimizer, settings()).step(batch, version=0, global_normaliser=normaliser, scale=scale)


def worker(rank: int, world: int, port: int, path: str, checkpointing: bool, out: dict, backend: str = "gloo") -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlgate.training import strategy
    from rlgate.training.policy_step import shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on the CPU
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        prepared = strategy.prepare(model, "fsdp", gradient_checkpointing=checkpointing, device=device)
        assert type(next(prepared.model.parameters())).__name__ == "DTensor"  # sharded, not replicated
        mine = shard(batch_rows(), rank, world)
        normaliser = float(sum(sum(r["loss_mask"][1:]) for r, _ in batch_rows()))  # token_mean: every token
        metrics = one_step(prepared.model, mine, normaliser, scale=float(world))
        weights = strategy.full_state_dict(prepared, rank)
        if rank == 0:
            out["weights"], out["grad_norm"] = weights, metrics["grad_norm"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_fsdp_workers_take_the_step_one_process_takes_on_the_whole_batch(tiny_path, reference_model, checkpointing):
    same_step_as_one_process(tiny_path, reference_model, checkpointing, "gloo")


@pytest.mark.gpu
def test_fsdp_on_nccl_takes_the_same_step(tiny_path, reference_model):
    """The GPU path (scripts/gpu_check.sh): FSDP2 over NCCL, one GPU per worker."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"FSDP over NCCL needs two GPUs, one per worker (this machine has {torch.cuda.device_count()})")
    same_step_as_one_process(tiny_path, reference_model, False, "nccl")


def same_step_as_one_process(tiny_path, reference_model, checkpointing: bool, backend: str) -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(2, free_port(), str(tiny_path), checkpointing, out, backend), nprocs=2)
        weights, grad_norm = dict(out["weights"]), out["grad_norm"]
    whole = copy.deepcopy(reference_model)
    expected = one_step(whole, batch_rows())
    assert abs(grad_norm - expected["grad_norm"]) < 1e-4 * expected["grad_norm"]
    moved = 0.0
    tied = {"lm_head.weight"} if whole.config.tie_word_embeddings else set()
    assert set(whole.state_dict()) - set(weights) == tied  # a tied head is the embedding, sent once
    for name, tensor in whole.state_dict().items():
        if name in tied:
            continue
        assert torch.allclose(weights[name], tensor, atol=1e-6), name
        moved = max(moved, float((tensor - reference_model.state_dict()[name]).abs().max()))
    assert moved > 1e-3  # the step changed the weights: the comparison can fail
