"""EnginePool: the keeper of an engine pool, and each pool replica's view of its runs.

An engine pool (``[rollout] pool``, :mod:`rlgate.rollout.pool`) is a Serve
application of RolloutServer replicas shared by several runs, each with its own
LoRA adapter. Its keeper is a named detached actor ``enginepool-<pool>``,
created by the first run to join (get-or-create). Called by a run as it starts
(``join``: deploys the application when it is not running, else checks that the
run asks for the same engines) and as it ends (``leave``: the last run to
leave deletes the application, and the keeper then ends), and by every pool
replica (``tenants`` long-polls the runs). Owns: the pool's spec and its runs
(each one's starting version and adapter), written to ``state_path`` at each
change and read back when Ray restarts it. Each run holds a :class:`PoolLease`, an actor owned by its
driver's process: a run whose lease is gone (its driver ended without leaving,
e.g. it was killed) is dropped.

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
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import ray
from ray import serve

from rlgate.actors.policy_store import PolicyFollower
from rlgate.background import to_its_end
from rlgate.rollout.pool import LEASE, KeeperEnding, PoolRefused, PoolSpec, TenantInfo, pool_name
from rlgate.run import NAMESPACE, actor_name, get_actor, is_alive

logger = logging.getLogger(__name__)
PRUNE_EVERY_S = 10.0  # how often the keeper looks for runs that ended without leaving
KEEPER_GONE_S = 30.0  # how long a join waits for the name of a keeper that has ended to be free


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class EnginePool:
    def __init__(self, pool: str, state_path: str) -> None:
        self.pool, self.name, self.state_path = pool, pool_name(pool), Path(state_path)
        self.spec: dict | None = None
        self.runs: dict[str, dict] = {}  # run -> TenantInfo as a dict
        # (epoch, generation) names the runs' state: the generation goes up at each change, and a
        # restarted keeper has a new epoch (replicas then take its answer, whatever its generation)
        self.epoch, self.generation = uuid.uuid4().hex, 0
        self._lock = asyncio.Lock()  # one join or leave at a time: a deploy or delete runs under it
        self._changed = asyncio.Condition()
        self._pruned_at = time.monotonic()
        self._following: set[asyncio.Task] = set()  # one per joining: see _follow_lease
        self._ending = False  # the pool is deleted and this keeper is ending: joins are refused (see _drop)
        restarted = ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and self.state_path.exists():  # Ray restarted this keeper: the pool and its runs go on
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
            if self._ending:  # a join that waited on the last run's leave: join_pool makes a new keeper
                raise KeeperEnding(f"engine pool {self.pool}'s keeper is ending with the pool")
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
            self._follow_lease(run, tenant["joined"])
            return self.spec

    def _follow_lease(self, run: str, joined: str) -> None:
        """Drop ``run`` (this joining of it) as soon as its lease ends: its driver's
        process ended without leaving. (A restarted keeper finds such runs by looking:
        :meth:`_prune`.)"""

        async def follow() -> None:
            while True:
                try:
                    lease = await asyncio.to_thread(get_actor, run, LEASE)
                    await lease.held.remote()  # never answers: it fails when the lease ends
                except ray.exceptions.ActorUnavailableError:  # out of reach for now (its node's network)
                    await asyncio.sleep(1.0)
                    continue
                except (ray.exceptions.RayActorError, ValueError):  # gone now, or already
                    break
                except Exception:
                    logger.exception("following run %s's lease failed: it is looked at by pruning instead", run)
                    return
            async with self._lock:
                if self.runs.get(run, {}).get("joined") == joined:  # not left, nor joined again since
                    logger.warning("run %s of engine pool %s ended without leaving: dropped", run, self.pool)
                    await self._drop(run)

        self._following.add(task := asyncio.create_task(follow()))
        task.add_done_callback(self._following.discard)

    async def leave(self, run: str) -> None:
        """Stop serving ``run``; the last run to leave deletes the pool's application."""
        async with self._lock:
            await self._drop(run)

    async def _drop(self, run: str) -> None:
        if self.runs.pop(run, None) is not None:
            await self._changed_runs()
        if not self.runs and self.spec is not None:
            logger.info("engine pool %s has no runs left: deleting it", self.pool)
            await asyncio.to_thread(serve.delete, self.name)  # its replicas are gone when this returns
            self.spec = None
            # and the keeper with it (else it idles for good, a process at ~1 % of a core): killed, not
            # exit_actor(), which waits for the calls under way, and a join waiting here for the lock then never
            # returned. Those calls fail (a join: join_pool makes a new keeper), as does one that takes the lock
            # before the kill lands. Its long polls are answered first.
            self._ending = True
            await self._changed_runs()
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def tenants(
        self, known: tuple[str, int] | None = None, timeout_s: float = 30.0
    ) -> tuple[tuple[str, int], dict[str, dict]]:
        """((epoch, generation), the runs) once they differ from ``known``, or after ``timeout_s``."""

        def changed() -> bool:
            return (self.epoch, self.generation) != known

        async with self._changed:
            if not changed() and timeout_s > 0 and not self._ending:
                try:
                    await asyncio.wait_for(self._changed.wait_for(changed), timeout_s)
                except TimeoutError:
                    pass
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_S:
            await self._prune()
        return (self.epoch, self.generation), dict(self.runs)

    async def _prune(self) -> None:
        self._pruned_at = time.monotonic()
        if not any([not await asyncio.to_thread(is_alive, run, LEASE) for run in self.runs]):
            return
        async with self._lock:  # looked at again under the lock: a run may have joined again meanwhile
            for run in list(self.runs):
                if not await asyncio.to_thread(is_alive, run, LEASE):
                    logger.warning("run %s of engine pool %s ended without leaving: dropped", run, self.pool)
                    await self._drop(run)

    async def status(self) -> dict:
        return {"pool": self.pool, "spec": self.spec, "runs": dict(self.runs), "generation": self.generation}


@ray.remote(num_cpus=0)
class PoolLease:
    """A run's place in an engine pool: owned by the run's driver (not detached), so it
    ends with the driver's process, and the keeper, waiting on :meth:`held`, then drops the run."""

    async def ready(self) -> bool:
        return True

    async def held(self) -> None:
        """Never answers: the keeper's call fails when the lease ends."""
        await asyncio.Event().wait()


_leases: dict[str, object] = {}  # run -> its lease, held for as long as this process runs


def get_or_create_engine_pool(pool: str, state_path: str):
    return EnginePool.options(
        name=pool_name(pool), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(pool, state_path)


def join_pool(config, spec: PoolSpec, tenant: TenantInfo, app, state_path: str) -> PoolSpec:
    """Join the run of ``config`` to its ``[rollout] pool`` (deploying ``app`` if the
    pool is not running), holding a :class:`PoolLease` for as long as this process
    runs; :class:`PoolRefused` with the reason when it cannot."""
    run = config.gateway.run_name
    if run not in _leases:  # the handle made it: dropping it would end the lease
        _leases[run] = PoolLease.options(name=actor_name(run, LEASE), namespace=NAMESPACE).remote()
        ray.get(_leases[run].ready.remote())
    tenant = replace(tenant, joined=uuid.uuid4().hex)  # this joining, apart from an earlier run of the name
    deadline = time.monotonic() + KEEPER_GONE_S
    while True:
        keeper = get_or_create_engine_pool(config.rollout.pool, state_path)
        try:
            joined = ray.get(keeper.join.remote(run, spec.as_dict(), asdict(tenant), [app]))
            return PoolSpec(**joined)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, PoolRefused):
                raise err.cause from None
            if not isinstance(err.cause, KeeperEnding) or time.monotonic() > deadline:
                raise
        except ray.exceptions.RayActorError:
            # the keeper ended with the pool's last run (its name is freed, then made again), or it is
            # restarting after a crash: join again (a join only sets this run's entry)
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def leave_pool(pool: str, run: str) -> None:
    """Leave the pool: the last run to leave deletes it, and its keeper ends."""
    try:
        ray.get(ray.get_actor(pool_name(pool), namespace=NAMESPACE).leave.remote(run))
    except ValueError:
        pass  # no keeper: nothing to leave
    except ray.exceptions.RayActorError:
        # it ended with the pool (this was its last run), or it crashed and restarts with the run
        # still listed: the lease ended below has the run dropped at its next look
        pass
    lease = _leases.pop(run, None)
    if lease is not None:
        ray.kill(lease)


class PoolTenants:
    """A pool replica's runs: each served by the engine as a tenant, followed from its own PolicyStore."""

    def __init__(self, engine, pool: str, replica: str) -> None:
        self.engine, self.replica = engine, replica
        self.keeper = ray.get_actor(pool_name(pool), namespace=NAMESPACE)
        self.followers: dict[str, PolicyFollower] = {}
        self.joined: dict[str, str] = {}  # run -> the joining its follower serves
        self.known: tuple[str, int] | None = None  # the keeper's (epoch, generation) applied
        self.missing: set[str] = set()  # runs that could not be added yet: tried again shortly
        self._applying = asyncio.Lock()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve the pool's runs as they are now, then follow their changes."""
        await self.refresh(timeout_s=0)
        self._task = asyncio.create_task(self._watch())

    async def refresh(self, timeout_s: float) -> None:
        (epoch, generation), runs = await self.keeper.tenants.remote(self.known, timeout_s)
        async with self._applying:
            if self.known is not None and epoch == self.known[0] and generation < self.known[1]:
                return  # an older answer than one applied already (the watch's and ensure()'s crossed)
            await self._apply(runs)
            self.known = (epoch, generation)

    async def _apply(self, runs: dict[str, dict]) -> None:
        """Serve exactly ``runs``: a run gone, or joined again (a new run of its name), loses
        its follower and adapters; each run not served yet is added on its own, so one that
        fails (logged, tried again shortly) keeps no other from being served."""
        for run in [run for run in self.followers if self.joined[run] != runs.get(run, {}).get("joined")]:
            follower = self.followers.pop(run)
            del self.joined[run]
            try:
                await follower.stop()
            except Exception:  # its PolicyStore is gone with its run
                logger.debug("stopping the follower of %s", run, exc_info=True)
            await self.engine.drop_tenant(run)
        self.missing = set()
        for run, info in runs.items():
            if run in self.followers:
                continue
            try:
                await self._add(run, TenantInfo(**info))
            except Exception:
                logger.exception("could not serve run %s of the engine pool yet; trying again", run)
                await self.engine.drop_tenant(run)
                self.missing.add(run)

    async def _add(self, run: str, tenant: TenantInfo) -> None:
        from rlgate.rollout.engines.vllm import Tenant

        store = get_actor(run, "policy")  # ValueError: ended before we saw it (the keeper drops it)
        await self.engine.add_tenant(run, tenant.version, tenant.adapter)
        follower = PolicyFollower(Tenant(self.engine, run), store, self.replica)
        await follower.start()  # its newest adapter before its first request
        self.followers[run], self.joined[run] = follower, tenant.joined

    async def _watch(self) -> None:
        while True:
            try:
                await self.refresh(timeout_s=2.0 if self.missing else 30.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("following engine pool runs failed; retrying")
                await asyncio.sleep(2.0)

    async def ensure(self, run: str) -> None:
        """Make sure ``run`` is served here (a request may come before the watch sees it join).

        The change goes on to its end if the request is cancelled (its client hung
        up): cut short, a run could stay the engine's tenant with no follower, and
        a new run of its name would then start on the old one's adapter."""
        if run not in self.followers:
            await to_its_end(self.refresh(timeout_s=0), "serving a pool run for a request")  # else: the watch

    async def stop(self) -> None:
        if self._task is not None:  # each follower's stop below waits for its update under way
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for follower in self.followers.values():
            try:
                await follower.stop()
            except Exception:
                logger.debug("stopping a follower", exc_info=True)
