"""Rollout engines behind one interface (:class:`rlgate.rollout.engines.base.Engine`).

``make_engine`` picks and builds one from the ``[rollout]`` config section;
vLLM and transformers are imported only by the engine that needs them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from rlgate.config import RolloutConfig
from rlgate.rollout.engines.base import (
    Completion,
    Engine,
    EngineHealth,
    RequestLog,
    SamplingParams,
    TokenChunk,
    WeightsMismatchError,
    WeightUpdateReport,
    collect,
    liveness_probe,
)

if TYPE_CHECKING:
    from rlgate.config import LoraSettings, RLGateConfig

__all__ = [
    "Completion",
    "Engine",
    "EngineHealth",
    "RequestLog",
    "SamplingParams",
    "TokenChunk",
    "WeightUpdateReport",
    "WeightsMismatchError",
    "collect",
    "liveness_probe",
    "make_engine",
    "resolve_engine_kind",
]


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_kind(kind: str) -> str:
    """``auto`` becomes ``vllm`` when vLLM is installed, else ``hf``."""
    if kind == "auto":
        return "vllm" if vllm_installed() else "hf"
    if kind == "vllm" and not vllm_installed():
        raise RuntimeError(
            "engine 'vllm' was asked for but vLLM is not installed: install rlgate[cpu] "
            '(x86-64 without a GPU) or rlgate[gpu], or set [rollout] engine = "hf"'
        )
    return kind


def make_engine(
    model_path: str | Path,
    rollout: RolloutConfig,
    dtype: str = "float32",
    initial_version: int = 0,
    lora: LoraSettings | None = None,
    adapter: str | Path | None = None,
) -> Engine:
    """Build (not start) the engine that ``rollout.engine`` names; call ``await engine.ready()``.

    ``lora`` (``[training.lora]``): the engine serves the LoRA adapters the trainer
    pushes; ``adapter``: a PEFT adapter folder it serves from the start (``[model] adapter``).
    """
    kind = resolve_engine_kind(rollout.engine)
    if kind == "vllm":
        from rlgate.config import engine_lora_rank
        from rlgate.rollout.engines.vllm import VLLMEngine
        from rlgate.rollout.lora import rank_of

        ranks = [lora.rank] if lora is not None else []
        ranks += [rank_of(adapter)] if adapter is not None else []
        lora_rank = engine_lora_rank(max(ranks)) if ranks else None

        return VLLMEngine(
            model_path,
            dtype=dtype,
            max_model_len=rollout.max_model_len,
            seed=rollout.seed,
            tensor_parallel_size=rollout.tensor_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            cpu_kv_cache_gib=rollout.kv_cache_gib,
            weight_transfer=rollout.weight_sync,
            initial_version=initial_version,
            lora_rank=lora_rank,
            max_loras=rollout.max_loras,
            adapter=adapter,
        )
    from rlgate.rollout.engines.hf import HFEngine

    return HFEngine(
        model_path,
        dtype=dtype,
        max_model_len=rollout.max_model_len,
        max_batch_size=rollout.max_batch_size,
        seed=rollout.seed,
        initial_version=initial_version,
        adapter=adapter,
    )


def run_engine(settings: RLGateConfig, model_path: str | Path, initial_version: int = 0) -> Engine:
    """The engine a run's replica serves: ``[rollout]``'s, with the run's LoRA adapters if it trains them."""
    return make_engine(
        model_path,
        settings.rollout,
        settings.model.dtype,
        initial_version,
        settings.training.lora,
        settings.model.adapter,
    )
