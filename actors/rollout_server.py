"""RolloutServer: a Ray Serve deployment holding one rollout engine per replica.

Created by ``serve_app.build_app`` with ``[rollout] replicas`` replicas.
Called by the Gateway (``generate``, through a streaming handle) and by the
trainer (``update_weights``, ``pause``/``resume``, ``version``).
Owns: one :class:`rlgate.rollout.engines.Engine` (vLLM or HF) and its policy version,
and, when ``[rollout] request_log_size`` > 0, a bounded log of the last
requests exactly as the engine saw and answered them (for audits and tests).

Every replica follows the run's PolicyStore: it catches up to the latest
published weights before it takes traffic (also after a restart), then
long-polls for newer versions and applies them in place.

In an engine pool (``pool``, see :mod:`rlgate.actors.engine_pool`) a replica
serves several runs instead, each request naming its run (``tenant``), and
follows each run's PolicyStore for that run's adapter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict
from pathlib import Path

from ray import serve

from rlgate.actors.engine_pool import PoolTenants
from rlgate.actors.policy_store import PolicyFollower, get_or_create_policy_store
from rlgate.config import RLGateConfig
from rlgate.rollout.engines import (
    Completion,
    Engine,
    RequestLog,
    SamplingParams,
    TokenChunk,
    collect,
    liveness_probe,
    run_engine,
)
from rlgate.run import NAMESPACE, actor_name


@serve.deployment(
    name="RolloutServer",
    max_ongoing_requests=512,
    health_check_period_s=10,
    health_check_timeout_s=60,
    graceful_shutdown_timeout_s=30,
    graceful_shutdown_wait_loop_s=0.5,  # as the Gateway's: each stop waits at least this long
)
class RolloutServer:
    async def __init__(self, config: dict, model_path: str, initial_version: int = 0, pool: str | None = None) -> None:
        """``pool``: this replica belongs to that engine pool and serves its runs
        (``config`` is then the settings the pool was made with)."""
        # what __del__ ends, set before anything here can fail: Serve calls it after a failed __init__ too
        self.engine: Engine | None = None
        self.follower, self.tenants = None, None
        self.stopping = False  # Serve is ending this replica: its engine goes on purpose
        settings = RLGateConfig.model_validate(config)
        self.engine = run_engine(settings, model_path, initial_version)
        self.request_log = RequestLog(settings.rollout.request_log_size)
        await self.engine.ready()
        self.replica = serve.get_replica_context().replica_id.unique_id
        if pool is not None:
            self.tenants = PoolTenants(self.engine, pool, self.replica)
            await self.tenants.start()  # serve each run's current adapter before taking traffic
            return
        self.policy = get_or_create_policy_store(
            actor_name(settings.gateway.run_name, "policy"),
            NAMESPACE,
            initial_version,
            str(Path(settings.gateway.run_dir) / "policy.json"),
        )
        self.follower = PolicyFollower(self.engine, self.policy, self.replica)
        await self.follower.start()  # serve the current policy before taking traffic

    async def generate(
        self, prompt_ids: list[int], params: dict, whole: bool = False, tenant: str | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Stream :class:`TokenChunk` deltas; call with ``handle.options(stream=True)``.
        ``tenant``: in an engine pool, the run whose adapter serves the request."""
        sampling = SamplingParams.model_validate(params)
        if tenant is None:
            chunks = self.engine.generate(prompt_ids, sampling, whole=whole)
        elif self.tenants is None:
            raise RuntimeError(f"this engine is not an engine pool's; it cannot serve run {tenant!r}")
        else:
            await self.tenants.ensure(tenant)
            chunks = self.engine.generate(prompt_ids, sampling, whole=whole, tenant=tenant)
        async for chunk in self.request_log.tap(prompt_ids, sampling.n, chunks):
            yield chunk

    async def generate_all(self, prompt_ids: list[int], params: dict, tenant: str | None = None) -> list[Completion]:
        """Whole completions in one reply: for callers that do not stream, this
        saves a Ray round trip per token chunk."""
        sampling = SamplingParams.model_validate(params)
        return await collect(self.generate(prompt_ids, params, whole=True, tenant=tenant), n=sampling.n)

    async def tenant_versions(self) -> dict[str, int]:
        """In an engine pool: each run this replica serves, with the version it serves."""
        return self.engine.tenants() if self.tenants is not None else {}

    async def recent_requests(self, count: int = 16) -> list[dict]:
        """The last ``count`` finished requests: prompt ids and each output's ids,
        logprobs and versions, as the engine produced them (oldest first)."""
        return self.request_log.recent(count)

    async def update_weights(self, weights: Mapping | str, version: int) -> dict:
        """Load a full state dict (or a safetensors path on this node) and serve ``version``."""
        return asdict(await self.engine.update_weights(weights, version))

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def version(self) -> int:
        return self.engine.version

    async def health(self, tenant: str | None = None) -> dict:
        """Engine, model, version (``tenant``'s, in an engine pool), paused, running
        requests; raises if the engine is dead."""
        await self.engine.check_alive()
        health = asdict(await self.engine.health())
        if tenant is not None and self.tenants is not None:
            await self.tenants.ensure(tenant)
            health["version"] = self.engine.tenant_version(tenant)
        return health

    async def check_health(self) -> None:
        """Serve's liveness probe: a dead engine ends the replica, so Serve replaces it now."""
        await liveness_probe(self.engine, self.stopping)

    async def __del__(self) -> None:
        self.stopping = True
        try:
            if (following := self.follower or self.tenants) is not None:  # (its store may be gone)
                await following.stop()
        finally:
            if self.engine is not None:
                await self.engine.shutdown()
