"""How a trainer worker holds its model: ``[compute] strategy`` and the
memory-saving switches of ``[training]``.

* ``ddp`` (default): every worker holds the whole model and optimizer; Ray
  Train's ``prepare_model`` wraps it in ``DistributedDataParallel``.
* ``fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), each
  decoder layer and then the whole model sharded over the workers, so every
  worker holds 1 / world of the parameters, gradients and AdamW state and
  gathers one layer at a time. Gradients are averaged as DDP averages them, so
  the loss scaling of :class:`rlgate.training.policy_step.PolicyTrainer` is the
  same. The full weights (to publish, or to checkpoint) are gathered by every
  worker together: :func:`full_state_dict` is a collective.
* ``gradient_checkpointing``: activations are recomputed in the backward pass
  instead of kept (transformers' own, non-reentrant).
* ``bf16`` autocast is applied by the policy step (``StepSettings.bf16``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Prepared:
    """The model as the optimizer and the step see it (``model``), and the
    Hugging Face model under any wrapper (``plain``)."""

    model: torch.nn.Module
    plain: torch.nn.Module
    strategy: str


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards one by one: the model's decoder layers
    (transformers names their class in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [module for module in model.modules() if type(module).__name__ in names]
    if not units:
        raise ValueError(f"{type(model).__name__} names no decoder layers (_no_split_modules); use strategy ddp")
    return units


def prepare(
    model: torch.nn.Module, strategy: str, gradient_checkpointing: bool = False, device: str | None = None
) -> Prepared:
    """``model`` made ready to train on this worker (its torch.distributed group set
    up, by Ray Train or a test) by ``strategy``, on ``device`` (default: Ray Train's)."""
    import torch

    if gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if strategy == "fsdp":
        sharded = _sharded(model, device)  # FSDP2 keeps the module's own class: no wrapper to unwrap
        return Prepared(sharded, sharded, strategy)
    import ray.train.torch

    wrapped = ray.train.torch.prepare_model(model)
    plain = wrapped.module if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else wrapped
    return Prepared(wrapped, plain, strategy)


def shard_reference(model: torch.nn.Module, strategy: str, device: str | None = None) -> torch.nn.Module:
    """A frozen reference model placed like the policy: sharded under FSDP, else on the
    policy's device (default: Ray Train's)."""
    if strategy == "fsdp":
        return _sharded(model, device)
    if device is None:
        import ray.train.torch

        device = ray.train.torch.get_device()
    return model.to(device)


def _sharded(model: torch.nn.Module, device: str | None) -> torch.nn.Module:
    """``model`` under FSDP2 on ``device``: each decoder layer a unit, then the rest.
    FSDP moves one unit at a time to the device as it shards it, so the whole
    model is never on the device at once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device is None:
        import ray.train.torch

        device = ray.train.torch.get_device()
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(prepared: Prepared, rank: int) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, on rank 0 (other ranks get ``{}``).
    Under FSDP every rank must call it (the shards are gathered)."""
    if prepared.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(prepared.model, options=options)
        # a tied weight (lm_head = the embedding) comes back as two copies: keep the one the model names
        own = {name for name, _ in prepared.model.named_parameters()} | {n for n, _ in prepared.model.named_buffers()}
        return {name: tensor for name, tensor in weights.items() if name in own}
    if rank != 0:
        return {}
    return {name: tensor.detach().cpu() for name, tensor in prepared.plain.state_dict().items()}


def optimizer_state(prepared: Prepared, optimizer) -> dict:
    """The optimizer's state to checkpoint (whole on rank 0 under FSDP; a collective there)."""
    if prepared.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(prepared.model, optimizer, options=options)
    return optimizer.state_dict()


def load_optimizer_state(prepared: Prepared, optimizer, state: dict) -> None:
    """Restore :func:`optimizer_state`'s output (every rank, whole, under FSDP)."""
    if prepared.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            prepared.model, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        )
        return
    optimizer.load_state_dict(state)
