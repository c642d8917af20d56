"""vLLM serving LoRA adapters as ``[training.lora]`` pushes them: each version is
an adapter over unchanged base weights, a request finishes on the adapter it
started with while new requests take the newest, the old one is unloaded
once no request uses it, and every token's logprob is the PEFT model's."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from rlgate.config import LoraSettings
from rlgate.rollout import lora
from rlgate.rollout.engines import Completion, SamplingParams, collect
from tests.support import lora_model, needs_vllm

pytestmark = needs_vllm
TOLERANCE = 1e-4  # vLLM's fp32 CPU kernels against PyTorch's (measured 1.7e-5 on tiny-random)


def adapter_model(reference_model, seed: int):
    """tiny-random with a rank-8 adapter of its own (B drawn, not zero)."""
    return lora_model(reference_model, rank=8, seed=seed)


def worst_difference(model, prompt: list[int], completion) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    wanted = expected[torch.arange(len(completion.token_ids)), torch.tensor(completion.token_ids)]
    return float((torch.tensor(completion.logprobs) - wanted).abs().max())


@pytest.fixture(scope="module")
async def lora_engine(tiny_path):
    from rlgate.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_path, max_model_len=1024, cpu_kv_cache_gib=0.5, lora_rank=8, max_loras=2)
    await engine.ready()
    yield engine
    await engine.shutdown()


async def test_a_request_finishes_on_the_adapter_it_started_with(lora_engine, reference_model, prompts):
    first, second = adapter_model(reference_model, 1), adapter_model(reference_model, 2)
    await lora_engine.update_weights(lora.adapter_of(first), version=1)
    assert lora_engine.adapters_loaded() == ["v1"] and lora_engine.version == 1

    long = SamplingParams(max_tokens=64, temperature=1.0, seed=11, ignore_eos=True)
    stream = lora_engine.generate(prompts[0], long)
    head = await anext(stream)  # under way on v1
    await lora_engine.pause()  # frozen mid-way, so the new version surely comes while it is in flight
    report = await lora_engine.update_weights(lora.adapter_of(second), version=2)
    assert report.version == 2 and report.tensors == len(lora.adapter_of(second).tensors)
    assert lora_engine.adapters_loaded() == ["v1", "v2"]  # v1 is still in use
    short = asyncio.ensure_future(
        collect(lora_engine.generate(prompts[1], SamplingParams(max_tokens=8, temperature=1.0, seed=5)))
    )
    await lora_engine.resume()
    tail = [chunk async for chunk in stream]
    (newer,) = await short

    older = Completion(index=0)
    for chunk in [head, *tail]:
        older.add(chunk)
    assert len(older.token_ids) == 64 and set(older.versions) == {1}
    assert worst_difference(first, prompts[0], older) < TOLERANCE  # all 64 tokens from v1's adapter
    assert set(newer.versions) == {2} and worst_difference(second, prompts[1], newer) < TOLERANCE
    assert lora_engine.adapters_loaded() == ["v2"]  # v1 was unloaded with its last request


async def test_what_a_lora_engine_refuses_says_why(lora_engine, reference_model, tiny_path):
    with pytest.raises(ValueError, match="serves LoRA adapters: push an Adapter, not full weights"):
        await lora_engine.update_weights(reference_model.state_dict(), version=9)
    wide = lora.attach(copy.deepcopy(reference_model), LoraSettings(rank=16, alpha=16.0))
    with pytest.raises(ValueError, match="the adapter's rank 16 is above the engine's LoRA rank 8"):
        await lora_engine.update_weights(lora.adapter_of(wide), version=9)
    with pytest.raises(ValueError, match="older than the served version"):
        await lora_engine.update_weights(lora.adapter_of(adapter_model(reference_model, 3)), version=0)


async def test_tenants_of_one_engine_are_each_served_by_their_own_adapter(
    lora_engine, reference_model, prompts, tmp_path
):
    """An engine pool's engine: runs a and b each get their own adapter and version
    (b starts from a folder, as a resumed run does), requests of both in one batch,
    and a run dropped from the pool loses its adapter and is refused."""
    from rlgate.rollout.engines.vllm import Tenant, UnknownTenant

    ours, theirs = adapter_model(reference_model, 4), adapter_model(reference_model, 5)
    lora.adapter_of(theirs).write(tmp_path / "resumed")
    await lora_engine.add_tenant("a", 0)
    await lora_engine.add_tenant("b", 3, tmp_path / "resumed")
    await Tenant(lora_engine, "a").update_weights(lora.adapter_of(ours), 1)
    assert lora_engine.tenants() == {"a": 1, "b": 3} and Tenant(lora_engine, "b").version == 3
    assert {"a-v1", "b-v3"} <= set(lora_engine.adapters_loaded())

    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    requests = [lora_engine.generate(prompts[i], params, tenant=run) for i, run in enumerate("abab")]
    done = await asyncio.gather(*(collect(r) for r in requests))  # the four in one batch
    for i, ((completion,), run) in enumerate(zip(done, "abab")):
        model, name, version = (ours, "a-v1", 1) if run == "a" else (theirs, "b-v3", 3)
        assert completion.adapter == name and set(completion.versions) == {version}
        assert worst_difference(model, prompts[i], completion) < TOLERANCE  # its own adapter, not the other's
    (own,) = await collect(lora_engine.generate(prompts[0], params))
    assert own.adapter == f"v{lora_engine.version}"  # the engine's own run is a tenant apart

    with pytest.raises(ValueError, match="older than the served version 3"):
        await Tenant(lora_engine, "b").update_weights(lora.adapter_of(ours), 2)
    await lora_engine.drop_tenant("b")
    assert "b-v3" not in lora_engine.adapters_loaded() and (tmp_path / "resumed").is_dir()  # not ours to delete
    with pytest.raises(UnknownTenant, match="run 'b' is not served by this engine pool"):
        await collect(lora_engine.generate(prompts[0], params, tenant="b"))
    await lora_engine.drop_tenant("a")
    assert lora_engine.tenants() == {}
