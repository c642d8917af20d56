"""vLLM against the Hugging Face reference, and in-place weight updates.

The reference is a float32 transformers model; "one optimizer step" is a real
AdamW step on it. Every test leaves the shared engines on the original weights.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlgate.rollout.engines import SamplingParams, WeightsMismatchError, collect
from rlgate.rollout.engines.base import read_safetensors_specs
from rlgate.rollout.engines.hf import processed_logprobs
from rlgate.rollout.parity import _one_optimizer_step, _reference_logprobs
from tests.support import assert_same_greedy

pytestmark = pytest.mark.usefixtures("restore_weights")


@pytest.fixture
async def restore_weights(request, tiny_path):
    yield
    original = load_file(tiny_path / "model.safetensors")
    for name in ("vllm_engine", "hf_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            await engine.update_weights(original, engine.version + 1)


async def greedy(engine, prompts, max_tokens=24):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [r[0] for r in await asyncio.gather(*[collect(engine.generate(p, params)) for p in prompts])]


def assert_same_greedy_runs(model, prompts, first, second):
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert_same_greedy(model, prompt, a.token_ids, b.token_ids)


def max_diff_vs(model, prompts, completions):
    return max(
        abs(a - b)
        for p, c in zip(prompts, completions)
        for a, b in zip(c.logprobs, _reference_logprobs(model, p, c.token_ids))
    )


async def one_step(reference_model, prompts, engine):
    model = copy.deepcopy(reference_model)
    completions = await greedy(engine, prompts)
    _one_optimizer_step(model, prompts, completions + completions, learning_rate=1e-3)
    return model


async def test_vllm_greedy_and_logprobs_match_the_reference(vllm_engine, hf_engine, reference_model, prompts):
    from_vllm = await greedy(vllm_engine, prompts)
    from_hf = await greedy(hf_engine, prompts)
    assert_same_greedy_runs(reference_model, prompts, from_vllm, from_hf)
    assert max_diff_vs(reference_model, prompts, from_vllm) < 1e-4
    assert max_diff_vs(reference_model, prompts, from_hf) < 1e-4


async def test_sampled_logprobs_are_those_of_the_processed_distribution(vllm_engine, reference_model, prompts):
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=40, top_p=0.9, seed=4, ignore_eos=True)
    [out] = await collect(vllm_engine.generate(prompts[0], params))
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompts[0] + out.token_ids])).logits[0].float()
    start = len(prompts[0]) - 1
    expected = [
        processed_logprobs(logits[start + i], 0.7, 40, 0.9)[token].item() for i, token in enumerate(out.token_ids)
    ]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


async def test_update_keeps_both_engines_exact(vllm_engine, hf_engine, reference_model, prompts, tiny_path):
    before = await greedy(vllm_engine, prompts)
    stepped = await one_step(reference_model, prompts, hf_engine)
    assert max_diff_vs(stepped, prompts, before) > 1e-2, "the step must move the logprobs for this test to bite"
    version = max(vllm_engine.version, hf_engine.version) + 1
    for engine in (vllm_engine, hf_engine):
        report = await engine.update_weights(stepped.state_dict(), version)
        assert report.version == version
        assert report.tensors == len(read_safetensors_specs(tiny_path))  # the tied lm_head is not sent
    after_vllm = await greedy(vllm_engine, prompts)
    after_hf = await greedy(hf_engine, prompts)
    assert max_diff_vs(stepped, prompts, after_vllm) < 1e-4
    assert max_diff_vs(stepped, prompts, after_hf) < 1e-4
    assert_same_greedy_runs(stepped, prompts, after_vllm, after_hf)
    assert all(v == version for c in after_vllm + after_hf for v in c.versions)


async def test_stock_reload_leaves_a_tied_lm_head_stale(vllm_engine, reference_model, prompts, tmp_path):
    """The trap this engine exists to avoid: vLLM's own reload_weights on CPU."""
    stepped = await one_step(reference_model, prompts, vllm_engine)
    stepped.save_pretrained(tmp_path, safe_serialization=True)
    await vllm_engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path)})
    await vllm_engine.llm.reset_prefix_cache()
    stale = max_diff_vs(stepped, prompts, await greedy(vllm_engine, prompts))
    assert stale > 1e-3, "stock reload now handles tied heads; the extension may be unnecessary"
    await vllm_engine.update_weights(str(tmp_path / "model.safetensors"), vllm_engine.version + 1)
    assert max_diff_vs(stepped, prompts, await greedy(vllm_engine, prompts)) < 1e-4


async def test_update_from_a_safetensors_file(engine, reference_model, prompts, tmp_path):
    stepped = await one_step(reference_model, prompts, engine)
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in stepped.state_dict().items() if k != "lm_head.weight"}, str(path))
    await engine.update_weights(path, engine.version + 1)
    assert max_diff_vs(stepped, prompts, await greedy(engine, prompts)) < 1e-4


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"), "missing 1 tensor.*k_proj"),
        (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(7)), r"wrong shape: model.norm.weight: got \(7,\)"),
        (lambda sd: sd.__setitem__("model.extra.weight", torch.ones(3)), "unexpected 1 tensor.*model.extra.weight"),
    ],
)
async def test_bad_updates_are_refused_and_change_nothing(engine, reference_model, prompts, damage, message):
    before = await greedy(engine, prompts[:2])
    version = engine.version
    state = {k: v.clone() + 0.5 for k, v in reference_model.state_dict().items()}
    damage(state)
    with pytest.raises(WeightsMismatchError, match=message):
        await engine.update_weights(state, version + 1)
    assert engine.version == version and not (await engine.health()).paused
    after = await greedy(engine, prompts[:2])
    for prompt, a, b in zip(prompts, after, before):
        shared = assert_same_greedy(reference_model, prompt, a.token_ids, b.token_ids)
        assert a.logprobs[:shared] == pytest.approx(b.logprobs[:shared], abs=1e-6)  # the same weights


async def test_versions_never_go_backwards(engine, reference_model):
    with pytest.raises(ValueError, match="older than the served version"):
        await engine.update_weights(reference_model.state_dict(), engine.version - 1)


async def test_in_flight_completion_carries_both_versions_each_exactly(engine, reference_model, prompts):
    """A completion in flight across an update: its tokens before carry the old
    version and are the old weights', those after carry the new one and are
    exactly the new weights' given the whole prefix. The engine's KV cache of
    the prefix is computed again on the new weights, not reused from the old."""
    from transformers import DynamicCache

    stepped = await one_step(reference_model, prompts, engine)
    start, chunks = engine.version, []

    async def consume():
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        async for chunk in engine.generate(prompts[0], params):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    while len(chunks) < 4:
        await asyncio.sleep(0.002)
    await engine.update_weights(stepped.state_dict(), start + 1)
    await asyncio.wait_for(task, timeout=120)
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    versions = [v for c in chunks for v in c.versions]
    assert len(versions) == 300 and versions == sorted(versions)
    assert versions[0] == start and versions[-1] == start + 1
    if engine.name == "vllm":
        assert engine.version_label_mismatches == 0  # our labels agree with vLLM's own spans
    old = versions.count(start)
    expected = _reference_logprobs(reference_model, prompts[0], tokens)[:old]
    expected += _reference_logprobs(stepped, prompts[0], tokens)[old:]
    assert logprobs == pytest.approx(expected, abs=1e-4)

    # What reusing the old cache would have given (the new weights over the old
    # weights' keys and values) is far from it: the check above bites.
    switch = len(prompts[0]) + old - 1  # the last old token is the first input on the new weights
    ids = torch.tensor([prompts[0] + tokens])
    with torch.no_grad():
        cache = DynamicCache()
        reference_model(ids[:, :switch], past_key_values=cache, use_cache=True)
        logits = stepped(ids[:, switch:-1], past_key_values=cache, use_cache=True).logits[0].float()
    reused = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - old), torch.tensor(tokens[old:])]
    assert (reused - torch.tensor(expected[old:])).abs().max() > 1e-3


async def test_a_whole_completion_across_an_update_carries_both_versions(vllm_engine, tiny_path, prompts):
    """``whole``: vLLM sends the completion once, finished, and its tokens' versions
    come from vLLM's own spans, not from when the output arrived."""
    original = load_file(tiny_path / "model.safetensors")
    start, params = vllm_engine.version, SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    whole = asyncio.create_task(collect(vllm_engine.generate(prompts[0], params, whole=True)))
    while not vllm_engine.llm.output_processor.get_num_unfinished_requests():
        await asyncio.sleep(0.001)  # added first: vLLM schedules in arrival order, so it has a token when the next has
    streamed = vllm_engine.generate(prompts[0], params)
    await anext(streamed)
    await vllm_engine.update_weights(original, start + 1)
    [out] = await asyncio.wait_for(whole, timeout=120)
    await streamed.aclose()
    assert len(out.versions) == 600 and out.versions == sorted(out.versions)
    assert (out.versions[0], out.versions[-1]) == (start, start + 1)
    assert vllm_engine.version_label_mismatches == 0
