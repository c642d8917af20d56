"""The policy's way to the engines without Ray or vLLM: the PolicyStore's rules (on
its class: no restart, no state file) and an engine's handling of adapter pushes."""

from __future__ import annotations

import asyncio

import pytest

from rlgate.actors.policy_store import PolicyStore

Store = PolicyStore.__ray_actor_class__


async def test_a_publish_never_takes_the_version_backwards_even_queued_behind_a_newer_one():
    """Two publishes that both arrive while the store's lock is taken (a waiter
    woken by the last change holds it): the older one, applied second, must be
    refused, not replace the newer version's weights."""
    store = Store(0, None)
    async with store._changed:
        newer = asyncio.ensure_future(store.publish(6, ["w6"]))
        older = asyncio.ensure_future(store.publish(5, ["w5"]))
        await asyncio.sleep(0.01)
    await newer
    with pytest.raises(ValueError, match="not newer than the published version 6"):
        await older
    assert (store.version, store.weights) == (6, ["w6"])


async def test_an_adapter_the_engine_refuses_leaves_no_copy_behind(tiny_path):
    """A follower retries a push the engine refused every few seconds: each try
    writes the adapter to shared memory, so a refused one must not stay there."""
    import torch

    from rlgate.rollout.engines.vllm import VLLMEngine
    from rlgate.rollout.lora import Adapter

    class Refusing:  # vLLM's engine, refusing every adapter
        async def add_lora(self, request) -> bool:
            return False

    engine = VLLMEngine(tiny_path, lora_rank=4)
    engine._llm = Refusing()
    adapter = Adapter(
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)},
    )
    try:
        for version in (1, 1):
            with pytest.raises(RuntimeError, match="did not load the LoRA adapter"):
                await engine.update_weights(adapter, version)
        assert not engine._lora_dir.exists() or not any(engine._lora_dir.iterdir())
        assert engine.adapters_loaded() == [] and engine.version == 0
    finally:
        engine._llm = None
        await engine.shutdown()  # its shared-memory folder goes
    assert not engine._lora_dir.exists()
