"""What the gateway talks to: the session store and the rollout engines, behind plain async methods.

:class:`SessionClient` wraps the run's SessionStore actor, :class:`EngineClient`
the RolloutServer deployment's handle. Both turn Ray's failures into the HTTP
answer (a session's own error as it is, a dead actor 503, bad engine input
400), so :class:`rlgate.serving.service.GatewayService` never sees Ray.
:class:`LocalEngine` is the same interface over an engine in this process
(sessions held in this process are :mod:`rlgate.serving.owned`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from rlgate.background import to_its_end
from rlgate.rollout.engines import Engine, RequestLog, SamplingParams, collect
from rlgate.rollout.engines.base import EngineInputError
from rlgate.serving import api
from rlgate.serving.auth import Slot
from rlgate.serving.errors import HTTPError, ServiceDown
from rlgate.sessions.manager import Parent, SessionError
from rlgate.sessions.trajectory import Interaction


def cause(err: BaseException) -> BaseException:
    """What an actor call really raised: a task error's cause, else the error itself."""
    return err.cause if isinstance(err, RayTaskError) else err


async def settle(ref):
    """Await an actor call, turning its SessionError into the HTTP answer and a dead actor into 503."""
    try:
        return await ref
    except RayTaskError as err:
        if isinstance(cause(err), SessionError):
            raise cause(err) from None
        raise
    except RayActorError as err:
        raise ServiceDown(503, f"session service unavailable: {err.__class__.__name__}; retry") from None


class SessionClient:
    """The run's SessionStore actor (``rlgate.actors.session_store``)."""

    def __init__(self, store) -> None:
        self.store = store

    async def start(self, task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template) -> str:
        call = self.store.start.remote(task_id, key_hash, refresh_key_hash, group_size, wait_s, train, follow_template)
        return await settle(call)

    async def begin(self, key_hash: str, candidate_keys: list[str]) -> tuple[str, Parent | None]:
        """The request's session (it is in flight there until recorded or abandoned). A caller
        that hangs up meanwhile never learns which session counted it: it is abandoned here."""

        def left(begun: asyncio.Future) -> None:
            if not begun.cancelled() and begun.exception() is None:
                self.abandon(begun.result()[0])

        return await to_its_end(settle(self.store.begin.remote(key_hash, candidate_keys)), "a request's begin", left)

    async def record(self, session_id: str, interactions: list[Interaction]) -> None:
        await settle(self.store.record.remote(session_id, interactions))

    def abandon(self, session_id: str) -> None:
        """The request in flight in ``session_id`` ends without a record (not awaited)."""
        self.store.abandon.remote(session_id)

    async def check(self, key_hash: str) -> None:
        await settle(self.store.check.remote(key_hash))

    async def set_reward(self, key_hash, reward, interaction_id, turn_rewards) -> str:
        return await settle(self.store.set_reward.remote(key_hash, reward, interaction_id, turn_rewards))

    async def end(self, key_hash: str, failed: bool) -> int:
        return await settle(self.store.end.remote(key_hash, failed))

    async def stats(self) -> dict:
        return await self.store.stats.remote()


def engine_error(err: BaseException) -> HTTPError:
    """An engine failure as the HTTP answer: bad input 400, anything else 503."""
    if isinstance(err, BackPressureError):
        return HTTPError(
            503, "the rollout engines are saturated (every replica busy, the queue full); retry shortly", retry_after=1
        )
    if isinstance(cause(err), EngineInputError):
        return HTTPError(400, str(cause(err)))
    if isinstance(err, RayTaskError):
        return HTTPError(503, f"rollout engine failed: {cause(err).__class__.__name__}: {cause(err)}")
    return HTTPError(503, f"rollout engine unavailable: {err.__class__.__name__}")


_ENGINE_FAILURES = (RayTaskError, RayActorError, RuntimeError, BackPressureError)


class EngineClient:
    """The RolloutServer deployment (``rlgate.actors.rollout_server``), through its Serve handle;
    ``tenant``: in an engine pool, the run whose adapter serves every request."""

    def __init__(self, handle, tenant: str | None = None) -> None:
        self.handle = handle
        self.extra = {"tenant": tenant} if tenant is not None else {}

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator:
        """Engine chunks as they are produced, for streaming responses."""
        chunks = self.handle.options(stream=True).generate.remote(prompt_ids, params.model_dump(), **self.extra)
        try:
            async for chunk in chunks:
                yield chunk
        except _ENGINE_FAILURES as err:
            raise engine_error(err) from None

    async def generate_all(self, prompt_ids: list[int], params: SamplingParams) -> list:
        """Whole completions in one engine reply, for non-streaming responses."""
        try:
            return await self.handle.generate_all.remote(prompt_ids, params.model_dump(), **self.extra)
        except _ENGINE_FAILURES as err:
            raise engine_error(err) from None

    async def health(self) -> dict:
        return await self.handle.health.remote(**self.extra)


class LocalEngine:
    """An engine in this process, as an :class:`EngineClient`; ``request_log``
    keeps the last requests as the engine saw them (``recent_requests``)."""

    def __init__(self, engine: Engine, request_log: RequestLog | None = None) -> None:
        self.engine, self.request_log = engine, request_log or RequestLog(0)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, whole: bool = False) -> AsyncIterator:
        chunks = self.engine.generate(prompt_ids, params, whole=whole)
        try:
            async for chunk in self.request_log.tap(prompt_ids, params.n, chunks):
                yield chunk
        except EngineInputError as err:
            raise HTTPError(400, str(err)) from None

    async def generate_all(self, prompt_ids: list[int], params: SamplingParams) -> list:
        return await collect(self.stream(prompt_ids, params, whole=True), n=params.n)

    async def health(self) -> dict:
        await self.engine.check_alive()
        return asdict(await self.engine.health())


class StoreClient:
    """The run's CapacityActor and TrajectoryStore, for status and trajectory reads."""

    def __init__(self, capacity, trajectories) -> None:
        self.capacity, self.trajectories = capacity, trajectories

    async def capacity_stats(self) -> dict:
        return await self.capacity.stats.remote()

    async def trajectory_stats(self) -> dict:
        return await self.trajectories.stats.remote()

    async def read(self, since: int, limit: int) -> list[dict]:
        return await self.trajectories.read.remote(since, limit)


class JobsClient:
    """The cluster's JobManager actor, made on the first call; one that died is
    replaced (it reloads every job from disk)."""

    def __init__(self, make) -> None:
        self.make, self._manager = make, None

    async def call(self, method: str, *args, retry: bool = True):
        """``method`` on the JobManager; asked again of a new one when the first
        died and ``retry`` (only for calls that are safe to repeat)."""
        if self._manager is None:
            self._manager = self.make()
        try:
            return await settle(getattr(self._manager, method).remote(*args))
        except ServiceDown:
            self._manager = None
            if not retry:
                raise
            return await self.call(method, *args, retry=False)


class Peers:
    """The other colocated Gateway replicas, reached through the deployment's own
    handle: its ``OwnerRouter`` takes a call with ``session_id=<slot>`` to that slot."""

    def __init__(self, handle: Callable[[], object], slot: Slot) -> None:
        self._handle, self.handle, self.slot = handle, None, slot

    def _on(self, slot: int, method: str):
        self.handle = self.handle or self._handle()
        return self.handle.options(method_name=method, session_id=str(slot))

    async def session_stats(self, own: dict, timeout_s: float = 5.0) -> dict:
        """Session counters summed over every replica that answers within ``timeout_s``
        (one restarting is left out: ``replicas_answered`` says how many did)."""

        async def ask(slot: int) -> dict | None:
            try:
                return await asyncio.wait_for(self._on(slot, "session_stats").remote(), timeout_s)
            except Exception:  # a restarting or unreachable replica: counted as not answering
                return None

        others = (ask(s) for s in range(self.slot.replicas) if s != self.slot.index)
        answered = [a for a in [own, *await asyncio.gather(*others)] if a is not None]
        total = {key: sum(a.get(key, 0) for a in answered) for key in own}
        return {**total, "replicas_answered": len(answered), "replicas": self.slot.replicas}

    async def start_session(
        self, owner: int, body: api.StartSessionRequest, base_url: str, authorization: str | None
    ) -> api.StartSessionResponse:
        """``start_session`` on the replica of slot ``owner`` (a refresh of one of its keys)."""
        call = self._on(owner, "start_session_here")
        try:
            started = await settle(call.remote(body.model_dump(), base_url, authorization))
        except BackPressureError:
            raise HTTPError(503, "the replica owning this key is busy; retry", retry_after=1) from None
        return api.StartSessionResponse(**started)
