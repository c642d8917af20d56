"""The synth-ai RL TOML shape, mapped onto rlgate's config.

A config is recognised as synth-ai's when it has ``[model] base``/``source``/
``trainer_mode``, ``[algorithm] type``/``method``, or a ``[topology]`` or
``[policy]`` section. Every key of that shape is mapped, accepted with a
stated reason, or refused by name: nothing is dropped silently.

    [algorithm] type = "online", method = "policy_gradient", variety -> [algorithm] variety
    [model] base -> [model] name; label -> [gateway] served_model_name; trainer_mode = "full"
    [services] task_url -> [services] task_url; [jobs] task_app_hosts (rlgate's own) -> [jobs] task_app_hosts
    [rollout] env_name, policy_name, env_config, policy_config, max_turns, ops,
              max_concurrent_rollouts -> [task]; episodes_per_batch -> [training] batch_size
    [training] batch_size, group_size, learning_rate; gradient_accumulation_steps -> grad_accumulation;
               num_epochs x iterations_per_epoch -> total_steps; max_turns -> [task] max_turns
    [training] weight_sync (enable, mode "full"), weight_sync_verify_checksums: accepted
    [compute] gpu_type ("cpu": no GPUs), gpu_count; [topology] gpus_for_vllm, gpus_for_training,
              tensor_parallel -> [rollout] tensor_parallel_size, gpus_for_ref = 0
    [reference] placement = "none"; [judge], [verifier], [rubric] (enabled) are refused
    [vllm] max_model_len, gpu_memory_utilization, tensor_parallel_size -> [rollout]
    [evaluation] every_n_iters, seeds -> [evaluation]; instances = number of seeds
    [tags] -> tags
"""

from __future__ import annotations

from rlgate.config import ConfigError

_SYNTH_MARKERS = {"model": {"base", "source", "trainer_mode", "label"}, "algorithm": {"type", "method"}}


def is_synth_shape(data: dict) -> bool:
    if "topology" in data or "policy" in data:
        return True
    return any(
        isinstance(data.get(section), dict) and keys & set(data[section]) for section, keys in _SYNTH_MARKERS.items()
    )


class _Mapper:
    """Walks a synth-ai config, recording which keys it has used."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source
        self.out: dict[str, dict] = {}
        self.used: set[str] = set()

    def get(self, section: str, key: str, default=None):
        self.used.add(f"{section}.{key}")
        return self.data.get(section, {}).get(key, default)

    def put(self, section: str, key: str, value) -> None:
        if value is not None:
            self.out.setdefault(section, {})[key] = value

    def refuse(self, where: str, why: str) -> None:
        raise ConfigError(f"{self.source}: {where}: {why}")

    def unused(self) -> list[str]:
        keys = []
        for section, body in self.data.items():
            if isinstance(body, dict):
                keys += [f"{section}.{key}" for key in body if f"{section}.{key}" not in self.used]
            elif section not in self.used:
                keys.append(section)
        return keys


def from_synth(data: dict, source: str = "config") -> dict:
    """rlgate's config mapping for a synth-ai RL config; ConfigError names what cannot be honoured."""
    m = _Mapper(data, source)
    # [algorithm]
    if m.get("algorithm", "type", "online") != "online":
        m.refuse("algorithm.type", "only 'online' RL is supported")
    if m.get("algorithm", "method", "policy_gradient") != "policy_gradient":
        m.refuse("algorithm.method", "only 'policy_gradient' is supported")
    m.put("algorithm", "variety", m.get("algorithm", "variety"))
    # [model]
    if m.get("model", "source"):
        m.refuse(
            "model.source",
            "continuing from a hosted checkpoint id is not supported; set [model] base to a "
            "local folder, a cached Hugging Face id or a built-in model",
        )
    m.put("model", "name", m.get("model", "base"))
    if m.get("model", "trainer_mode", "full") != "full":
        m.refuse("model.trainer_mode", "only full fine-tuning ('full') is supported; LoRA is not")
    m.put("gateway", "served_model_name", m.get("model", "label"))
    if "policy" in data:
        m.refuse("policy", "the [policy] section is not supported; use [model] base")
    # [services]
    m.put("services", "task_url", m.get("services", "task_url"))
    m.put("jobs", "task_app_hosts", m.get("jobs", "task_app_hosts"))  # a submitted job gets the gateway's instead
    if m.get("services", "verifier_url"):
        m.refuse("services.verifier_url", "hosted verifiers are not supported; the task app returns rewards")
    # [rollout] -> [task], [training]
    for key in ("env_name", "policy_name", "env_config", "policy_config", "max_turns"):
        m.put("task", key, m.get("rollout", key))
    m.put("task", "max_concurrent", m.get("rollout", "max_concurrent_rollouts"))
    m.put("task", "ops", m.get("rollout", "ops"))
    episodes = m.get("rollout", "episodes_per_batch")
    if m.get("rollout", "batches_per_step", 1) not in (None, 1):
        m.refuse("rollout.batches_per_step", "one batch per step is supported")
    # [training]
    for key in ("batch_size", "group_size", "learning_rate"):
        m.put("training", key, m.get("training", key))
    if episodes is not None and "batch_size" not in m.out.get("training", {}):
        m.put("training", "batch_size", episodes)
    m.put("training", "grad_accumulation", m.get("training", "gradient_accumulation_steps"))
    epochs, iterations = m.get("training", "num_epochs"), m.get("training", "iterations_per_epoch")
    if epochs is not None or iterations is not None:
        m.put("training", "total_steps", (epochs or 1) * (iterations or 1))
    if m.get("training", "max_turns") is not None:
        m.put("task", "max_turns", m.get("training", "max_turns"))
    m.get("training", "log_interval")  # accepted: rlgate logs every step
    m.get("training", "max_accumulated_minibatch")  # accepted: micro-batches follow grad_accumulation
    if m.get("training", "weight_sync_interval", 1) not in (None, 1):
        m.refuse("training.weight_sync_interval", "weights are pushed after every step (1)")
    for key in ("lora", "rewards", "step_rewards_enabled"):
        if m.get("training", key):
            m.refuse(f"training.{key}", "not supported; remove it")
    sync = m.get("training", "weight_sync") or {}
    if sync.get("enable") is False:
        m.refuse("training.weight_sync.enable", "weights are always pushed to the engines after each step")
    if sync.get("mode", "full") != "full":
        m.refuse("training.weight_sync.mode", "only full weights are pushed ('full')")
    m.get("training", "weight_sync_verify_checksums")  # accepted: every push is exact (see README: weight sync)
    for key in (
        "step_rewards_mode",
        "step_rewards_indicator_lambda",
        "step_rewards_beta",
        "step_rewards_strategy",
        "event_rewards_kind",
    ):
        if m.get("training", key) not in (None, "off"):
            m.refuse(f"training.{key}", "step rewards are not supported; the task app's outcome reward is used")
    # [vllm], then [compute] and [topology] (whose tensor_parallel wins)
    for key in ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size"):
        m.put("rollout", key, m.get("vllm", key))
    _map_compute(m)
    # [evaluation]
    seeds = m.get("evaluation", "seeds")
    m.put("evaluation", "seeds", seeds)
    m.put("evaluation", "every_n_iters", m.get("evaluation", "every_n_iters"))
    instances = m.get("evaluation", "instances")
    if instances is not None and seeds is not None and instances != len(seeds):
        m.refuse("evaluation.instances", f"must equal the number of seeds ({len(seeds)})")
    # everything else
    if "tags" in data:
        m.used.update(f"tags.{key}" for key in data["tags"])
        m.out["tags"] = {str(k): str(v) for k, v in data["tags"].items()}
    if "smoke" in data:  # synth-ai's own docs: CLI-only, ignored by trainers
        m.used.update(f"smoke.{key}" for key in data["smoke"])
    for section in ("verifier", "rubric"):
        if data.get(section, {}).get("enabled"):
            m.refuse(f"{section}.enabled", "LLM verifiers are not supported; the task app returns rewards")
        m.used.update(f"{section}.{key}" for key in data.get(section, {}))
    if data.get("lora"):
        m.refuse("lora", "not supported; remove it")
    m.used.update(f"lora.{key}" for key in data.get("lora", {}))
    if data.get("reference", {}).get("placement", "none") != "none":
        m.refuse("reference.placement", "a reference model runs in the trainer ([algorithm] kl_coef); use 'none'")
    m.used.update(f"reference.{key}" for key in data.get("reference", {}))
    if data.get("judge"):
        m.refuse("judge", "LLM judges are not supported; the task app returns rewards")
    leftover = m.unused()
    if leftover:
        m.refuse(
            leftover[0],
            "unknown key in a synth-ai config" + (f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""),
        )
    return m.out


def _map_compute(m: _Mapper) -> None:
    gpu_type = m.get("compute", "gpu_type")
    gpus = int(m.get("compute", "gpu_count", 0) or 0)
    m.get("compute", "nodes")
    for_vllm = m.get("topology", "gpus_for_vllm")
    for_training = m.get("topology", "gpus_for_training")
    m.get("topology", "type")
    m.get("topology", "reference_placement")
    if m.get("topology", "gpus_for_ref", 0):
        m.refuse("topology.gpus_for_ref", "a reference model runs in the trainer, on its GPUs; set 0")
    m.put("rollout", "tensor_parallel_size", m.get("topology", "tensor_parallel"))
    if gpu_type is not None and str(gpu_type).lower() == "cpu" or gpus == 0:
        m.put("compute", "gpus_per_worker", 0)  # CPU workers and CPU rollout replicas
        return
    if for_vllm is None or for_training is None:
        # No split given: one GPU serves rollouts, the rest train; a single GPU is shared.
        for_vllm, for_training = (1, gpus - 1) if gpus > 1 else (0.5, 0.5)
    if for_vllm + for_training > gpus:
        m.refuse(
            "topology",
            f"gpus_for_vllm + gpus_for_training ({for_vllm + for_training}) exceed compute.gpu_count ({gpus})",
        )
    shards = int(m.out.get("rollout", {}).get("tensor_parallel_size", 1))
    if for_vllm >= 1 and (for_vllm < shards or for_vllm % shards):
        m.refuse("topology", f"gpus_for_vllm ({for_vllm}) must be a multiple of tensor_parallel ({shards})")
    m.put("rollout", "num_gpus", shards if for_vllm >= 1 else for_vllm)  # a replica holds its shards
    m.put("rollout", "replicas", max(1, int(for_vllm) // shards))
    if for_training >= 1:
        m.put("compute", "trainer_workers", int(for_training))
        m.put("compute", "gpus_per_worker", 1)
    else:
        m.put("compute", "gpus_per_worker", for_training)
