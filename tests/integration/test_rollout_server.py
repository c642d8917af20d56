"""RolloutServer as a real Ray Serve deployment (local Ray, tiny-random, the configured engine)."""

from __future__ import annotations

import copy
import os

import pytest
from safetensors.torch import load_file

from rlgate.config import load_config
from rlgate.rollout.engines import SamplingParams
from rlgate.rollout.parity import _one_optimizer_step, _reference_logprobs
from tests.support import ROOT, replica_process


@pytest.fixture(scope="module")
def rollout(ray_session):
    from ray import serve

    from rlgate.serving.app import build_rollout_app

    config = load_config(ROOT / "configs" / "tiny.toml")
    handle = serve.run(build_rollout_app(config), name="rollout-test", route_prefix=None)
    yield handle
    serve.delete("rollout-test")


def stream(handle, prompt, **params):
    chunks = list(handle.options(stream=True).generate.remote(prompt, SamplingParams(**params).model_dump()))
    return (
        [t for c in chunks for t in c.token_ids],
        [lp for c in chunks for lp in c.logprobs],
        [v for c in chunks for v in c.versions],
        chunks[-1].finish_reason,
    )


def test_health_and_version_are_queryable(rollout, tiny_path):
    health = rollout.health.remote().result()
    assert health["ready"] and health["model"] == str(tiny_path)
    assert health["engine"] in ("vllm", "hf") and health["paused"] is False
    assert rollout.version.remote().result() == health["version"]


def test_streams_exact_tokens_through_a_serve_handle(rollout, reference_model, prompts):
    tokens, logprobs, versions, finish = stream(rollout, prompts[0], max_tokens=12, temperature=0, ignore_eos=True)
    assert len(tokens) == 12 and finish == "length"
    assert logprobs == pytest.approx(_reference_logprobs(reference_model, prompts[0], tokens), abs=1e-4)
    assert set(versions) == {rollout.version.remote().result()}


def test_weights_pushed_through_the_handle_are_served(rollout, reference_model, prompts, tiny_path):
    tokens, _, _, _ = stream(rollout, prompts[1], max_tokens=16, temperature=0, ignore_eos=True)
    stepped = copy.deepcopy(reference_model)

    class Done:  # the shape _one_optimizer_step expects
        token_ids = tokens

    _one_optimizer_step(stepped, [prompts[1]], [Done, Done], learning_rate=1e-3)
    version = rollout.version.remote().result() + 1
    report = rollout.update_weights.remote(stepped.state_dict(), version).result()
    assert report["version"] == version and report["seconds"] > 0
    new_tokens, logprobs, versions, _ = stream(rollout, prompts[1], max_tokens=16, temperature=0, ignore_eos=True)
    assert set(versions) == {version}
    assert logprobs == pytest.approx(_reference_logprobs(stepped, prompts[1], new_tokens), abs=1e-4)
    original = load_file(tiny_path / "model.safetensors")
    rollout.update_weights.remote(original, version + 1).result()
    assert rollout.health.remote().result()["version"] == version + 1


def test_pause_and_resume_through_the_handle(rollout, prompts):
    rollout.pause.remote().result()
    assert rollout.health.remote().result()["paused"] is True
    params = SamplingParams(max_tokens=4, ignore_eos=True).model_dump()
    pending = rollout.options(stream=True).generate.remote(prompts[2], params)
    rollout.resume.remote().result()
    assert sum(len(c.token_ids) for c in pending) == 4
    assert rollout.health.remote().result()["paused"] is False


def test_bad_sampling_parameters_name_the_field(rollout, prompts):
    with pytest.raises(Exception, match="temperature"):
        list(rollout.options(stream=True).generate.remote(prompts[0], {"temperature": -1.0}))
    with pytest.raises(Exception, match="unknown_field|Extra inputs"):
        list(rollout.options(stream=True).generate.remote(prompts[0], {"unknown_field": 1}))
    # the replica survives bad input
    tokens, _, _, _ = stream(rollout, prompts[0], max_tokens=3, temperature=0, ignore_eos=True)
    assert len(tokens) == 3


def test_the_replicas_cpu_engine_core_starts_with_the_cpu_defaults(rollout):
    """The settings ``cpu_environment_defaults`` names reach the process that runs the
    model (vLLM spawns it from the replica; libgomp reads its spin count as it loads)."""

    from rlgate.rollout.engines.vllm import cpu_environment_defaults

    if rollout.health.remote().result()["engine"] != "vllm":
        pytest.skip("the HF engine has no engine core")
    replica = replica_process("rollout-test", "RolloutServer")
    [core] = [p for p in replica.children(recursive=True) if "VLLM::EngineCore" in " ".join(p.cmdline())]
    environ = core.environ()
    for key, value in cpu_environment_defaults().items():  # a default, or what this process set (`make test`'s cores)
        assert environ.get(key) == os.environ.get(key, value), key
