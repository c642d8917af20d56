"""Where a run's rollout replicas and trainer workers go, by Ray resources (pure).

A run asks for one bundle per rollout replica (``[rollout] num_cpus`` and
``num_gpus``, which covers all its ``tensor_parallel_size`` shards: a
replica's engine lives on one node) and one per trainer worker
(``[compute] cpus_per_worker``, ``gpus_per_worker``). :func:`plan` lists
them; :func:`unplaceable` says, against the cluster's nodes, what can never
be placed and why, so a run fails at once instead of waiting forever for a
placement group. Fractional GPUs (e.g. 0.5 each) let a replica and a worker
share one GPU (co-located); whole GPUs keep them apart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bundle:
    role: str  # "rollout" or "trainer"
    cpus: float
    gpus: float

    def as_ray(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus} if self.gpus else {"CPU": self.cpus}


def plan(config, trainer_gpus: float) -> list[Bundle]:
    """The bundles of a run: its rollout replicas, then its trainer workers."""
    rollout, compute = config.rollout, config.compute
    replica = Bundle("rollout", rollout.num_cpus, rollout.num_gpus)
    worker = Bundle("trainer", compute.cpus_per_worker, trainer_gpus)
    return [replica] * rollout.replicas + [worker] * compute.trainer_workers


def unplaceable(bundles: list[Bundle], nodes: list[dict[str, float]]) -> str | None:
    """Why ``bundles`` can never all be placed on ``nodes`` (each node's total
    resources), or None. First fit, largest first: a bundle must fit on one node."""
    free = [{"CPU": n.get("CPU", 0.0), "GPU": n.get("GPU", 0.0)} for n in nodes]
    for bundle in sorted(bundles, key=lambda b: (b.gpus, b.cpus), reverse=True):
        node = next((n for n in free if n["CPU"] >= bundle.cpus - 1e-9 and n["GPU"] >= bundle.gpus - 1e-9), None)
        if node is None:
            return _why(bundle, bundles, nodes)
        node["CPU"] -= bundle.cpus
        node["GPU"] -= bundle.gpus
    return None


def _why(bundle: Bundle, bundles: list[Bundle], nodes: list[dict[str, float]]) -> str:
    need = {"CPU": sum(b.cpus for b in bundles), "GPU": sum(b.gpus for b in bundles)}
    have = {name: sum(n.get(name, 0.0) for n in nodes) for name in ("CPU", "GPU")}
    short = [f"{need[k]:g} {k} in all (the cluster has {have[k]:g})" for k in ("CPU", "GPU") if need[k] > have[k]]
    if short:
        return "the cluster can never run this: it needs " + ", ".join(short)
    biggest = {name: max((n.get(name, 0.0) for n in nodes), default=0.0) for name in ("CPU", "GPU")}
    return (
        f"no node can hold a {bundle.role} bundle of {bundle.cpus:g} CPU and {bundle.gpus:g} GPU "
        f"(the largest node has {biggest['CPU']:g} CPU and {biggest['GPU']:g} GPU, and the others' bundles "
        "take the rest); use smaller bundles (fewer GPUs per replica or worker) or larger nodes"
    )
