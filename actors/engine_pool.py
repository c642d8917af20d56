"""EnginePool: the keeper of an engine pool, and each pool replica's view of its runs.

An engine pool (``[rollout] pool``, :mod:`rlgate.rollout.pool`) is a Serve
application of RolloutServer replicas shared by several runs, each with its own
LoRA adapter. Its keeper is a named detached actor ``enginepool-<pool>``,
created by the first run to join (get-or-create). Called by a run as it starts
(``join``: deploys the application when it is not running, else checks that the
run asks for the same engines) and as it ends (``leave``: the last run to
leave deletes the application), and by every pool replica (``tenants``
long-polls the runs). Owns: the pool's spec and its runs (each one's starting
version and adapter), written to ``state_path`` at each change and read back
when Ray restarts it. A run whose PolicyStore is gone (its run ended without
leaving, e.g. its driver was killed) is dropped.

:class:`PoolTenants` is the replica's side: one
:class:`rlgate.actors.policy_store.PolicyFollower` per run, each keeping that
run's adapter (a :class:`rlgate.rollout.engines.vllm.Tenant`) up to date from
the run's own PolicyStore, which also counts the replica as serving it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import ray
from ray import serve

from rlgate.actors.policy_store import PolicyFollower
from rlgate.rollout.pool import PoolRefused, PoolSpec, TenantInfo, pool_name
from rlgate.run import NAMESPACE, get_actor, is_alive

logger = logging.getLogger(__name__)
PRUNE_EVERY_S = 10.0  # how often the keeper looks for runs that ended without leaving


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class EnginePool:
    def __init__(self, pool: str, state_path: str) -> None:
        self.pool, self.name, self.state_path = pool, pool_name(pool), Path(state_path)
        self.spec: dict | None = None
        self.runs: dict[str, dict] = {}  # run -> TenantInfo as a dict
        self.generation = time.time_ns()  # goes up at each change of runs, and across a restart
        self._lock = asyncio.Lock()  # one join or leave at a time: a deploy or delete runs under it
        self._changed = asyncio.Condition()
        self._pruned_at = time.monotonic()
        if self.state_path.exists():  # Ray restarted this keeper: the pool and its runs go on
            state = json.loads(self.state_path.read_text())
            self.spec, self.runs = state["spec"], state["runs"]

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.state_path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"spec": self.spec, "runs": self.runs}))
        os.replace(temporary, self.state_path)

    async def _changed_runs(self) -> None:
        self._save()
        async with self._changed:
            self.generation += 1
            self._changed.notify_all()

    def _running(self) -> bool:
        return self.name in serve.status().applications

    async def join(self, run: str, spec: dict, tenant: dict, app: list) -> dict:
        """Serve ``run`` (``tenant``: a :class:`TenantInfo` as a dict) on the pool's
        engines; ``app`` is ``[the pool's Serve application]``, deployed when the pool
        is not running (``spec`` then becomes the pool's). Returns the pool's spec;
        raises :class:`PoolRefused` when ``spec`` asks for other engines."""
        async with self._lock:
            if self.spec is not None and not await asyncio.to_thread(self._running):
                self.spec, self.runs = None, {}  # deleted by hand (serve.delete, serve shutdown)
            if self.spec is None:
                logger.info("deploying engine pool %s for run %s", self.pool, run)
                quiet = {"enable_access_log": False}
                await asyncio.to_thread(serve.run, app[0], name=self.name, route_prefix=None, logging_config=quiet)
                self.spec = spec
            else:
                refusal = PoolSpec(**self.spec).refusal(PoolSpec(**spec))
                if refusal is not None:
                    raise PoolRefused(f"run {run!r} cannot share engine pool {self.pool!r}: it asks for {refusal}")
            self.runs[run] = tenant
            await self._changed_runs()
            return self.spec

    async def leave(self, run: str) -> None:
        """Stop serving ``run``; the last run to leave deletes the pool's application."""
        async with self._lock:
            await self._drop(run)

    async def _drop(self, run: str) -> None:
        if self.runs.pop(run, None) is not None:
            await self._changed_runs()
        if not self.runs and self.spec is not None:
            logger.info("engine pool %s has no runs left: deleting it", self.pool)
            await asyncio.to_thread(serve.delete, self.name)
            self.spec = None
            self._save()

    async def tenants(self, generation: int = -1, timeout_s: float = 30.0) -> tuple[int, dict[str, dict]]:
        """(generation, the runs) once the generation differs from ``generation``, or
        after ``timeout_s``."""
        async with self._changed:
            if self.generation == generation and timeout_s > 0:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.generation != generation), timeout_s)
                except TimeoutError:
                    pass
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            await self._prune()
        return self.generation, dict(self.runs)

    async def _prune(self) -> None:
        self._pruned_at = time.monotonic()
        gone = [run for run in self.runs if not await asyncio.to_thread(is_alive, run, "policy")]
        if gone:
            async with self._lock:
                for run in gone:
                    logger.warning("run %s of engine pool %s ended without leaving: dropped", run, self.pool)
                    await self._drop(run)

    async def status(self) -> dict:
        return {"pool": self.pool, "spec": self.spec, "runs": dict(self.runs), "generation": self.generation}


def get_or_create_engine_pool(pool: str, state_path: str):
    return EnginePool.options(
        name=pool_name(pool), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(pool, state_path)


def join_pool(config, spec: PoolSpec, tenant: TenantInfo, app, state_path: str) -> PoolSpec:
    """Join the run of ``config`` to its ``[rollout] pool`` (deploying ``app`` if the
    pool is not running); :class:`PoolRefused` with the reason when it cannot."""
    keeper = get_or_create_engine_pool(config.rollout.pool, state_path)
    try:
        joined = ray.get(keeper.join.remote(config.gateway.run_name, spec.as_dict(), asdict(tenant), [app]))
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, PoolRefused):
            raise err.cause from None
        raise
    return PoolSpec(**joined)


def leave_pool(pool: str, run: str) -> None:
    try:
        ray.get(ray.get_actor(pool_name(pool), namespace=NAMESPACE).leave.remote(run))
    except ValueError:
        pass  # no keeper: nothing to leave


class PoolTenants:
    """A pool replica's runs: each served by the engine as a tenant, followed from its own PolicyStore."""

    def __init__(self, engine, pool: str, replica: str) -> None:
        self.engine, self.replica = engine, replica
        self.keeper = ray.get_actor(pool_name(pool), namespace=NAMESPACE)
        self.followers: dict[str, PolicyFollower] = {}
        self.generation = -1
        self._applying = asyncio.Lock()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve the pool's runs as they are now, then follow their changes."""
        await self.refresh(timeout_s=0)
        self._task = asyncio.create_task(self._watch())

    async def refresh(self, timeout_s: float) -> None:
        generation, runs = await self.keeper.tenants.remote(self.generation, timeout_s)
        async with self._applying:
            if generation < self.generation:  # an older answer than one applied already
                return
            await self._apply(runs)
            self.generation = generation

    async def _apply(self, runs: dict[str, dict]) -> None:
        from rlgate.rollout.engines.vllm import Tenant

        for run in [run for run in self.followers if run not in runs]:
            follower = self.followers.pop(run)
            try:
                await follower.stop()
            except Exception:  # its PolicyStore is gone with its run
                logger.debug("stopping the follower of %s", run, exc_info=True)
            await self.engine.drop_tenant(run)
        for run, info in runs.items():
            if run in self.followers:
                continue
            try:
                store = get_actor(run, "policy")
            except ValueError:  # ended before we saw it: the keeper drops it
                continue
            tenant = TenantInfo(**info)
            await self.engine.add_tenant(run, tenant.version, tenant.adapter)
            follower = PolicyFollower(Tenant(self.engine, run), store, self.replica)
            await follower.start()  # its newest adapter before its first request
            self.followers[run] = follower

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh(timeout_s=30.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("following engine pool runs failed; retrying")
                await asyncio.sleep(2.0)

    async def ensure(self, run: str) -> None:
        """Make sure ``run`` is served here (a request may come before the watch sees it join)."""
        if run not in self.followers:
            await self.refresh(timeout_s=0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for follower in self.followers.values():
            try:
                await follower.stop()
            except Exception:
                logger.debug("stopping a follower", exc_info=True)
