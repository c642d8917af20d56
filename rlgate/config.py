"""rlgate's typed configuration, loaded from TOML.

One pydantic tree; every field has a description and bounds. Unknown keys and
bad values are errors that name the key (``rollout.replicas: ...``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from rlgate.jobs.egress import Allowlist


EngineKind = Literal["vllm", "hf", "auto"]  # [rollout] engine, and [jobs] engine for jobs that name none


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
    adapter: str | None = Field(
        None,
        min_length=1,
        description="A LoRA adapter folder (PEFT format) over the model: the engines serve it and, with "
        "[training.lora], the trainer trains on from it (--resume sets it to the checkpoint's adapter).",
    )


class RolloutConfig(_Section):
    engine: EngineKind = Field(
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
    max_loras: int = Field(
        4,
        ge=2,
        le=64,
        description="vLLM with [training.lora]: adapters one batch may mix (requests finishing on an older "
        "version beside new ones; in an engine pool, every run's); more wait their turn.",
    )
    pool: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Share the engines of this named pool with other runs on the same base model, each run "
        "training and serving its own LoRA adapter (vLLM, [training.lora]). The first run to join deploys "
        "the pool with its [rollout] settings; the last to leave deletes it.",
    )
    max_ongoing_requests: int = Field(
        512, ge=1, le=100_000, description="Requests one replica's engine works on at once; more wait in a queue."
    )
    max_queued_requests: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Requests a gateway replica holds waiting for an engine; beyond, 503 with Retry-After.",
    )
    request_log_size: int = Field(
        0, ge=0, le=100_000, description="Keep the last N requests as the engine saw them (0: off)."
    )
    weight_sync: Literal["file", "ipc"] = Field(
        "file",
        description="How a run's new weights reach vLLM: a safetensors file in shared memory (CPU or GPU). "
        '"ipc" (CUDA IPC) needs the trainer on its engine\'s GPU, which a run does not do yet: it is refused '
        "here; rlgate check-parity --weight-sync ipc checks that path on a GPU.",
    )

    @field_validator("weight_sync")
    @classmethod
    def _file_for_runs(cls, value: str) -> str:
        if value == "ipc":
            raise ValueError(
                "\"ipc\" pushes weights by CUDA IPC from a trainer on the engine's own GPU; a run's trainer has "
                'GPUs of its own, and its pushes go by file through the PolicyStore: use "file" (the default). '
                "`rlgate check-parity --weight-sync ipc` checks the IPC path on a GPU"
            )
        return value

    @model_validator(mode="after")
    def _shards_on_own_gpus(self) -> RolloutConfig:
        if self.num_gpus and self.tensor_parallel_size > 1 and self.num_gpus != self.tensor_parallel_size:
            raise ValueError(
                f"a replica's engine shards over tensor_parallel_size ({self.tensor_parallel_size}) GPUs of one "
                f"node, so num_gpus ({self.num_gpus:g}) must equal it"
            )
        return self


class GatewayConfig(_Section):
    host: str = Field("127.0.0.1", min_length=1, description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Gateway replicas. Split: stateless ones in front of the engines (no CPU of their own); "
        "colocated: each runs one engine, so this is [rollout] replicas (set one of them).",
    )
    public_url: str | None = Field(
        None,
        description="Base URL others reach the gateway at (e.g. behind a proxy); inference URLs handed to task "
        "apps start with it. Default: the URL the request came in on.",
    )
    route_prefix: str = Field(
        "/",
        pattern=r"^/([A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*)?$",
        description="Where the gateway is mounted on Serve's proxy; one proxy can serve several runs "
        "(RL jobs get /jobs/<id>).",
    )
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
    capacity_lease: int = Field(
        8,
        ge=1,
        le=1024,
        description="Most capacity slots a session owner (a colocated gateway replica, or the SessionStore) "
        "takes from the CapacityActor in one call while no trainer is attached: the spares, and the slots its "
        "ended sessions leave, open its next sessions without a call; what is not used goes back within 0.2 s "
        "(spares once no session asked for 0.5 s). Never more than max_concurrent run across owners; a session "
        "refused while other owners lease waits up to 1 s for their slots. With a trainer attached every "
        "session takes and returns its own slot. 1: a call per session start and end.",
    )
    session_timeout_s: float = Field(3600.0, gt=0, description="Idle sessions are ended and exported after this.")
    refresh_timeout_s: float = Field(120.0, ge=0, description="How long a refresh waits for capacity.")
    turn_discount: float = Field(1.0, ge=0, le=1, description="Reward discount per turn, propagated backwards.")
    export_style: Literal["individual", "concat"] = Field(
        "individual", description="individual: a sample per completion; concat: a sample per conversation branch."
    )
    tool_parser: str = Field(
        "auto",
        min_length=1,
        description="Tool-call format: auto (from the chat template), hermes (rlgate's), none, or any parser "
        "of vLLM's registry (llama3_json, mistral, pythonic, qwen3_coder, ...; vllm:hermes for vLLM's Hermes).",
    )
    reasoning_parser: str | None = Field(
        None,
        min_length=1,
        description="A reasoning parser of vLLM's registry (qwen3, deepseek_r1, ...): answers carry the "
        "model's thinking as reasoning_content. Unset: thinking stays in content.",
    )
    reasoning_history: Literal["tokens", "template"] = Field(
        "tokens",
        description="How a later turn sees earlier thinking. tokens: it continues from the sampled tokens, "
        "thinking kept, token-exact, even where the template would strip it; template: each turn is rendered "
        "afresh by the chat template (earlier thinking as the template shows it), a new sequence per turn. "
        "A session may choose at start_session.",
    )
    max_running_jobs: int = Field(1, ge=1, le=1000, description="RL jobs (/api/rl/jobs) run at once; more wait queued.")
    access_log: bool = Field(
        True,
        description="Log one line per request: method, route template (never the raw path: a scoped URL's "
        "path holds a session key), status, milliseconds. train_driver.py turns it off unless set.",
    )
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Largest request body (413 beyond).")
    direct_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Each gateway replica also serves the API itself on this port (on [gateway] host), "
        "skipping Serve's proxy hop: split replicas on one node share it, colocated replica n listens on "
        "direct_port + n (a session's requests go to its own replica). Unset: only through Serve's proxy.",
    )
    colocate: bool = Field(
        False,
        description="Each gateway replica runs its own engine and owns its sessions (journal in the run folder): "
        "a chat turn makes no call to another process. [rollout] replicas sets how many; Serve's proxy "
        "sends each session's requests to its owner. false: gateway replicas call the RolloutServer "
        "deployment and the run's SessionStore actor.",
    )
    max_session_interactions: int = Field(
        1024,
        ge=1,
        description="Most completions one session records (a choice of n counts as one each); past it a turn "
        "answers 409: end the session and start a new one.",
    )
    max_session_tokens: int = Field(
        1_048_576,
        ge=1024,
        description="Most tokens one session stores: each completion's prompt (once for its n choices) and its "
        "tokens; past it a turn answers 413. Bounds what one key holder can make the session owner keep.",
    )
    max_messages: int = Field(1024, ge=1, description="Most messages in one chat request.")
    responses_kept: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="/v1/responses: how many recent responses each gateway replica keeps in memory for "
        "previous_response_id (a session's are dropped when it ends); 0 keeps none.",
    )
    max_n: int = Field(16, ge=1, le=128, description="Most choices per request.")
    max_completion_tokens: int = Field(
        4096, ge=1, description="Largest max_tokens a request may ask for (the context still caps it)."
    )


Variety = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

# What each named variety means when a field is left unset.
VARIETY_DEFAULTS: dict[str, dict] = {
    "grpo": {"advantage": "grpo", "loss": "ppo_clip", "aggregation": "seq_mean_token_mean"},
    "dr_grpo": {"advantage": "dr_grpo", "loss": "ppo_clip", "aggregation": "seq_mean_token_sum_norm"},
    "dapo": {
        "advantage": "grpo",
        "loss": "ppo_clip",
        "aggregation": "token_mean",
        "clip_high": 0.28,
        "drop_equal_reward_groups": True,
    },
    "gspo": {"advantage": "grpo", "loss": "gspo", "aggregation": "seq_mean_token_mean"},
    "rloo": {"advantage": "rloo", "loss": "ppo_clip", "aggregation": "token_mean"},
}


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """An [algorithm] with its variety's defaults filled in: what the driver and
    the trainer workers run (``AlgorithmConfig.resolved``)."""

    variety: str
    advantage: str
    loss: str
    clip_low: float
    clip_high: float
    aggregation: str
    kl_coef: float
    entropy_coef: float
    behaviour_weight_cap: float
    drop_equal_reward_groups: bool


class AlgorithmConfig(_Section):
    variety: Variety = Field(
        "grpo", description="A named recipe; it sets the fields below that are left unset (see VARIETY_DEFAULTS)."
    )
    advantage: Literal["grpo", "dr_grpo", "rloo"] | None = Field(None, description="Group advantage estimator.")
    loss: Literal["ppo_clip", "gspo", "decoupled_ppo", "cispo"] | None = Field(
        None,
        description="Policy loss; ppo_clip becomes decoupled_ppo when [training] max_staleness > 0 "
        "or truncated_is is set.",
    )
    truncated_is: bool = Field(
        False,
        description="Truncated importance sampling against the engine's logprobs (the train/inference "
        "mismatch) at max_staleness 0 too: ppo_clip becomes decoupled_ppo, capped at behaviour_weight_cap.",
    )
    clip_low: float = Field(0.2, gt=0, lt=1, description="Ratio floor is 1 - clip_low.")
    clip_high: float | None = Field(None, gt=0, le=10, description="Ratio ceiling is 1 + clip_high (default clip_low).")
    aggregation: Aggregation | None = Field(None, description="How per-token losses are averaged.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the initial (reference) policy; 0 disables.")
    entropy_coef: float = Field(
        0.0, ge=0, le=1, description="Weight of an entropy bonus on trained tokens (against collapse); 0 disables."
    )
    behaviour_weight_cap: float = Field(
        5.0, gt=1, description="Decoupled PPO: truncate the proximal/behaviour importance weight here."
    )
    drop_equal_reward_groups: bool | None = Field(
        None, description="Drop groups whose rewards are all equal (no learning signal), as DAPO's dynamic sampling."
    )

    @model_validator(mode="after")
    def _truncated_is_on_ppo(self) -> AlgorithmConfig:
        loss = self.loss or VARIETY_DEFAULTS[self.variety]["loss"]
        if self.truncated_is and loss not in ("ppo_clip", "decoupled_ppo"):
            raise ValueError(
                f"truncated_is applies to the ppo_clip loss, not {loss} "
                "(cispo weights every token by its clipped ratio to the sampler already)"
            )
        return self

    def resolved(self, max_staleness: int) -> ResolvedAlgorithm:
        """Every setting with the variety's defaults filled in."""
        settings = {**VARIETY_DEFAULTS[self.variety]}
        settings.update({k: v for k, v in self.model_dump().items() if v is not None})
        settings.setdefault("clip_high", self.clip_low)
        settings.setdefault("drop_equal_reward_groups", False)
        truncated_is = settings.pop("truncated_is")
        if (max_staleness > 0 or truncated_is) and settings["loss"] == "ppo_clip":
            settings["loss"] = "decoupled_ppo"  # off-policy tokens need the behaviour correction
        return ResolvedAlgorithm(**settings)


# vLLM's supported LoRA ranks; an engine's slots are sized to the next one up.
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(rank: int) -> int:
    """vLLM's smallest supported LoRA rank at least ``rank``."""
    return next(supported for supported in LORA_RANKS if supported >= rank)


class LoraSettings(_Section):
    """``[training.lora]``: train a PEFT LoRA adapter instead of every weight."""

    rank: int = Field(16, ge=1, le=LORA_RANKS[-1], description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; updates are scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description='Module names (or suffixes) to adapt, e.g. ["q_proj", "v_proj"]; "all-linear": every linear '
        "layer but the output head.",
    )
    save_merged: bool = Field(
        False, description="Checkpoints also hold the merged model (base + adapter) in merged/, for serving alone."
    )

    @property
    def engine_rank(self) -> int:
        """The rank an engine's adapter slots are sized for (vLLM's next supported rank)."""
        return engine_lora_rank(self.rank)


class TrainingConfig(_Section):
    batch_size: int = Field(8, ge=1, le=100_000, description="Episodes (sessions) per optimizer step.")
    group_size: int = Field(4, ge=1, le=1024, description="Episodes of the same task_id compared with each other.")
    learning_rate: float = Field(1e-5, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    grad_accumulation: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step, per worker.")
    updates_per_batch: int = Field(1, ge=1, le=64, description="Optimizer steps taken on each batch.")
    max_staleness: int = Field(
        0, ge=0, le=1000, description="S: rollouts may lag the trainer by S versions; 0 is synchronous GRPO."
    )
    total_steps: int = Field(100, ge=1, description="Optimizer steps to train for.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    group_timeout_s: float = Field(
        600.0, gt=0, description="A group still short of group_size after this joins the batch as it is."
    )
    partial_groups: Literal["batch", "drop"] = Field(
        "batch", description="Groups short after group_timeout_s: train them (advantages over the batch) or drop them."
    )
    seed: int = Field(0, ge=0, description="Seed for the trainer.")
    max_failures: int = Field(
        3,
        ge=-1,
        description="Trainer worker-group failures Ray Train recovers from (from the last checkpoint); -1 any.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass instead of keeping them (less memory)."
    )
    bf16: bool = Field(
        False,
        description="bfloat16 autocast for the trainer's forward and backward passes (weights and AdamW stay "
        "float32); the engine's and the trainer's logprobs then differ by bf16 rounding.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="Train a LoRA adapter (pushed to the engines as an adapter, no full-weight sync); "
        "unset: full fine-tuning.",
    )

    @model_validator(mode="after")
    def _whole_groups(self) -> TrainingConfig:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        return self


class ComputeConfig(_Section):
    trainer_workers: int = Field(1, ge=1, le=4096, description="Ray Train workers (data parallel).")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every worker holds the whole model; fsdp: FSDP2 shards parameters, gradients and "
        "optimizer state over the workers (for models that do not fit one worker).",
    )
    gpus_per_worker: float | None = Field(
        None,
        ge=0,
        description="GPUs per trainer worker; 0 trains on CPU bundles; unset: 1 when the cluster has a GPU "
        "for every worker beyond those the rollout replicas take, else 0.",
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs per trainer worker.")
    threads_per_worker: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch threads per trainer worker; unset: one per whole CPU it reserves (Ray's "
        "OMP_NUM_THREADS). A synchronous run (max_staleness = 0) on one machine may give the trainer the cores "
        "the engines leave idle while it steps.",
    )
    placement: Literal["shared", "split"] = Field(
        "shared",
        description="shared: replicas and workers go wherever their resources fit (fractional GPUs co-locate "
        "them); split: replicas only on nodes offering the rlgate_rollout resource, workers only on nodes "
        "offering rlgate_trainer.",
    )
    rollout_replicas: int | None = Field(
        None, ge=1, description="RolloutServer replicas; the same as [rollout] replicas (set one of them)."
    )


class ServicesConfig(_Section):
    task_url: str | None = Field(
        None, max_length=2048, description="Base URL of a task app that drives the episodes (http or https)."
    )

    @field_validator("task_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        from rlgate.jobs.egress import target

        if url is not None:
            target(url)  # http or https, a host, no credentials; what it resolves to is checked by [jobs]
        return url


class JobsConfig(_Section):
    """What a run's driver may call. In the gateway's config it rules every RL job
    the gateway takes (a submitted config's own [jobs] is replaced by it)."""

    task_app_hosts: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="Task apps a run may call at non-public addresses (loopback, private, link-local, ...): "
        "host names, IP addresses or networks such as 10.0.0.0/8. Public addresses need no entry.",
    )

    start_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a run waits for the cluster to free what it needs, then fails saying why."
    )
    cpus_per_bundle: float = Field(
        0.5,
        gt=0,
        description="CPUs a job's rollout replicas and trainer workers reserve when its config does not say "
        "([rollout] num_cpus, [compute] cpus_per_worker): a job fits beside a gateway on a small machine.",
    )
    engine: EngineKind = Field(
        "auto",
        description="The rollout engine of a job whose config does not name one ([rollout] engine; synth-ai's "
        "configs never do): auto picks vLLM when it is installed, else the HF engine.",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="Model names a job may ask for, mapped to what this cluster loads (a local folder, a built-in "
        'or a cached Hugging Face id): synth-ai\'s SDK only sends the ids it knows, e.g. "Qwen/Qwen3-0.6B".',
    )

    @field_validator("task_app_hosts")
    @classmethod
    def _entries(cls, entries: list[str]) -> list[str]:
        from rlgate.jobs.egress import Allowlist

        Allowlist.parse(entries)  # ValueError names the entry
        return entries

    def allowlist(self) -> Allowlist:
        """The entries as an :class:`rlgate.jobs.egress.Allowlist` (imported here: it brings httpx)."""
        from rlgate.jobs.egress import Allowlist

        return Allowlist.parse(self.task_app_hosts)


class TaskConfig(_Section):
    """Where episodes come from: a built-in task, a dataset with a reward function,
    or a task app ([services] task_url)."""

    builtin: Literal["vowels", "arithmetic"] | None = Field(
        None, description="Play a built-in task through the gateway (train_driver's own agent loop)."
    )
    dataset: str | None = Field(
        None,
        description="Play the prompts of a dataset through the gateway (train_driver's own agent loop): "
        "a .jsonl or .parquet file, or a dataset name (datasets.load_dataset: its cache, or the Hub); "
        "needs [task] reward.",
    )
    dataset_split: str = Field("train", min_length=1, description="Dataset by name: the split to read.")
    prompt_column: str = Field(
        "prompt", min_length=1, description="Dataset: the column holding a prompt (text, or a list of chat messages)."
    )
    reward: str | None = Field(
        None,
        pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="Dataset: the reward function, 'module:function' or 'file.py:function', "
        "called as function(completion, row, messages) -> float.",
    )
    max_tokens: int = Field(32, ge=1, le=32_768, description="Built-in task: most tokens per reply.")
    temperature: float = Field(1.0, ge=0, le=2, description="Built-in task: sampling temperature.")
    env_delay_s: float = Field(
        0.0, ge=0, le=3600, description="Built-in task: mean seconds the environment takes per turn (uniform 0..2x)."
    )
    env_name: str | None = Field(None, description="Environment name the task app knows.")
    policy_name: str | None = Field(None, description="Policy name passed to the task app.")
    env_config: dict = Field(default_factory=dict, description="Passed to the task app as env.config.")
    policy_config: dict = Field(default_factory=dict, description="Passed to the task app as policy.config.")
    ops: list[str | dict] = Field(default_factory=list, description="Passed to the task app as the rollout's ops.")
    max_turns: int = Field(
        10, ge=1, le=10_000, description="Most turns per episode; a task app gets it as env.config.max_turns."
    )
    max_concurrent: int = Field(8, ge=1, le=10_000, description="Most episodes in flight against the task app.")
    seed_start: int = Field(0, ge=0, description="Task app: the first training seed when [task] seeds is empty.")
    seeds: list[int] = Field(
        default_factory=list,
        description="Task app: training seeds, a group per seed in turn (empty: seed_start, seed_start + 1, ...).",
    )
    rollout_timeout_s: float = Field(600.0, gt=0, description="Task app: most seconds one POST /rollout may take.")
    down_after_s: float = Field(
        120.0, gt=0, description="Stop the run when every episode for this long has failed (the environment is down)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskConfig:
        if self.dataset is not None and self.builtin is not None:
            raise ValueError("set one of [task] builtin and [task] dataset, not both")
        if (self.dataset is None) != (self.reward is None):
            raise ValueError("[task] dataset and [task] reward go together: the prompts and how to score a reply")
        return self


class EvaluationConfig(_Section):
    every_n_iters: int = Field(0, ge=0, description="Evaluate every N steps on held-out seeds (0: never).")
    seeds: list[int] = Field(
        default_factory=list,
        description="Held-out seeds evaluated each time: a task app's seeds, a dataset's row numbers, or a "
        "built-in task's problems drawn with these seeds.",
    )
    n: int = Field(1, ge=1, le=1024, description="Episodes per seed (pass@k is reported for k up to n).")
    pass_threshold: float = Field(
        1.0, allow_inf_nan=False, description="An episode passes when its reward is at least this."
    )
    env_config: dict = Field(
        default_factory=dict, description="Merged over [task] env_config for evaluation episodes (e.g. a split)."
    )


class LoggingConfig(_Section):
    """Trackers beside metrics.jsonl (rlgate.training.tracking); each needs its package."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files in <run>/tensorboard/.")
    wandb: bool = Field(False, description="Log to a Weights & Biases run (its files in <run>/wandb/).")
    wandb_project: str = Field("rlgate", min_length=1, description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None: the account's default.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode; None: online when WANDB_API_KEY is set, else offline (wandb sync uploads later)."
    )
    mlflow: bool = Field(False, description="Log to an MLflow run (by default a file store in <run>/mlruns/).")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server; None: $MLFLOW_TRACKING_URI, else <run>/mlruns/."
    )
    mlflow_experiment: str = Field("rlgate", min_length=1, description="MLflow experiment the run is logged in.")
    samples_per_step: int = Field(
        4, ge=0, le=1024, description="Trajectories per step logged as a table of prompt, completion and reward."
    )


class RLGateConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    jobs: JobsConfig = Field(default_factory=JobsConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tags: dict[str, str] = Field(default_factory=dict, description="Free-form labels kept with the run.")

    @model_validator(mode="after")
    def _replica_counts(self) -> RLGateConfig:
        wanted = self.compute.rollout_replicas
        if wanted is not None and "replicas" in self.rollout.model_fields_set and wanted != self.rollout.replicas:
            raise ValueError(
                f"compute.rollout_replicas ({wanted}) and rollout.replicas ({self.rollout.replicas}) disagree; "
                "set one of them"
            )
        if wanted is not None:
            self.rollout.replicas = wanted
        if self.gateway.colocate and "replicas" in self.gateway.model_fields_set:
            if "replicas" in self.rollout.model_fields_set and self.rollout.replicas != self.gateway.replicas:
                raise ValueError(
                    f"gateway.replicas ({self.gateway.replicas}) and rollout.replicas ({self.rollout.replicas}) "
                    "disagree: a colocated gateway replica runs one engine; set one of them"
                )
            self.rollout.replicas = self.gateway.replicas
        elif self.gateway.colocate:
            self.gateway.replicas = self.rollout.replicas
        direct = self.gateway.direct_port
        if self.gateway.colocate and direct is not None and direct + self.rollout.replicas - 1 > 65535:
            raise ValueError(
                f"gateway.direct_port {direct} + one port per colocated replica ({self.rollout.replicas}) "
                "goes past 65535: choose a lower port"
            )
        if self.compute.strategy == "fsdp" and self.training.lora is not None:
            raise ValueError(
                'compute.strategy "fsdp" trains the full model; a LoRA adapter trains on "ddp" workers '
                "(its frozen base is not sharded yet)"
            )
        if self.rollout.pool is not None:
            if self.training.lora is None:
                raise ValueError("rollout.pool: an engine pool's runs each train a LoRA adapter; set [training.lora]")
            if self.rollout.engine == "hf":
                raise ValueError('rollout.pool: an engine pool serves its runs\' adapters on vLLM; not engine "hf"')
            if self.gateway.colocate:
                raise ValueError(
                    "rollout.pool: a pool's engines are shared, not colocated; set [gateway] colocate = false"
                )
        if self.task.dataset is not None and self.services.task_url is not None:
            raise ValueError("set one of [task] dataset and [services] task_url (a task app), not both")
        held_out = set(self.evaluation.seeds) if self.evaluation.every_n_iters else set()
        if self.task.seeds and set(self.task.seeds) <= held_out:
            raise ValueError(
                "every [task] seed is one of the [evaluation] seeds held out of training: nothing would be trained on"
            )
        plays = self.task.builtin is not None or self.task.dataset is not None  # [task] max_tokens is theirs
        if plays and self.task.max_tokens > self.gateway.max_completion_tokens:
            raise ValueError(
                f"[task] max_tokens ({self.task.max_tokens}) is more than the gateway allows a request "
                f"([gateway] max_completion_tokens {self.gateway.max_completion_tokens}): every episode's "
                "request would be refused; lower the one or raise the other"
            )
        return self

    @property
    def served_model_name(self) -> str:
        return self.gateway.served_model_name or self.model.name


def load_config(path: str | Path) -> RLGateConfig:
    """Parse and validate a TOML config file."""
    return parse_config(read_toml(path), source=str(path))


def read_toml(path: str | Path) -> dict:
    """A TOML file's tree; a file that cannot be read as one is a ConfigError saying why."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a folder, not a config file (give a .toml file in it)") from None
    except PermissionError:
        raise ConfigError(f"{path}: not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a config is TOML in UTF-8)") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def with_changes(config: RLGateConfig, changes: dict[str, dict], source: str = "config") -> RLGateConfig:
    """``config`` with some keys replaced (``{"task": {"builtin": None}}``), the whole tree
    validated once at the end: setting keys one by one would check each section half-changed
    (switching [task] from a dataset to a built-in task passes through having both) and never
    run the checks across sections."""
    data = config.model_dump(exclude_unset=True)
    for section, keys in changes.items():
        data.setdefault(section, {}).update(keys)
    return validated(data, source)


def null_paths(tree: object, at: str = "") -> list[str]:
    """Where ``tree`` (a config as plain data) holds a null, which TOML, the form a
    config is written in, cannot: the keys, dotted, and list items as ``[i]``."""
    if tree is None:
        return [at]
    if isinstance(tree, dict):
        return [path for key, value in tree.items() for path in null_paths(value, f"{at}.{key}" if at else str(key))]
    if isinstance(tree, list):
        return [path for i, value in enumerate(tree) for path in null_paths(value, f"{at}[{i}]")]
    return []


def dump_config(config: RLGateConfig, path: str | Path) -> Path:
    """Write ``config`` as TOML that :func:`load_config` reads back to the same tree."""
    import tomli_w

    path = Path(path)
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def parse_config(data: dict, source: str = "config") -> RLGateConfig:
    """Validate a config mapping; the synth-ai RL TOML shape is recognised and mapped."""
    return parse_config_noting(data, source)[0]


def parse_config_noting(data: dict, source: str = "config") -> tuple[RLGateConfig, list[str]]:
    """:func:`parse_config`, and the synth-ai keys that change nothing here ("section.key: why")."""
    from rlgate.jobs.synth import is_synth_shape, map_synth

    ignored: list[str] = []
    if is_synth_shape(data):
        try:
            mapped = map_synth(data, source)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError, ArithmeticError, LookupError) as err:  # e.g. a number
            # where a table was due, infinity where a count was
            raise ConfigError(f"{source}: a synth-ai key has a value it cannot take: {err}") from None
        data, ignored = mapped.config, mapped.ignored
    return validated(data, source), ignored


def validated(data: dict, source: str) -> RLGateConfig:
    try:
        return RLGateConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: " + "; ".join(_describe(e) for e in err.errors())) from None


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if error["type"] == "value_error":  # our own checks: the message already says what was wrong
        message = error["msg"].removeprefix("Value error, ")
        return f"{key}: {message}" if key else message
    return f"{key}: {error['msg']} (got {error.get('input')!r})"
