"""The settings a CPU vLLM engine starts with, without starting one."""

from __future__ import annotations

import os

import pytest

from rlgate.rollout.engines.vllm import cpu_environment_defaults, engine_threads


def test_a_one_shard_cpu_engine_runs_its_model_in_the_engine_core_on_every_core():
    defaults = cpu_environment_defaults()
    assert defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # no worker process of its own
    assert defaults["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert defaults["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{(os.cpu_count() or 1) - 1}"


@pytest.mark.parametrize(
    "bind, threads",
    [("0-3", 4), ("0,2,4-5", 4), ("7", 1), ("0-1|2-3", 2), ("2-5,8", 5)],
)
def test_the_engine_computes_on_as_many_threads_as_the_binding_names_cpus(monkeypatch, bind, threads):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    assert engine_threads() == threads


@pytest.mark.parametrize("bind", [None, "auto", "nobind", ""])
def test_a_binding_that_names_no_cpus_means_every_cpu_the_process_may_use(monkeypatch, bind):
    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert engine_threads() == allowed
