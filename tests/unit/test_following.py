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


async def test_a_pool_run_added_for_a_request_that_went_away_is_still_followed(monkeypatch):
    """A request for a run the replica does not serve yet adds it (the engine's
    tenant, then its follower's catch-up); the request being cancelled half way
    (its client hung up) must not leave the tenant without a follower."""
    from rlgate.actors import engine_pool
    from rlgate.actors.engine_pool import PoolTenants

    catching_up, go_on = asyncio.Event(), asyncio.Event()

    class Remote:
        def __init__(self, call) -> None:
            self.remote = call

    async def newer_than(version, timeout_s):  # no newer version: the long poll waits out its time
        catching_up.set()
        await go_on.wait()
        await asyncio.sleep(timeout_s)

    async def nothing(*args):
        return None

    async def tenants(known, timeout_s):
        return ("epoch", 1), {"run-a": {"version": 0, "adapter": None, "joined": "j1"}}

    store = type("Store", (), {"newer_than": Remote(newer_than), "ack": Remote(nothing), "forget": Remote(nothing)})()
    monkeypatch.setattr(engine_pool, "get_actor", lambda run, role: store)

    class Engine:  # a pool engine's tenants
        def __init__(self) -> None:
            self.tenants: dict[str, int] = {}

        async def add_tenant(self, run, version, adapter=None):
            self.tenants[run] = version

        async def drop_tenant(self, run):
            self.tenants.pop(run, None)

        def tenant_version(self, run):
            return self.tenants[run]

    pool = object.__new__(PoolTenants)
    pool.engine, pool.replica, pool.keeper = Engine(), "replica-0", type("K", (), {"tenants": Remote(tenants)})()
    pool.followers, pool.joined, pool.known, pool.missing = {}, {}, None, set()
    pool._applying, pool._task = asyncio.Lock(), None

    request = asyncio.ensure_future(pool.ensure("run-a"))
    await catching_up.wait()  # the tenant is added; its follower is catching up
    request.cancel()
    go_on.set()
    for _ in range(100):
        if "run-a" in pool.followers:
            break
        await asyncio.sleep(0.005)
    assert request.cancelled()
    assert pool.engine.tenants == {"run-a": 0} and set(pool.followers) == {"run-a"} and pool.joined == {"run-a": "j1"}
    await pool.stop()


async def test_a_restarted_trainer_publishes_the_last_version_again_and_nothing_older():
    """The weights' object dies with the trainer worker that made it: a replica
    that had not fetched the last version would wait until the next. The worker
    that repeats the steps to it publishes it once more; an older one is refused."""
    store = Store(0, None)
    await store.publish(3, ["w3 (the worker that died)"])
    with pytest.raises(ValueError, match="not newer"):
        await store.publish(3, ["w3"])  # an ordinary publish of the same version
    with pytest.raises(ValueError, match="not newer"):
        await store.publish(2, ["w2"], again=True)  # a step repeated before the last one
    await store.publish(3, ["w3 (repeated)"], again=True)
    assert await store.newer_than(2, 0) == (3, ["w3 (repeated)"])


def test_a_new_store_writes_its_version_over_a_stopped_runs_state_file(tmp_path):
    """A resumed run's store (at its checkpoint's version 10) found the stopped run's
    policy.json (at 12) if it restarted before its first change, and came back at 12
    with its weights lost: every publish of 11 was refused."""
    state = tmp_path / "policy.json"
    state.write_text('{"version": 12, "serving": {}}')
    store = Store(10, str(state))
    assert store.version == 10 and '"version": 10' in state.read_text()


async def test_a_followers_stop_waits_for_the_update_under_way():
    """An update runs to its end when its caller is cancelled; the follower's stop
    returned while it was still loading, and the engine was shut down under it."""
    from types import SimpleNamespace

    from rlgate.actors.policy_store import PolicyFollower

    order, loading = [], asyncio.Event()

    class Engine:
        version = 0

        async def update_weights(self, weights, version):
            loading.set()
            await asyncio.sleep(0.2)
            self.version = version
            order.append("update finished")

    async def newer_than(version, timeout_s):
        if version == 0:
            ready = asyncio.get_running_loop().create_future()
            ready.set_result({"w": 1})
            return 1, [ready]
        await asyncio.sleep(timeout_s)

    async def nothing(*args):
        return None

    store = SimpleNamespace(
        newer_than=SimpleNamespace(remote=newer_than),
        ack=SimpleNamespace(remote=nothing),
        forget=SimpleNamespace(remote=nothing),
    )
    follower = PolicyFollower(Engine(), store, "replica-0")
    follower._task = asyncio.ensure_future(follower._follow())
    await loading.wait()
    await follower.stop()
    order.append("stop returned")
    assert order == ["update finished", "stop returned"]
