"""rlgate.placement: the bundles a run asks for, and what no cluster of given nodes can hold."""

from __future__ import annotations

from rlgate.config import parse_config
from rlgate.placement import Bundle, plan, unplaceable


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
