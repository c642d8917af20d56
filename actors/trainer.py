"""GRPO trainer workers: :func:`train_worker`, the function Ray Train runs on
each worker, and :class:`TrainerWorkers`, the driver's handle on them.

Created by ``train_driver.py`` through :class:`TrainerWorkers` (a ``TorchTrainer``): ``[compute]
trainer_workers`` workers on a placement group that Ray Train reserves (GPU
bundles when ``gpus_per_worker`` > 0, CPU bundles otherwise), data parallel
(DDP; gloo on CPU). Called through the run's TrainChannel: each command is a
training step on a batch (every worker takes its share of the rows), and
optionally a checkpoint. After a step, rank 0 publishes the new weights to
the PolicyStore, from which every RolloutServer replica loads them.
Owns: the policy model, its optimizer, and a frozen reference when
``[algorithm] kl_coef`` > 0. With ``[training.lora]`` the model is the base
with a trainable PEFT adapter; rank 0 publishes the adapter alone
(:class:`rlgate.rollout.lora.Adapter`), and the KL reference is the same
model with its adapter switched off. A worker restarted by Ray Train resumes from the
latest checkpoint: weights, optimizer, and the next command to run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
from ray.train import Checkpoint

from rlgate.actors.policy_store import Republisher
from rlgate.config import RLGateConfig
from rlgate.rollout import lora
from rlgate.run import (
    ADAPTER,
    CHECKPOINTS,
    MERGED,
    MODEL,
    NAMESPACE,
    STATE_FILE,
    checkpoint_name,
    checkpoint_states,
    checkpoints_dir,
)
from rlgate.training import strategy
from rlgate.training.grpo import LossConfig
from rlgate.training.loop import surviving
from rlgate.training.policy_step import PolicyTrainer, StepSettings, across_ranks, collate, shard

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def step_settings(settings: RLGateConfig) -> StepSettings:
    training = settings.training
    algorithm = settings.algorithm.resolved(training.max_staleness)
    return StepSettings(
        variety_loss=algorithm.loss,
        loss=LossConfig(
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            behaviour_weight_cap=algorithm.behaviour_weight_cap,
            aggregation=algorithm.aggregation,
            kl_coef=algorithm.kl_coef,
            entropy_coef=algorithm.entropy_coef,
        ),
        max_staleness=training.max_staleness,
        updates_per_batch=training.updates_per_batch,
        grad_accumulation=training.grad_accumulation,
        max_grad_norm=training.max_grad_norm,
        bf16=training.bf16,
    )


def train_worker(setup: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_reports()

    settings = RLGateConfig.model_validate(setup["settings"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    try:
        channel = ray.get_actor(setup["channel"], namespace=NAMESPACE)
        if ray.get(channel.stopped_before_any_step.remote()):  # the run ended while its workers started
            return
    except (ValueError, ray.exceptions.RayActorError):  # the channel is gone: so is the driver that sent steps
        return
    policy = ray.get_actor(setup["policy"], namespace=NAMESPACE)
    torch.manual_seed(settings.training.seed)
    if settings.compute.threads_per_worker is not None:  # else Ray's OMP_NUM_THREADS: the CPUs it reserves
        torch.set_num_threads(settings.compute.threads_per_worker)
    tokenizer = AutoTokenizer.from_pretrained(setup["model_path"])
    pad_id = tokenizer.pad_token_id or 0

    index, optimizer_state, adapting, covered = 0, None, settings.training.lora, None
    with _resume_from(ray.train.get_checkpoint(), ray.get(channel.first_held.remote()), setup) as folder:
        if folder is None:
            model = AutoModelForCausalLM.from_pretrained(setup["model_path"], dtype=torch.float32)
            if adapting is not None:
                model = lora.attach(model, adapting, settings.model.adapter)
        else:  # a restart after a failure, or --resume
            state = json.loads((folder / STATE_FILE).read_text())
            index, covered = state["next_command"], state.get("metrics")
            if adapting is not None:  # the base model and the checkpoint's adapter
                base = AutoModelForCausalLM.from_pretrained(setup["model_path"], dtype=torch.float32)
                model = lora.attach(base, adapting, folder / ADAPTER)
            else:
                model = AutoModelForCausalLM.from_pretrained(folder / MODEL, dtype=torch.float32)
            optimizer_state = torch.load(folder / "optimizer.pt", weights_only=True)
    reference = None
    if settings.algorithm.kl_coef > 0 and adapting is not None:
        reference = lora.WithoutAdapter(model)  # the base under the adapter: no second copy
    elif settings.algorithm.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(setup["model_path"], dtype=torch.float32).eval()
    prepared = strategy.prepare(model, settings.compute.strategy, settings.training.gradient_checkpointing)
    if torch.cuda.is_available():  # the peak while training, not while loading and sharding
        torch.cuda.reset_peak_memory_stats()
    model, plain = prepared.model, prepared.plain
    if isinstance(reference, torch.nn.Module):
        reference = strategy.shard_reference(reference, settings.compute.strategy)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=settings.training.learning_rate,
        weight_decay=settings.training.weight_decay,
    )
    if optimizer_state is not None:
        strategy.load_optimizer_state(prepared, optimizer, optimizer_state)
    trainer = PolicyTrainer(model, optimizer, step_settings(settings), reference)

    if covered is not None:  # the driver may still wait for the step this checkpoint ended with
        # the checkpoint holds rank 0's figures; the ranks' shards are alike in size, so they stand for each
        ray.get(channel.done_at_checkpoint.remote(index - 1, rank, covered))
    republisher = Republisher(policy) if rank == 0 else None
    while (command := ray.get(channel.fetch.remote(index)))["op"] != "stop":
        records, advantages = ray.get(command["batch"][0])
        rows = shard(list(zip(records, advantages)), rank, world)
        batch = collate([r for r, _ in rows], [a for _, a in rows], pad_id)
        began = time.perf_counter()
        metrics = trainer.step(batch, command["version"], command["normaliser"], scale=float(world))
        stepped = time.perf_counter()
        metrics["compute_s"] = stepped - began  # forward, backward and optimizer step
        metrics["peak_memory_mib"], metrics["threads"] = peak_memory_mib(), torch.get_num_threads()
        new_version = command["version"] + 1
        full = strategy.full_state_dict(prepared, rank) if adapting is None else None  # FSDP: every rank gathers
        if rank == 0:
            weights = lora.adapter_of(plain) if adapting is not None else full
            published = surviving(lambda: policy.status.remote(), "the published version")["version"]
            # A restarted worker repeats the steps after its checkpoint: those published already are
            # not again, except the last, whose weights' object died with the worker that owned it.
            again = new_version == published and republisher.latest is None
            if new_version > published or again:
                ref = [ray.put(weights)]
                # made again after a store restart: its saved version then equals this one, weights lost
                surviving(lambda v=new_version, r=ref, a=again: policy.publish.remote(v, r, a), "publishing")
                republisher.published(new_version, ref)  # kept: a restarted store gets it again
        metrics["publish_s"] = time.perf_counter() - stepped  # weights gathered and handed to the PolicyStore
        # Every step's metrics go to Ray Train (a collective: every worker reports), with a checkpoint when due.
        save = None
        if command.get("save"):  # the optimizer's state is gathered by every rank under FSDP
            optimizer_state = strategy.optimizer_state(prepared, optimizer)
            save = (plain, full, tokenizer, optimizer_state, index + 1, command.get("driver_state"))
        merged = setup["model_path"] if adapting is not None and adapting.save_merged else None
        _report(metrics, new_version, rank, save, merged)  # a worker dying from here on: see done_at_checkpoint
        ray.get(channel.done.remote(index, rank, metrics))
        index += 1


def peak_memory_mib() -> float:
    """This worker's peak memory so far: GPU memory allocated on a GPU, else resident memory."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@contextlib.contextmanager
def _resume_from(checkpoint, first_held: int, setup: dict):
    """The checkpoint folder to start from (None: the base model). Ray Train's, unless
    it lost track of a newer one the driver saw finish (a worker killed right after
    reporting it): the channel no longer holds the commands before ``first_held``, so
    the worker must start from the checkpoint on disk that resumes exactly there."""
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(checkpoint.as_directory())) if checkpoint is not None else None
        resumes_at = json.loads((folder / STATE_FILE).read_text())["next_command"] if folder else 0
        if resumes_at < first_held:
            states = checkpoint_states(setup["checkpoints"])
            found = [folder for folder, state in states.items() if state["next_command"] == first_held]
            if not found:
                raise RuntimeError(f"no checkpoint resumes at command {first_held} under {setup['checkpoints']}")
            folder = found[0]
        yield folder


def _quiet_reports() -> None:
    """Ray Train logs an INFO line per ``ray.train.report``; a step per report
    would scroll them over the driver's progress bar. Best effort: a private module."""
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    context.logger.setLevel(logging.WARNING)


def _report(metrics: dict, version: int, rank: int, save: tuple | None, merged: str | None = None) -> None:
    """``ray.train.report`` the step's metrics; with ``save``, also a checkpoint:
    the model in Hugging Face format (loadable by transformers and vLLM), the
    optimizer, and where to resume. A LoRA model saves its adapter alone, in
    PEFT format, in ``adapter/`` (and with ``merged``, the base model's folder,
    base + adapter in ``merged/``)."""
    if save is None:
        ray.train.report({**metrics, "version": version})
        return
    model, weights, tokenizer, optimizer_state, next_command, driver_state = save
    with tempfile.TemporaryDirectory(prefix="rlgate-checkpoint-") as folder:
        checkpoint = None
        if rank == 0:
            if hasattr(model, "peft_config"):
                model.save_pretrained(Path(folder) / ADAPTER)
                if merged:
                    _save_merged(model, merged, tokenizer, Path(folder) / MERGED)
            else:
                model.save_pretrained(Path(folder) / MODEL, safe_serialization=True, state_dict=weights)
                tokenizer.save_pretrained(Path(folder) / MODEL)
            torch.save(optimizer_state, Path(folder) / "optimizer.pt")
            # the step's metrics too: a worker dying before telling the driver tells it after its restart
            state = {"next_command": next_command, "version": version, "driver": driver_state, "metrics": metrics}
            (Path(folder) / STATE_FILE).write_text(json.dumps(state, default=float))
            checkpoint = Checkpoint.from_directory(folder)
        step = (driver_state or {}).get("step", version)
        ray.train.report(
            {**metrics, "version": version}, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_name(step)
        )


def _save_merged(model, base: str, tokenizer, folder: Path) -> None:
    """Base + adapter as one Hugging Face model at ``folder``, merged on the CPU from
    the base model's folder (not a copy of the training model on its device)."""
    lora.merged_model(base, lora.adapter_of(model)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


class TrainerWorkers:
    """The driver's handle on the run's Ray Train workers: Ray Train's
    ``TorchTrainer`` running :func:`train_worker` in a thread, driven one command
    at a time through the run's TrainChannel, behind a synchronous ``step``."""

    def __init__(
        self,
        setup: dict,
        channel: ActorHandle,
        workers: int,
        resources_per_worker: dict[str, float],
        storage: Path,
        max_failures: int = 3,
    ) -> None:
        """``channel``: the run's TrainChannel (named ``setup["channel"]``), made by the driver."""
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        self.channel = channel
        self.workers = workers
        self._trainer = TorchTrainer(
            train_worker,
            train_loop_config=setup | {"checkpoints": str(checkpoints_dir(storage))},
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=resources_per_worker.get("GPU", 0) > 0,
                resources_per_worker=resources_per_worker,
            ),
            run_config=RunConfig(
                name=CHECKPOINTS,  # so Ray Train's checkpoints land in the run's checkpoints_dir
                storage_path=str(storage),
                failure_config=FailureConfig(max_failures=max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=3),
            ),
        )
        self.error: BaseException | None = None
        self.stepped = False  # a step was sent: stopping waits for the workers from then on
        self._thread = threading.Thread(target=self._fit, name="ray-train-fit", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            self._trainer.fit()
        except BaseException as err:  # surfaced by step()
            self.error = err

    def step(
        self,
        records: list[dict],
        advantages: list[float],
        version: int,
        normaliser: float,
        save: bool = False,
        driver_state: dict | None = None,
        timeout_s: float = 3600,
    ) -> dict:
        """One optimizer step (or ``updates_per_batch``) on every worker; its metrics over all of them."""
        command = {
            "op": "step",
            "batch": [ray.put((records, advantages))],
            "version": version,
            "normaliser": normaliser,
            "save": save,
            "driver_state": driver_state,
        }
        self.stepped = True  # before the submit: a stop from then on waits for this step
        index = ray.get(self.channel.submit.remote(command))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.error is not None:
                raise RuntimeError(f"the trainer workers failed: {self.error}") from self.error
            results = ray.get(self.channel.wait.remote(index, self.workers, 5.0))
            if results is not None:
                if save:  # the checkpoint covers every command so far: let their batches go
                    ray.get(self.channel.forget_below.remote(index + 1))
                return across_ranks(results)
        raise TimeoutError(f"training step {index} did not finish within {timeout_s} s")

    def stop(self, timeout_s: float = 120) -> None:
        """Stop the workers, waiting up to ``timeout_s`` (a step under way finishes,
        its checkpoint saved). Before the first step nothing of the run is on them,
        so nothing is waited for (Ctrl-C while a run starts does not wait for its
        workers to load the model): a worker starting after this returns at once,
        and what is still starting ends with the driver's Ray job."""
        ray.get(self.channel.submit.remote({"op": "stop"}))
        if self.stepped:
            self._thread.join(timeout_s)
