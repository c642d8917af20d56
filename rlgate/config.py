"""rlgate's typed configuration, loaded from TOML.

One pydantic tree; every field has a description and bounds. Unknown keys and
bad values are errors that name the key (``rollout.replicas: ...``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    name: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="Built-in name (tiny-random, smollm2-135m-instruct), local folder or cached Hugging Face id.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype in the engines; float32 on CPU gives exact logprob parity."
    )


class RolloutConfig(_Section):
    engine: Literal["vllm", "hf", "auto"] = Field(
        "auto", description="Rollout engine; auto picks vLLM when it is installed, else the HF engine."
    )
    replicas: int = Field(1, ge=1, le=1024, description="RolloutServer replicas (one engine each).")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (tensor_parallel_size on a GPU machine).")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM tensor parallel degree.")
    max_model_len: int = Field(2048, ge=16, le=1_048_576, description="Longest prompt + completion, in tokens.")
    seed: int = Field(0, ge=0, description="Engine seed for requests that carry none.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM: fraction of GPU memory for weights and KV cache."
    )
    kv_cache_gib: float = Field(1.0, gt=0, le=1024, description="vLLM on CPU: KV-cache size in GiB.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="HF engine: most sequences decoded together.")
    request_log_size: int = Field(
        0, ge=0, le=100_000, description="Keep the last N requests as the engine saw them (0: off)."
    )
    weight_sync: Literal["file", "ipc"] = Field(
        "file",
        description="How new weights reach vLLM: a safetensors file in shared memory (CPU or GPU), "
        "or CUDA IPC (GPU, trainer and engine on the same GPU).",
    )


class GatewayConfig(_Section):
    host: str = Field("127.0.0.1", min_length=1, description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    run_name: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Names the run folder and the run's named actors."
    )
    run_dir: str = Field("runs", min_length=1, description="Parent folder of run folders (trajectories, checkpoints).")
    served_model_name: str | None = Field(None, description="Model name clients use; default: [model] name.")
    model_aliases: list[str] = Field(default_factory=list, description="Other accepted model names.")
    strict_model: bool = Field(
        True, description="Refuse unknown model names (404); false ignores the field, as AReaL's gateway does."
    )
    max_concurrent: int = Field(64, ge=1, le=100_000, description="Most sessions open at once.")
    session_timeout_s: float = Field(3600.0, gt=0, description="Idle sessions are ended and exported after this.")
    refresh_timeout_s: float = Field(120.0, ge=0, description="How long a refresh waits for capacity.")
    turn_discount: float = Field(1.0, ge=0, le=1, description="Reward discount per turn, propagated backwards.")
    export_style: Literal["individual", "concat"] = Field(
        "individual", description="individual: a sample per completion; concat: a sample per conversation branch."
    )
    tool_parser: Literal["auto", "hermes", "none"] = Field(
        "auto", description="Tool-call format; auto detects it from the chat template."
    )
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Largest request body (413 beyond).")
    max_messages: int = Field(1024, ge=1, description="Most messages in one chat request.")
    max_n: int = Field(16, ge=1, le=128, description="Most choices per request.")
    max_completion_tokens: int = Field(
        4096, ge=1, description="Largest max_tokens a request may ask for (the context still caps it)."
    )


class RLGateConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)

    @property
    def served_model_name(self) -> str:
        return self.gateway.served_model_name or self.model.name


def load_config(path: str | Path) -> RLGateConfig:
    """Parse and validate a TOML config file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return parse_config(data, source=str(path))


def parse_config(data: dict, source: str = "config") -> RLGateConfig:
    try:
        return RLGateConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: " + "; ".join(_describe(e) for e in err.errors())) from None


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    return f"{key}: {error['msg']} (got {error.get('input')!r})"
