"""An engine pool's keeper and a pool replica's view of its runs, on the test
session's Ray: the first run to join deploys the pool, a replica serves each run
from that run's own PolicyStore, one run that cannot be served yet keeps no
other from it, a run started again under its name replaces the old one, a run
whose driver is gone (its lease) is dropped at once, a run asking for other
engines is refused with the reason, and the last run to go (leaving, or its
driver gone) deletes the pool and ends its keeper (a later run makes both anew, also
one whose join met the keeper as it ended).
The engine is a small fake (the real one's tenants: test_lora_engine.py; the
whole of it: tests/system/test_training.py)."""

from __future__ import annotations

import contextlib
import time

import pytest

from rlgate.config import parse_config
from rlgate.rollout.pool import PREFIX, PoolRefused, PoolSpec, TenantInfo
from rlgate.run import NAMESPACE, actor_name

POOL = "keeper-test"


class Engine:
    """What PoolTenants and a run's PolicyFollower ask of an engine."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []

    async def add_tenant(self, run: str, version: int, adapter=None) -> None:
        self.versions.setdefault(run, version)
        self.calls.append(("add", run))

    async def drop_tenant(self, run: str) -> None:
        self.versions.pop(run, None)
        self.calls.append(("drop", run))

    def tenant_version(self, run: str) -> int:
        return self.versions[run]

    async def update_weights(self, weights, version: int, tenant: str | None = None):
        self.versions[tenant] = version


def run_config(run: str, tmp_path, rank: int = 8):
    settings = {"rollout": {"pool": POOL}, "training": {"lora": {"rank": rank}}}
    return parse_config(settings | {"gateway": {"run_name": run, "run_dir": str(tmp_path)}})


def policy_store(run: str):
    from rlgate.actors.policy_store import get_or_create_policy_store

    return get_or_create_policy_store(actor_name(run, "policy"), NAMESPACE)


async def test_a_pool_serves_each_run_from_its_own_store_until_it_leaves_or_its_driver_is_gone(ray_session, tmp_path):
    from ray import serve

    from rlgate.actors.engine_pool import PoolTenants, _leases, join_pool, leave_pool

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Engines:  # stands for the pool's RolloutServer application
        def __call__(self) -> str:
            return "ok"

    state = str(tmp_path / "pools" / f"{POOL}.json")

    def keeper_alive() -> bool:
        try:
            ray_session.get_actor(f"{PREFIX}{POOL}", namespace=NAMESPACE)
            return True
        except ValueError:
            return False

    def keeper_ended() -> bool:  # its name is free shortly after it exits
        deadline = time.monotonic() + 30
        while keeper_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return not keeper_alive()

    def join(run: str, rank: int = 8) -> PoolSpec:
        config = run_config(run, tmp_path, rank)
        return join_pool(config, PoolSpec.of(config, "/models/tiny"), TenantInfo(), Engines.bind(), state)

    policy_store("pa")
    spec = join("pa")
    assert spec.lora_rank == 8 and f"{PREFIX}{POOL}" in serve.status().applications  # deployed for the first run
    replica = PoolTenants(Engine(), POOL, "replica-1")
    await replica.start()
    assert replica.engine.versions == {"pa": 0} and set(replica.followers) == {"pa"}

    join("pb")  # its PolicyStore is not there yet: it waits, and keeps no other run from being served
    await replica.refresh(timeout_s=0)
    assert replica.missing == {"pb"} and set(replica.followers) == {"pa"}
    store_b = policy_store("pb")
    await replica.refresh(timeout_s=0)
    assert set(replica.followers) == {"pa", "pb"} and not replica.missing
    assert await store_b.status.remote() == {"version": 0, "serving": {"replica-1": 0}, "weights_lost": False}

    replica.engine.calls.clear()
    join("pa")  # a new run of the name: the old one's follower and adapters go, the new one is served
    await replica.refresh(timeout_s=0)
    assert replica.engine.calls == [("drop", "pa"), ("add", "pa")]

    with pytest.raises(PoolRefused, match=r"run 'pc' cannot share engine pool 'keeper-test': it asks for LoRA rank"):
        join("pc", rank=16)

    ray_session.kill(_leases.pop("pb"))  # pb's driver died without leaving
    keeper = ray_session.get_actor(f"{PREFIX}{POOL}", namespace=NAMESPACE)
    _, runs = await keeper.tenants.remote(replica.known, 60.0)  # answered as the keeper drops it
    assert set(runs) == {"pa"}
    await replica.refresh(timeout_s=0)
    assert set(replica.followers) == {"pa"} and "pb" not in replica.engine.versions

    await replica.stop()  # (a real replica goes with the pool's application)
    leave_pool(POOL, "pa")
    assert f"{PREFIX}{POOL}" not in serve.status().applications  # the last run to leave deleted the pool
    assert keeper_ended()  # and its keeper ended with it: nothing of the pool idles on the cluster

    policy_store("pd")
    assert join("pd", rank=16).lora_rank == 16  # a later run makes the pool, and a keeper, anew: its own spec
    assert f"{PREFIX}{POOL}" in serve.status().applications and keeper_alive()

    # pd, the pool's last run, leaves while pe joins: pe's join waits for the leave, then meets a keeper ending
    # with the pool (a pool it deployed there would have no keeper), and joins a new pool and keeper instead
    policy_store("pe")
    keeper = ray_session.get_actor(f"{PREFIX}{POOL}", namespace=NAMESPACE)
    leaving = keeper.leave.remote("pd")  # (a caller's calls start in order: the join below waits on this one)
    assert join("pe").lora_rank == 8  # pd's pool would have been of rank 16
    with contextlib.suppress(ray_session.exceptions.RayActorError):
        ray_session.get(leaving)  # the keeper it reached ended
    status = ray_session.get(ray_session.get_actor(f"{PREFIX}{POOL}", namespace=NAMESPACE).status.remote())
    assert set(status["runs"]) == {"pe"} and f"{PREFIX}{POOL}" in serve.status().applications

    ray_session.kill(_leases.pop("pe"))  # its driver dies without leaving: the pool and keeper go all the same
    assert keeper_ended() and f"{PREFIX}{POOL}" not in serve.status().applications  # (deleted, then it ends)
    ray_session.kill(_leases.pop("pd"))  # (it left by the keeper's call, not leave_pool)
    for run in ("pa", "pb", "pd", "pe"):
        ray_session.kill(ray_session.get_actor(actor_name(run, "policy"), namespace=NAMESPACE))
