"""GPU-only paths: CUDA vLLM with the CUDA-IPC weight push, and its CUDA LoRA
kernels serving a pushed adapter. Skipped without a GPU; run them with
scripts/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import pytest

from rlgate.config import LoraSettings
from rlgate.rollout.parity import failures, run_parity

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model, tolerance", [("tiny-random", 1e-4), ("smollm2-135m-instruct", 2e-4)])
def test_ipc_weight_push_is_exact(model, tolerance):
    report = run_parity(model, engine="vllm", weight_sync="ipc")
    assert not failures(report, tolerance), report.lines()
    assert report.update_change > 1e-2
    assert report.diff_vs_fresh_engine is not None and report.diff_vs_fresh_engine <= 1e-6


def test_file_push_on_gpu_is_exact_too():
    report = run_parity("tiny-random", engine="vllm", weight_sync="file", fresh_engine=False)
    assert not failures(report, 1e-4), report.lines()


def test_a_lora_adapter_push_on_gpu_is_exact():
    """vLLM's CUDA LoRA kernels against PEFT's float32 model (not yet measured on a GPU:
    the bar is the full-weight push's)."""
    report = run_parity("smollm2-135m-instruct", engine="vllm", learning_rate=1e-2, lora=LoraSettings(rank=8, alpha=16))
    assert not failures(report, 2e-4), report.lines()
    assert report.update_change > 1e-2
