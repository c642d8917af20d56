"""Sending trainer weights into rollout engines.

Three routes behind one call, ``push(version)``:

* :class:`FileWeightSender` (CPU, or any GPU placement): the state dict goes to
  ``engine.update_weights``, which stages it as a safetensors file in shared
  memory for vLLM's workers.
* :class:`IpcWeightSender` (GPU, trainer and engine on the same GPU): vLLM's
  trainer-side CUDA-IPC weight-transfer engine shares the trainer's parameters
  by handle; the engine maps them and loads in place. No copy through host
  memory. It talks to the engine through :class:`EngineSyncClient`, which
  implements vLLM's four-call ``VLLMWeightSyncClient`` protocol.
* :class:`AdapterSender` (``[training.lora]``): only the LoRA adapter goes,
  and the engine serves it as an adapter over its unchanged base weights.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlgate.rollout.engines.base import Engine, WeightUpdateReport


class FileWeightSender:
    """Pushes ``model.state_dict()`` through ``Engine.update_weights``."""

    def __init__(self, model: torch.nn.Module, engine: Engine) -> None:
        self.model, self.engine = model, engine

    async def push(self, version: int) -> WeightUpdateReport:
        return await self.engine.update_weights(self.model.state_dict(), version)


class AdapterSender:
    """Pushes the LoRA adapter of a PEFT ``model`` (:func:`rlgate.rollout.lora.adapter_of`)."""

    def __init__(self, model: torch.nn.Module, engine: Engine) -> None:
        self.model, self.engine = model, engine

    async def push(self, version: int) -> WeightUpdateReport:
        from rlgate.rollout.lora import adapter_of

        return await self.engine.update_weights(adapter_of(self.model), version)


class EngineSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (synchronous calls) over an rlgate
    VLLMEngine whose event loop runs in another thread."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self.next_version: int | None = None

    def _call(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call(self.engine.init_weight_transfer(init_info))

    def start_weight_update(self) -> None:
        self._call(self.engine.start_weight_transfer())

    def update_weights(self, update_info: dict) -> None:
        self._call(self.engine.receive_weight_transfer(update_info))

    def finish_weight_update(self) -> None:
        if self.next_version is None:
            raise RuntimeError("set the version to publish before sending weights")
        self._call(self.engine.finish_weight_transfer(self.next_version))


class IpcWeightSender:
    """Pushes a CUDA model's parameters into a VLLMEngine started with
    ``weight_transfer="ipc"`` on the same GPU."""

    def __init__(self, model: torch.nn.Module, engine: Any) -> None:
        self.model, self.engine = model, engine
        self._client: EngineSyncClient | None = None
        self._sender = None

    async def push(self, version: int) -> WeightUpdateReport:
        import time

        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        from rlgate.rollout.engines.base import WeightUpdateReport

        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        if self._sender is None:
            self._client = EngineSyncClient(self.engine, loop)
            self._sender = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init,
                IPCTrainerInitInfo(rank=0),
                client=self._client,
                source=ModuleSource(self.model),
            )
        self._client.next_version = version
        # send_weights blocks on the engine's coroutines, which need this loop.
        await asyncio.to_thread(self._sender.send_weights)
        tensors = sum(1 for _ in self.model.named_parameters())
        return WeightUpdateReport(version=version, seconds=time.perf_counter() - started, tensors=tensors)
