"""The synth-ai RL TOML shape, mapped onto rlgate's config with synth-ai's meaning.

A config is recognised as synth-ai's when it has ``[model] base``/``source``/
``trainer_mode``, ``[algorithm] type``/``method``, a top-level ``type``, or a
``[topology]``, ``[policy]`` or ``[data]`` section. Every key is mapped,
ignored with a stated reason (it changes nothing here; :func:`map_synth`
returns them so a job can list them), or refused by name when rlgate cannot
honour it and its absence would change the results. Nothing is dropped
silently.

    type = "rl"; [algorithm] type = "online", method = "policy_gradient", variety -> [algorithm] variety
    [model] base -> [model] name; label -> [gateway] served_model_name;
            trainer_mode "full", or "lora" -> [training.lora] from [training.lora] (or the older
            top-level [lora]) r -> rank, alpha, dropout, target_modules
            ([model] or [policy] trainer_mode "qlora" and a hosted source are refused)
    [policy] model or model_name (when [model] has no base; all named must agree) -> [model] name;
             max_tokens, temperature, top_p, top_k,
             repetition_penalty, stop_sequences -> [task] policy_config (the sampling the task app asks for)
    [services] task_url -> [services] task_url
    [rollout] env_name, policy_name, env_config, policy_config, max_turns, ops,
              max_concurrent_rollouts -> [task]
    [training] batch_size counts groups: sessions per step = batch_size x group_size; or
               [rollout] episodes_per_batch sessions per step (both given: they must agree);
               group_size, learning_rate; gradient_accumulation_steps -> grad_accumulation;
               num_epochs x iterations_per_epoch -> total_steps; max_turns -> [task] max_turns
    [training] weight_sync (enable, mode "full", targets ["policy"]): every step pushes full weights;
               its direct, verify_every_k and chunk_bytes are listed as ignored
    [training] step_rewards_* flat or in [training.rewards]: accepted (and listed) while they weigh nothing
    [verifier], [rubric] without enabled = true: listed as ignored
    [compute] gpu_type ("cpu": no GPUs), gpu_count; [topology] or [compute.topology] gpus_for_vllm,
              gpus_for_training, tensor_parallel -> [rollout] tensor_parallel_size
    [reference] placement (or [compute.topology] reference_placement): "none", or a KL reference
              (rlgate keeps it in the trainer: [algorithm] kl_coef, 0.04 unless set); the SDK writes
              [reference] placement = "none" beside any topology, so a reference asked for in either wins
    [vllm] max_model_len, gpu_memory_utilization, tensor_parallel_size -> [rollout]
    [evaluation] every_n_iters, seeds; instances episodes (the seeds in turn) -> [evaluation] seeds
    [data] seed_start -> [task] seed_start; split -> [task] env_config.split;
           evaluation_split -> [evaluation] env_config.split
    [tags] -> tags
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlgate.config import ConfigError

_SYNTH_MARKERS = {"model": {"base", "source", "trainer_mode", "label"}, "algorithm": {"type", "method"}}
REFERENCE_KL = 0.04  # [algorithm] kl_coef for a synth-ai config that asks for a reference model
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "stop_sequences")

# Keys that change nothing here, and why (listed in a job's events).
IGNORED = {
    "policy.inference_url": "rlgate serves the policy itself: each episode gets its session's URL",
    "policy.trainer_mode": "full fine-tuning, as [model] trainer_mode",
    "policy.label": "as [model] label",
    "data.episodes_per_iteration": "rlgate counts steps: [training] num_epochs x iterations_per_epoch",
    "data.evaluation_episodes": "rlgate evaluates [evaluation] instances episodes",
    "training.reward_positive": "rewards are the task app's, as it answers them",
    "training.reward_negative_no_tool": "rewards are the task app's, as it answers them",
    "training.reward_negative_no_answer": "rewards are the task app's, as it answers them",
    "training.log_interval": "rlgate logs every step",
    "training.max_accumulated_minibatch": "micro-batches follow gradient_accumulation_steps",
    "training.weight_sync_verify_checksums": "every push is exact (see README: weight sync)",
    "training.step_rewards_mode": "with step_rewards_beta = 0 step rewards weigh nothing",
    "training.step_rewards_indicator_lambda": "with step_rewards_beta = 0 step rewards weigh nothing",
    "training.step_rewards_beta": "0: step rewards weigh nothing",
    "training.step_rewards_strategy": "with step_rewards_beta = 0 step rewards weigh nothing",
    "training.event_rewards_kind": "with step_rewards_beta = 0 step rewards weigh nothing",
    "training.step_rewards_enabled": "with step_rewards_beta = 0 step rewards weigh nothing",
    "training.weight_sync.direct": "weights go to the engines directly, every step",
    "training.weight_sync.verify_every_k": "every push is exact (see README: weight sync)",
    "training.weight_sync.chunk_bytes": "rlgate's weight sync sizes its own transfers",
    "reference.port": "the reference model runs inside the trainer",
    "reference.tp": "the reference model runs inside the trainer",
    "reference.health_max_wait_s": "the reference model runs inside the trainer",
    "reference.health_interval_ms": "the reference model runs inside the trainer",
    "topology.type": "placement follows the GPU counts",
    "topology.gpus_for_ref": "the reference model runs inside the trainer, on its GPUs",
    "compute.nodes": "Ray places the run on the cluster's nodes",
}

MAX_EVAL_INSTANCES = 100_000  # evaluation episodes one evaluation may ask for


def is_synth_shape(data: dict) -> bool:
    if data.get("type") == "rl" or any(section in data for section in ("topology", "policy", "data")):
        return True
    return any(
        isinstance(data.get(section), dict) and keys & set(data[section]) for section, keys in _SYNTH_MARKERS.items()
    )


@dataclass
class Mapped:
    """A synth-ai config as rlgate's (``config``, a mapping for ``parse_config``)
    and the keys that change nothing here (``ignored``: "section.key: why")."""

    config: dict
    ignored: list[str] = field(default_factory=list)


class _Mapper:
    """Walks a synth-ai config, recording which keys it has used."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source
        self.out: dict[str, dict] = {}
        self.used: set[str] = set()
        self.ignored: list[str] = []

    def get(self, section: str, key: str, default=None):
        self.used.add(f"{section}.{key}")
        return self.data.get(section, {}).get(key, default)

    def put(self, section: str, key: str, value) -> None:
        if value is not None:
            self.out.setdefault(section, {})[key] = value

    def refuse(self, where: str, why: str) -> None:
        raise ConfigError(f"{self.source}: {where}: {why}")

    def ignore_known(self) -> None:
        """Every key present that :data:`IGNORED` names: used, and listed with its reason."""
        for name, why in IGNORED.items():
            section, _, key = name.partition(".")  # nested keys (weight_sync.direct) are listed where read
            if name not in self.used and key in (self.data.get(section) or {}):
                self.used.add(name)
                self.ignored.append(f"{name}: {why}")

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
    return map_synth(data, source).config


def _map_lora(m: _Mapper, lora: bool) -> None:
    """trainer_mode "lora": [training.lora] (or the older top-level [lora]) as rlgate's [training.lora]."""
    table = m.get("training", "lora")
    older = m.data.get("lora") or {}
    for where, value in (("training.lora", table), ("lora", older)):
        if value is not None and not isinstance(value, dict):
            m.refuse(where, "a table of r, alpha, dropout and target_modules")
    m.used.update(f"lora.{key}" for key in older)
    given = {**older, **(table or {})}
    if not lora:
        if given:
            m.ignored.append("training.lora: trainer_mode is 'full': the whole model trains, no adapter")
        return
    names = {"r": "rank", "alpha": "alpha", "dropout": "dropout", "target_modules": "target_modules"}
    unknown = sorted(set(given) - set(names))
    if unknown:
        m.refuse(f"training.lora.{unknown[0]}", f"unknown LoRA setting; use {', '.join(names)}")
    m.put("training", "lora", {names[key]: value for key, value in given.items() if value is not None})


def map_synth(data: dict, source: str = "config") -> Mapped:
    """The mapping and the ignored keys of a synth-ai RL config; ConfigError names what cannot be honoured."""
    data = _with_compute_topology(data)
    m = _Mapper(data, source)
    m.used.add("type")
    if data.get("type", "rl") != "rl":
        m.refuse("type", f'{data["type"]!r}: this is an RL config endpoint; use type = "rl"')
    # [algorithm]
    if m.get("algorithm", "type", "online") != "online":
        m.refuse("algorithm.type", "only 'online' RL is supported")
    if m.get("algorithm", "method", "policy_gradient") != "policy_gradient":
        m.refuse("algorithm.method", "only 'policy_gradient' is supported")
    m.put("algorithm", "variety", m.get("algorithm", "variety"))
    # [model], [policy]
    for section in ("model", "policy"):
        if m.get(section, "source"):
            m.refuse(
                f"{section}.source",
                "continuing from a hosted checkpoint id is not supported; set [model] base to a "
                "local folder, a cached Hugging Face id or a built-in model",
            )
    base = m.get("model", "base")
    named = {key: m.get("policy", key) for key in ("model", "model_name") if m.get("policy", key)}
    model = base or next(iter(named.values()), None)
    for key, policy_model in named.items():
        if policy_model != model:
            where = "[model] base" if base else "[policy] model"
            m.refuse(f"policy.{key}", f"{policy_model!r} differs from {where} {model!r}; name one model")
    m.put("model", "name", model)
    modes = {section: (m.data.get(section) or {}).get("trainer_mode", "full") for section in ("model", "policy")}
    stated = {section: (m.data.get(section) or {}).get("trainer_mode") for section in ("model", "policy")}
    if None not in stated.values() and stated["model"] != stated["policy"]:
        m.refuse("policy.trainer_mode", f"{stated['policy']!r} differs from [model] trainer_mode {stated['model']!r}")
    for section, mode in modes.items():
        if mode not in ("full", "lora"):
            m.refuse(f"{section}.trainer_mode", f"full fine-tuning ('full') or 'lora' is supported, not {mode!r}")
        if section == "model" or mode == "lora":  # [policy]'s "full" is listed as ignored (IGNORED)
            m.get(section, "trainer_mode")
    m.put("gateway", "served_model_name", m.get("model", "label"))
    sampling = {key: m.get("policy", key) for key in SAMPLING if m.get("policy", key) is not None}
    if sampling.get("repetition_penalty") not in (None, 1, 1.0):
        m.refuse("policy.repetition_penalty", "the gateway samples without a repetition penalty (1.0 only)")
    # [services]
    m.put("services", "task_url", m.get("services", "task_url"))
    m.put("jobs", "task_app_hosts", m.get("jobs", "task_app_hosts"))  # a submitted job gets the gateway's instead
    if m.get("services", "verifier_url"):
        m.refuse("services.verifier_url", "hosted verifiers are not supported; the task app returns rewards")
    # [rollout] -> [task]
    for key in ("env_name", "policy_name", "env_config", "max_turns"):
        m.put("task", key, m.get("rollout", key))
    policy_config = m.get("rollout", "policy_config") or {}
    m.put("task", "policy_config", {**sampling, **policy_config} or None)
    m.put("task", "max_concurrent", m.get("rollout", "max_concurrent_rollouts"))
    m.put("task", "ops", m.get("rollout", "ops"))
    if m.get("rollout", "batches_per_step", 1) not in (None, 1):
        m.refuse("rollout.batches_per_step", "one batch per step is supported")
    # [data]
    m.put("task", "seed_start", m.get("data", "seed_start"))
    if m.get("data", "split") is not None:  # the task's own env_config wins
        task = m.out.setdefault("task", {})
        task["env_config"] = {"split": data["data"]["split"], **task.get("env_config", {})}
    if m.get("data", "evaluation_split") is not None:
        m.put("evaluation", "env_config", {"split": data["data"]["evaluation_split"]})
    # [training]
    _map_batch(m)
    m.put("training", "learning_rate", m.get("training", "learning_rate"))
    m.put("training", "grad_accumulation", m.get("training", "gradient_accumulation_steps"))
    epochs, iterations = m.get("training", "num_epochs"), m.get("training", "iterations_per_epoch")
    if epochs is not None or iterations is not None:
        m.put("training", "total_steps", (epochs or 1) * (iterations or 1))
    if m.get("training", "max_turns") is not None:
        turns, rollout_turns = m.get("training", "max_turns"), m.get("rollout", "max_turns")
        if rollout_turns is not None and rollout_turns != turns:
            m.ignored.append(f"rollout.max_turns: {rollout_turns}; [training] max_turns ({turns}) wins")
        m.put("task", "max_turns", turns)
    if m.get("training", "weight_sync_interval", 1) not in (None, 1):
        m.refuse("training.weight_sync_interval", "weights are pushed after every step (1)")
    _map_lora(m, "lora" in modes.values())
    _map_weight_sync(m)
    _map_step_rewards(m)
    # [vllm], then [compute] and [topology] (whose tensor_parallel wins)
    for key in ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size"):
        m.put("rollout", key, m.get("vllm", key))
    _map_compute(m)
    _map_reference(m)
    _map_evaluation(m)
    # everything else
    if "tags" in data:
        m.used.update(f"tags.{key}" for key in data["tags"])
        m.out["tags"] = {str(k): str(v) for k, v in data["tags"].items()}
    if "smoke" in data:  # synth-ai's own docs: CLI-only, ignored by trainers
        m.used.update(f"smoke.{key}" for key in data["smoke"])
    for section in ("verifier", "rubric"):
        if data.get(section, {}).get("enabled"):
            m.refuse(f"{section}.enabled", "LLM verifiers are not supported; the task app returns rewards")
        for key in data.get(section, {}):  # an LLM verifier that is off: its settings weigh nothing
            m.used.add(f"{section}.{key}")
            m.ignored.append(f"{section}.{key}: the verifier is off (enabled is not true); rewards are the task app's")
    if data.get("judge"):
        m.refuse("judge", "LLM judges are not supported; the task app returns rewards")
    m.ignore_known()
    leftover = m.unused()
    if leftover:
        m.refuse(
            leftover[0],
            "unknown key in a synth-ai config" + (f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""),
        )
    return Mapped(m.out, m.ignored)


def _with_compute_topology(data: dict) -> dict:
    """``[compute.topology]`` (what synth-ai's SDK sends) folded into ``[topology]``."""
    compute = data.get("compute")
    if not isinstance(compute, dict) or not isinstance(compute.get("topology"), dict):
        return data
    topology = dict(compute["topology"])
    placement = topology.pop("reference_placement", None)
    data = {**data, "compute": {k: v for k, v in compute.items() if k != "topology"}}
    data["topology"] = {**topology, **(data.get("topology") or {})}
    # synth-ai's SDK writes [reference] placement = "none" beside a topology that asks for one:
    # a reference asked for in either place is kept
    if placement is not None and (data.get("reference") or {}).get("placement", "none") == "none":
        data["reference"] = {**(data.get("reference") or {}), "placement": placement}
    return data


def _map_batch(m: _Mapper) -> None:
    """synth-ai's batch_size counts groups; rlgate's counts sessions."""
    groups, group_size = m.get("training", "batch_size"), m.get("training", "group_size")
    episodes = m.get("rollout", "episodes_per_batch")
    m.put("training", "group_size", group_size)
    if groups is not None:
        sessions = groups * (group_size if group_size is not None else 1)
        if episodes is not None and episodes != sessions:  # synth-ai's own examples disagree on the unit
            m.ignored.append(
                f"rollout.episodes_per_batch: {episodes} disagrees with [training] batch_size x group_size "
                f"({groups} x {group_size or 1}: batch_size counts groups); a step trains {sessions} episodes"
            )
        m.put("training", "batch_size", sessions)
    elif episodes is not None:
        m.put("training", "batch_size", episodes)


def _map_step_rewards(m: _Mapper) -> None:
    """Step rewards, flat (deprecated) or in ``[training.rewards]`` (which synth-ai
    prefers): accepted while they weigh nothing (off, or beta 0), and listed."""
    training = m.data.get("training") or {}
    nested = m.get("training", "rewards") or {}
    for key in nested:
        if f"training.{key}" not in IGNORED:
            m.refuse(f"training.rewards.{key}", "unknown key in a synth-ai config")
        m.ignored.append(f"training.rewards.{key}: {IGNORED[f'training.{key}']}")
    settings = {**training, **nested}  # read, not used: with beta 0 the flat keys are listed as ignored
    if settings.get("step_rewards_enabled") and settings.get("step_rewards_beta", 0) not in (None, 0):
        m.refuse(
            "training.step_rewards_beta",
            "weighted step rewards are not supported; rlgate takes the task app's metrics.event_rewards as "
            "per-turn rewards as they are; set step_rewards_beta = 0 or leave step rewards off",
        )


def _map_weight_sync(m: _Mapper) -> None:
    sync = m.get("training", "weight_sync") or {}
    for key in sync:
        name = f"training.weight_sync.{key}"
        if name in IGNORED:
            m.ignored.append(f"{name}: {IGNORED[name]}")
        elif key not in ("enable", "mode", "weight_sync_interval", "targets"):
            m.refuse(name, "unknown key in a synth-ai config")
    if sync.get("enable") is False:
        m.refuse("training.weight_sync.enable", "weights are always pushed to the engines after each step")
    if sync.get("mode", "full") != "full":
        m.refuse("training.weight_sync.mode", "only full weights are pushed ('full')")
    if sync.get("weight_sync_interval", 1) != 1:
        m.refuse("training.weight_sync.weight_sync_interval", "weights are pushed after every step (1)")
    if set(sync.get("targets", ["policy"])) - {"policy"}:
        m.refuse("training.weight_sync.targets", "only the policy's engines take weights (['policy'])")


def _map_reference(m: _Mapper) -> None:
    placement = m.get("reference", "placement", "none")
    if placement not in ("none", "shared", "dedicated", "colocated"):
        m.refuse("reference.placement", f"{placement!r}: use 'none', 'shared' or 'dedicated'")
    if placement != "none":  # a KL reference: rlgate keeps the initial policy in the trainer
        m.put("algorithm", "kl_coef", REFERENCE_KL)


def _map_evaluation(m: _Mapper) -> None:
    seeds = m.get("evaluation", "seeds")
    instances = m.get("evaluation", "instances")
    if seeds is not None and not isinstance(seeds, list):
        m.refuse("evaluation.seeds", f"a list of seeds, not {seeds!r:.60}")
    if instances is not None and not (isinstance(instances, int) and 0 <= instances <= MAX_EVAL_INSTANCES):
        m.refuse("evaluation.instances", f"a whole number from 0 to {MAX_EVAL_INSTANCES}, not {instances!r:.60}")
    if seeds and instances is not None:
        seeds = [seeds[i % len(seeds)] for i in range(instances)]  # instances episodes, the seeds in turn
    m.put("evaluation", "seeds", seeds)
    m.put("evaluation", "every_n_iters", m.get("evaluation", "every_n_iters"))


def _map_compute(m: _Mapper) -> None:
    gpu_type = m.get("compute", "gpu_type")
    gpus = int(m.get("compute", "gpu_count", 0) or 0)
    for_vllm = m.get("topology", "gpus_for_vllm")
    for_training = m.get("topology", "gpus_for_training")
    m.put("rollout", "tensor_parallel_size", m.get("topology", "tensor_parallel"))
    on_cpu = gpu_type is not None and str(gpu_type).lower() == "cpu"  # then [topology]'s GPUs mean nothing
    if on_cpu or gpus == 0:
        if not on_cpu and (for_vllm or for_training or gpu_type is not None):
            m.refuse(
                "compute.gpu_count",
                "GPUs are asked for ([compute] gpu_type or [topology] gpus_for_*) but compute.gpu_count is "
                'missing or 0: give the number of GPUs (or gpu_type = "cpu")',
            )
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
    if shards < 1:
        m.refuse("topology.tensor_parallel", f"at least 1 GPU per replica, not {shards}")
    if for_vllm >= 1 and (for_vllm < shards or for_vllm % shards):
        m.refuse("topology", f"gpus_for_vllm ({for_vllm}) must be a multiple of tensor_parallel ({shards})")
    m.put("rollout", "num_gpus", shards if for_vllm >= 1 else for_vllm)  # a replica holds its shards
    m.put("rollout", "replicas", max(1, int(for_vllm) // shards))
    if for_training >= 1:
        m.put("compute", "trainer_workers", int(for_training))
        m.put("compute", "gpus_per_worker", 1)
    else:
        m.put("compute", "gpus_per_worker", for_training)
