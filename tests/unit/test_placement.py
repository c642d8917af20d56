"""rlgate.training.placement: the bundles a run asks for, and what no cluster of given nodes can hold."""

from __future__ import annotations

import pytest

from rlgate.config import ConfigError, parse_config
from rlgate.training.placement import TRAINER_RESOURCE, Bundle, autoscaler_nodes, launcher_node_types, plan, unplaceable


def config(**sections):
    return parse_config({"task": {"builtin": "vowels"}, **sections})


def test_plan_lists_replicas_then_workers():
    run = config(
        rollout={"replicas": 2, "num_gpus": 2, "tensor_parallel_size": 2, "num_cpus": 4},
        compute={"trainer_workers": 3, "cpus_per_worker": 2},
    )
    bundles = plan(run, trainer_gpus=1)
    assert bundles == [Bundle("rollout", 4, 2)] * 2 + [Bundle("trainer", 2, 1)] * 3
    assert bundles[0].as_ray() == {"CPU": 4, "GPU": 2} and plan(config(), 0)[0].as_ray() == {"CPU": 1.0}


def test_a_fitting_plan_is_placed_split_or_colocated():
    split = plan(config(rollout={"num_gpus": 1}, compute={"trainer_workers": 2}), trainer_gpus=1)
    assert unplaceable(split, [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 2}]) is None
    shared = plan(config(rollout={"num_gpus": 0.5}), trainer_gpus=0.5)  # one GPU, replica and worker together
    assert unplaceable(shared, [{"CPU": 4, "GPU": 1}]) is None
    assert unplaceable(plan(config(), 0), [{"CPU": 2}]) is None  # this machine: CPU only


def test_what_can_never_be_placed_says_what_is_missing():
    gpus = plan(config(rollout={"num_gpus": 1}, compute={"trainer_workers": 4}), trainer_gpus=1)
    assert unplaceable(gpus, [{"CPU": 16, "GPU": 2}]) == (
        "the cluster can never run this: it needs 5 GPU in all (the cluster has 2)"
    )
    wide = plan(config(rollout={"num_gpus": 4, "tensor_parallel_size": 4}), trainer_gpus=0)
    message = unplaceable(wide, [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}])  # 4 GPUs in all, never on one node
    assert message.startswith("no node can hold a rollout bundle of 1 CPU and 4 GPU")
    assert "the largest node has 8 CPU and 2 GPU" in message
    assert unplaceable(plan(config(compute={"cpus_per_worker": 3}), 0), [{"CPU": 2}]) == (
        "the cluster can never run this: it needs 4 CPU in all (the cluster has 2)"
    )


def test_split_placement_keeps_replicas_and_workers_on_their_own_nodes():
    split = config(compute={"placement": "split", "trainer_workers": 2})
    bundles = plan(split, trainer_gpus=0)
    assert bundles[0].as_ray() == {"CPU": 1.0, "rlgate_rollout": 0.001}
    assert bundles[1].as_ray() == {"CPU": 1.0, TRAINER_RESOURCE: 0.001}
    rollout_node, trainer_node = {"CPU": 2, "rlgate_rollout": 1}, {"CPU": 2, TRAINER_RESOURCE: 1}
    assert unplaceable(bundles, [rollout_node, trainer_node]) is None
    # the same CPUs without the trainer label: the workers have nowhere to go, though CPUs are free
    message = unplaceable(bundles, [rollout_node, {"CPU": 8}])
    assert message.startswith('[compute] placement = "split" puts trainer bundles only on nodes offering')
    assert "ray start --resources='{\"rlgate_trainer\": 1}'" in message
    # labelled, but too small for two workers beside nothing else
    message = unplaceable(bundles, [rollout_node, {"CPU": 1, TRAINER_RESOURCE: 1}, {"CPU": 8}])
    assert message.startswith("no node offering `rlgate_trainer` can hold a trainer bundle of 1 CPU and 0 GPU")
    # shared placement puts the same bundles anywhere they fit
    assert unplaceable(plan(config(compute={"trainer_workers": 2}), 0), [{"CPU": 3}]) is None


def test_a_replica_holds_all_its_tensor_parallel_gpus():
    assert plan(config(rollout={"num_gpus": 2, "tensor_parallel_size": 2}), 0)[0].gpus == 2
    with pytest.raises(ConfigError, match=r"num_gpus \(1\) must equal it"):
        config(rollout={"num_gpus": 1, "tensor_parallel_size": 2})


def test_nodes_the_autoscaler_may_add_count_as_placeable():
    import yaml

    from tests.support import ROOT

    launcher = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = launcher_node_types(launcher)  # the worker types, at their most
    assert sorted(most for _, most in types) == [2, 4]
    head_only = [launcher["available_node_types"]["head"]["resources"]]
    run = plan(config(rollout={"num_gpus": 1}, compute={"trainer_workers": 4, "placement": "split"}), 1)
    assert unplaceable(run, head_only + autoscaler_nodes(types, len(run))) is None  # the GPU nodes may come
    assert "no node does" in unplaceable(run, head_only)  # were they never to come
    assert "needs 5 GPU in all (the cluster has 0)" in unplaceable(plan(config(rollout={"num_gpus": 1}), 4), head_only)
    unbounded = autoscaler_nodes([({"CPU": 4, "GPU": 1}, -1)], bundles=5)
    assert unbounded == [{"CPU": 4, "GPU": 1}] * 5


def test_what_keeps_a_run_from_starting_now_is_said():
    from rlgate.training.placement import shortfall

    bundles = plan(config(rollout={"num_cpus": 1}, compute={"cpus_per_worker": 1}), 0)
    assert shortfall(bundles, [{"CPU": 2.0}]) is None
    assert shortfall(bundles, [{"CPU": 1.0}]) == (
        "needs 1 CPU for a trainer worker; the most free on a node is 0 CPU"  # the replica took the one
    )
    gpu = plan(config(rollout={"num_gpus": 1}), 1)
    assert shortfall(gpu, [{"CPU": 8.0, "GPU": 1.0}]) == (
        "needs 1 CPU and 1 GPU for a trainer worker; the most free on a node is 7 CPU and 0 GPU"
    )


def test_a_run_waits_saying_why_until_it_fits_or_gives_up():
    from rlgate.training.placement import wait_for_room

    bundles = plan(config(rollout={"num_cpus": 1}, compute={"cpus_per_worker": 1}), 0)
    free = iter([[{"CPU": 1.0}]] * 3 + [[{"CPU": 2.0}]])
    notes, now = [], [0.0]
    clock = lambda: now[0]  # noqa: E731

    def sleep(seconds: float) -> None:
        now[0] += seconds

    wait_for_room(
        bundles, 60, notes.append, free=lambda: next(free), held=lambda: "serve (1 CPU)", sleep=sleep, clock=clock
    )
    assert notes == [
        "waiting for resources: needs 1 CPU for a trainer worker; the most free on a node is 0 CPU; "
        "held by: serve (1 CPU)",
        None,  # said once while it waited, then that it fits
    ]
    with pytest.raises(RuntimeError, match=r"gave up after 10 s \(\[jobs\] start_timeout_s\) waiting for resources"):
        wait_for_room(
            bundles, 10, notes.append, free=lambda: [{"CPU": 1.0}], held=lambda: "x", sleep=sleep, clock=clock
        )
