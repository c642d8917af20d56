"""Where a run's rollout replicas and trainer workers go, by Ray resources.

A run asks for one bundle per rollout replica (``[rollout] num_cpus`` and
``num_gpus``, which covers all its ``tensor_parallel_size`` shards: a
replica's engine lives on one node) and one per trainer worker
(``[compute] cpus_per_worker``, ``gpus_per_worker``). :func:`plan` lists
them; :func:`unplaceable` says, against the cluster's nodes, what can never
be placed and why, so a run fails at once instead of waiting forever for a
placement group; :func:`shortfall` says what keeps them from being placed
now. All three are pure; :func:`wait_for_room` waits, saying why, until they
fit what is free (or gives up).

``[compute] placement``: ``"shared"`` lets Ray put bundles wherever they fit
(fractional GPUs, e.g. 0.5 each, co-locate a replica and a worker on one
GPU); ``"split"`` adds a sliver of a custom resource to each bundle, so
replicas land only on nodes that offer :data:`ROLLOUT_RESOURCE` and workers
only on nodes that offer :data:`TRAINER_RESOURCE` (``ray start --resources``,
or a node type's ``resources`` in ``cluster.yaml``).

:func:`cluster_nodes` (needs a Ray connection) lists the nodes to check
against: those alive, plus every node the autoscaler may add.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROLLOUT_RESOURCE = "rlgate_rollout"
TRAINER_RESOURCE = "rlgate_trainer"
SLIVER = 0.001  # of a split-placement resource per bundle: a node offering 1 holds a thousand bundles
ROLE_RESOURCE = {"rollout": ROLLOUT_RESOURCE, "trainer": TRAINER_RESOURCE}


@dataclass(frozen=True)
class Bundle:
    role: str  # "rollout" or "trainer"
    cpus: float
    gpus: float
    split: bool = False  # only on nodes offering the role's resource

    @property
    def label(self) -> str | None:
        return ROLE_RESOURCE[self.role] if self.split else None

    def as_ray(self) -> dict[str, float]:
        """The bundle as Ray resources (``ray_actor_options`` / ``resources_per_worker``)."""
        resources = {"CPU": self.cpus} | ({"GPU": self.gpus} if self.gpus else {})
        return resources | ({self.label: SLIVER} if self.split else {})

    def custom(self) -> dict[str, float]:
        """The bundle's resources beyond CPU and GPU."""
        return {self.label: SLIVER} if self.split else {}


def replica_bundle(config) -> Bundle:
    """What one RolloutServer replica asks for."""
    rollout = config.rollout
    return Bundle("rollout", rollout.num_cpus, rollout.num_gpus, config.compute.placement == "split")


def worker_bundle(config, trainer_gpus: float) -> Bundle:
    """What one Ray Train worker asks for."""
    compute = config.compute
    return Bundle("trainer", compute.cpus_per_worker, trainer_gpus, compute.placement == "split")


def plan(config, trainer_gpus: float) -> list[Bundle]:
    """The bundles of a run: its rollout replicas, then its trainer workers."""
    replicas = [replica_bundle(config)] * config.rollout.replicas
    return replicas + [worker_bundle(config, trainer_gpus)] * config.compute.trainer_workers


def unplaceable(bundles: list[Bundle], nodes: list[dict[str, float]]) -> str | None:
    """Why ``bundles`` can never all be placed on ``nodes`` (each node's total
    resources), or None. First fit, largest first: a bundle must fit on one node."""
    misfit, _ = _first_fit(bundles, nodes)
    return None if misfit is None else _why(misfit, bundles, nodes)


def shortfall(bundles: list[Bundle], free: list[dict[str, float]]) -> str | None:
    """What keeps ``bundles`` from being placed now on ``free`` (each node's free
    resources), in words, or None when they all fit. First fit, largest first."""
    misfit, left = _first_fit(bundles, free)
    if misfit is None:
        return None
    what = {"rollout": "a rollout replica", "trainer": "a trainer worker"}[misfit.role]
    needs = f"{misfit.cpus:g} CPU" + (f" and {misfit.gpus:g} GPU" if misfit.gpus else "")
    room = {name: max((n.get(name, 0.0) for n in left), default=0.0) for name in ("CPU", "GPU")}
    have = f"{room['CPU']:g} CPU" + (f" and {room['GPU']:g} GPU" if misfit.gpus else "")
    return f"needs {needs} for {what}; the most free on a node is {have}"


def _first_fit(bundles: list[Bundle], nodes: list[dict[str, float]]) -> tuple[Bundle | None, list[dict]]:
    """Place ``bundles`` on copies of ``nodes``, largest first: the first bundle that
    fits nowhere (None if all fit) and what the nodes had left then."""
    left = [dict(n) for n in nodes]
    for bundle in sorted(bundles, key=lambda b: (b.gpus, b.cpus), reverse=True):
        node = next((n for n in left if _fits(bundle, n)), None)
        if node is None:
            return bundle, left
        for name, amount in bundle.as_ray().items():
            node[name] = node.get(name, 0.0) - amount
    return None, left


def _fits(bundle: Bundle, node: dict[str, float]) -> bool:
    return all(node.get(name, 0.0) >= amount - 1e-9 for name, amount in bundle.as_ray().items())


def _why(bundle: Bundle, bundles: list[Bundle], nodes: list[dict[str, float]]) -> str:
    if bundle.split and not any(n.get(bundle.label, 0.0) > 0 for n in nodes):
        return (
            f'[compute] placement = "split" puts {bundle.role} bundles only on nodes offering the '
            f"`{bundle.label}` resource, and no node does; start those nodes with "
            f"`ray start --resources='{{\"{bundle.label}\": 1}}'` (cluster.yaml's node types declare it)"
        )
    need = {"CPU": sum(b.cpus for b in bundles), "GPU": sum(b.gpus for b in bundles)}
    have = {name: sum(n.get(name, 0.0) for n in nodes) for name in ("CPU", "GPU")}
    short = [f"{need[k]:g} {k} in all (the cluster has {have[k]:g})" for k in ("CPU", "GPU") if need[k] > have[k]]
    if short:
        return "the cluster can never run this: it needs " + ", ".join(short)
    eligible = [n for n in nodes if not bundle.split or n.get(bundle.label, 0.0) > 0]
    biggest = {name: max((n.get(name, 0.0) for n in eligible), default=0.0) for name in ("CPU", "GPU")}
    where = f"node offering `{bundle.label}`" if bundle.split else "node"
    return (
        f"no {where} can hold a {bundle.role} bundle of {bundle.cpus:g} CPU and {bundle.gpus:g} GPU "
        f"(the largest {where} has {biggest['CPU']:g} CPU and {biggest['GPU']:g} GPU, and the others' bundles "
        "take the rest); use smaller bundles (fewer GPUs per replica or worker) or larger nodes"
    )


def autoscaler_nodes(node_types: list[tuple[dict[str, float], int]], bundles: int) -> list[dict[str, float]]:
    """The nodes an autoscaler may add: each type's resources, as many times as
    its most workers (an unbounded type, -1, as many as there are bundles)."""
    return [dict(resources) for resources, most in node_types for _ in range(bundles if most < 0 else most)]


def cluster_nodes(bundles: int, bootstrap: Path = Path("~/ray_bootstrap_config.yaml")) -> list[dict[str, float]]:
    """The resources of every node the connected cluster has or may add: the
    nodes alive, plus the autoscaler's node types at their most (as Ray's
    autoscaler publishes them, or the cluster launcher's config on the head)."""
    import ray
    from ray._private.state import state  # the autoscaler's node types: no public API yet

    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    types: list[tuple[dict[str, float], int]] = []
    try:
        published = state.get_cluster_config()
    except Exception:  # an older GCS or no autoscaler: the nodes alive are all there is
        published = None
    if published is not None:
        types = [(dict(group.resources), group.max_count) for group in published.node_group_configs]
    elif bootstrap.expanduser().is_file():
        import yaml

        types = launcher_node_types(yaml.safe_load(bootstrap.expanduser().read_text()) or {})
    return nodes + autoscaler_nodes(types, bundles)


def launcher_node_types(launcher: dict) -> list[tuple[dict[str, float], int]]:
    """(resources, most workers) of each worker node type in a cluster-launcher config."""
    head = launcher.get("head_node_type")
    return [
        (dict(kind.get("resources", {})), kind.get("max_workers", launcher.get("max_workers", 0)))
        for name, kind in launcher.get("available_node_types", {}).items()
        if name != head
    ]


def free_nodes() -> list[dict[str, float]]:
    """Each alive node's free resources now (needs a Ray connection)."""
    from ray._private.state import available_resources_per_node  # per node: no public API yet

    return [dict(resources) for resources in available_resources_per_node().values()]


def holders(most: int = 6) -> str:
    """Who holds the cluster's CPUs and GPUs now, largest first: "name (2 CPU), ..."."""
    from ray.util.state import list_actors

    held = []
    alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10_000, raise_on_missing_output=False)
    for actor in alive:
        resources = actor.required_resources or {}
        cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
        if cpus or gpus:
            name = actor.name or actor.repr_name or actor.class_name
            held.append((gpus, cpus, f"{name} ({cpus:g} CPU" + (f", {gpus:g} GPU)" if gpus else ")")))
    held.sort(reverse=True)
    shown = ", ".join(text for _, _, text in held[:most])
    return (shown + (f" and {len(held) - most} more" if len(held) > most else "")) or "nothing rlgate can see"


def wait_for_room(
    bundles: list[Bundle],
    timeout_s: float,
    note: Callable[[str | None], None],
    free: Callable[[], list[dict[str, float]]] = free_nodes,
    held: Callable[[], str] = holders,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once ``bundles`` fit in what is free. Meanwhile ``note`` gets the
    reason ("waiting for resources: needs ...; held by: ...") whenever it changes,
    and None once they fit; RuntimeError with the reason after ``timeout_s``."""
    deadline, said = clock() + timeout_s, None
    while (short := shortfall(bundles, free())) is not None:
        reason = f"waiting for resources: {short}; held by: {held()}"
        if reason != said:
            note(reason)
            said = reason
        if clock() >= deadline:
            raise RuntimeError(f"gave up after {timeout_s:g} s ([jobs] start_timeout_s) {reason}")
        sleep(2.0)
    if said is not None:
        note(None)
