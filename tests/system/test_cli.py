"""`rlgate check-parity` end to end, as a user runs it: the command's own main in
this process (the engines it starts are its own; ``python -m rlgate.cli`` itself
is run by the jobs and training tests). Its verdict on a failing report:
tests/unit/test_parity.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from rlgate.cli.main import main
from rlgate.rollout.parity import FRESH_ENGINE_TOLERANCE
from tests.support import needs_vllm


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def check_parity(capsys):
    def run(*args: str) -> tuple[Result, dict[str, str]]:
        code = main(["check-parity", *args])
        out, err = capsys.readouterr()
        return Result(code, out, err), dict(re.findall(r"^(\w+)=(\S+)", out, flags=re.M))

    return run


@needs_vllm
def test_check_parity_on_tiny_random(check_parity):
    result, fields = check_parity("--model", "tiny-random")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert float(fields["max_abs_logprob_diff"]) < 1e-4
    assert float(fields["logprob_change_from_update"]) > 1e-2  # the pushed step really moved the model
    assert float(fields["max_abs_logprob_diff_vs_fresh_engine"]) <= FRESH_ENGINE_TOLERANCE
    agreement = re.search(r"greedy_agreement=(\d+)/(\d+) \(near ties: (\d+)\)", result.stdout)
    agree, total, ties = map(int, agreement.groups())
    assert total == 8 and agree + ties == total  # a near tie may go either way (kernel rounding)
    assert float(fields["weight_update_seconds"]) > 0
    assert "parity: OK" in result.stdout


@needs_vllm
def test_check_parity_on_smollm2(check_parity):
    """A real model's weights, before and after a push (the fresh-engine comparison,
    a second engine start, is the tiny-random test's)."""
    result, fields = check_parity("--model", "smollm2-135m-instruct", "--no-fresh-engine")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert float(fields["max_abs_logprob_diff"]) < 2e-4
    assert "max_abs_logprob_diff_vs_fresh_engine" not in fields
    assert float(fields["logprob_change_from_update"]) > 1e-2


def test_check_parity_rejects_unknown_models(check_parity):
    result, _ = check_parity("--model", "not-a-model")
    assert result.returncode == 2 and "unknown model" in result.stderr


def test_check_parity_of_a_lora_adapter_push(check_parity):
    """--lora: the step trains an adapter, the push sends it alone, and a fresh engine
    starts from the folder PEFT saved (the HF engine here; vLLM's adapters are
    tests/integration/test_lora_engine.py's and the LoRA driver run's)."""
    result, fields = check_parity("--model", "tiny-random", "--lora", "4", "--engine", "hf")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert float(fields["max_abs_logprob_diff"]) < 1e-4
    assert float(fields["logprob_change_from_update"]) > 1e-2
    assert float(fields["max_abs_logprob_diff_vs_fresh_engine"]) <= FRESH_ENGINE_TOLERANCE
    assert "pushed as a LoRA adapter" in result.stdout and "parity: OK" in result.stdout
