"""Gateway: the Ray Serve deployment of the HTTP API, a shell over ``rlgate.serving``.

Created by ``serve_app.build_app``. Called by agents (OpenAI routes with a
session key), operators (session routes and status with the admin key) and
task apps. On start it gets or creates the run's named actors (CapacityActor,
TrajectoryStore; the JobManager on first use) and serves
:func:`rlgate.serving.routes.build_app` over a
:class:`rlgate.serving.service.GatewayService`, in one of two shapes:

* ``[gateway] colocate = false``: stateless. Sessions live in the run's
  SessionStore actor and completions come from the RolloutServer deployment
  (a Serve handle): two inter-process calls per turn, any number of replicas.
  With ``[rollout] pool`` the engines are an engine pool's, shared with other
  runs, and each request names this run (its adapter serves it).
* ``colocate = true``: the replica owns an engine (it follows the run's
  PolicyStore like a RolloutServer replica) and its sessions
  (:class:`rlgate.serving.owned.OwnedSessions`, journaled in the run folder);
  a chat turn stays in this process. Admission and trajectory export still go
  to the CapacityActor and TrajectoryStore, once per session.

Colocated replicas are told apart by slot, their Serve replica rank (a
replacement for a crashed replica gets its rank): slot ``n`` hands out session
keys ``rlg<n>-...``, journals in ``sessions/`` (slot 0) or
``sessions/replica-<n>/``, and :class:`rlgate.serving.routing.OwnerRouter`
brings it the requests of its keys.

With ``[gateway] direct_port`` the replica also serves the app on its own
listener (:mod:`rlgate.serving.listener`) at ``direct_port + slot``, without
Serve's proxy hop.
Owns, when colocated: the engine, the open sessions and their journal.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

from ray import serve

from rlgate.actors.capacity import get_or_create_capacity
from rlgate.actors.job_manager import get_or_create_job_manager
from rlgate.actors.policy_store import PolicyFollower, get_or_create_policy_store
from rlgate.actors.session_store import SessionStore, owned_sessions
from rlgate.actors.trajectory_store import TrajectoryStore
from rlgate.config import RLGateConfig
from rlgate.models import load_tokenizer
from rlgate.rollout.engines import RequestLog, liveness_probe, run_engine
from rlgate.rollout.pool import pool_name
from rlgate.run import NAMESPACE, actor_name
from rlgate.serving import api
from rlgate.serving.auth import Auth, Slot, refuse_public_bind
from rlgate.serving.clients import EngineClient, JobsClient, LocalEngine, Peers, SessionClient, StoreClient
from rlgate.serving.errors import HTTPError
from rlgate.serving.listener import Listener, bind, claim_port
from rlgate.serving.middleware import InFlightLimit
from rlgate.serving.owned import claim_journal
from rlgate.serving.routes import build_app
from rlgate.serving.service import GatewayService
from rlgate.sessions.manager import SessionError
from rlgate.telemetry import Metrics


async def proxy_host() -> str:
    """The address Serve's HTTP proxies listen on, from the Serve controller."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return (await controller.get_http_config.remote()).host


def run_stores(gateway):
    """The run's CapacityActor and TrajectoryStore, made by the first replica to ask."""
    capacity_log = str(Path(gateway.run_dir) / "capacity.jsonl")
    capacity = get_or_create_capacity(
        actor_name(gateway.run_name, "capacity"), NAMESPACE, gateway.max_concurrent, capacity_log
    )
    trajectories = TrajectoryStore.options(
        name=actor_name(gateway.run_name, "trajectories"), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(gateway.run_dir)
    return capacity, trajectories


def session_store(gateway, capacity, trajectories):
    """The run's SessionStore (the split shape: sessions apart from the Gateway replicas)."""
    return SessionStore.options(
        name=actor_name(gateway.run_name, "sessions"), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(capacity, trajectories, gateway.model_dump())


def job_manager(settings: RLGateConfig):
    """The application's JobManager (made on the first job call): it runs jobs
    under this gateway's [jobs] rules (which task apps they may call, ...)."""
    gateway = settings.gateway
    where = {"host": gateway.host, "port": gateway.port}
    jobs_dir = str(Path(gateway.run_dir).parent / "jobs")
    rules = settings.jobs.model_dump()
    return get_or_create_job_manager(gateway.run_name, jobs_dir, where, gateway.max_running_jobs, rules)


# graceful_shutdown_wait_loop_s: a stopping replica checks for requests still under way this often (Serve's
# default, 2 s, is also the least every stop takes; routers on the cluster learn of a stop in milliseconds)
@serve.deployment(
    name="Gateway",
    max_ongoing_requests=2048,
    health_check_period_s=10,
    health_check_timeout_s=60,
    graceful_shutdown_wait_loop_s=0.5,
)
@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class Gateway:
    async def __init__(
        self,
        rollout,
        config: dict,
        model_path: str,
        admin_key_hash: str,
        initial_version: int = 0,
        deployment: str = "",
        key_fit_for_public: bool = False,
        tokenizer_class: str = "",
    ) -> None:
        """``rollout`` is the RolloutServer handle (None when colocated);
        ``deployment`` names this deployment of the application: a replica that
        finds its own name beside the session journal took over from a crashed
        one (its sessions go on), any other found the journal of an earlier
        application (its sessions are ended and exported, reason ``restart``).
        ``key_fit_for_public``: the admin key may guard a port beyond loopback;
        without it the replica refuses to start where Serve's proxies listen
        beyond loopback (whatever the TOML's ``[gateway] host`` says).
        ``tokenizer_class``: the model's (:func:`rlgate.models.tokenizer_class`),
        so the tokenizer loads without torch."""
        # what __del__ ends, set before anything here can fail: Serve calls it after a failed __init__ too
        self.engine, self.follower, self.sessions, self.listener = None, None, None, None
        self.stopping = False  # Serve is ending this replica: its engine (colocated) goes on purpose
        settings = RLGateConfig.model_validate(config)
        gateway = settings.gateway
        refuse_public_bind(await proxy_host(), key_fit_for_public)
        if gateway.direct_port is not None:  # its own listener binds [gateway] host
            refuse_public_bind(gateway.host, key_fit_for_public)
        capacity, trajectories = run_stores(gateway)
        self.request_log, self.slot, peers = RequestLog(0), None, None
        self.run = gateway.run_name
        if gateway.colocate:
            engine, sessions, peers = await self._colocate(
                settings, model_path, initial_version, deployment, capacity, trajectories
            )
        else:
            if settings.rollout.pool is not None:  # the shared engines, serving this run's adapter
                rollout = serve.get_deployment_handle("RolloutServer", app_name=pool_name(settings.rollout.pool))
            engine = EngineClient(rollout, gateway.run_name if settings.rollout.pool is not None else None)
            sessions = SessionClient(session_store(gateway, capacity, trajectories))
        self.sessions = sessions
        self.service = GatewayService(
            settings,
            load_tokenizer(model_path, tokenizer_class),
            Auth(admin_key_hash, self.slot),
            sessions,
            engine,
            StoreClient(capacity, trajectories),
            JobsClient(partial(job_manager, settings)),
            peers,
        )
        self.metrics = Metrics(gateway.run_name)
        if gateway.direct_port is not None:  # agents may skip Serve's proxy hop
            rollout_limits = settings.rollout.max_ongoing_requests + settings.rollout.max_queued_requests
            direct = InFlightLimit(build_app(self.service, self.metrics), rollout_limits)
            port = gateway.direct_port + (self.slot.index if self.slot is not None else 0)
            claim = claim_port(port, str(Path(gateway.run_dir).resolve()))
            try:
                self.listener = Listener(direct, bind(gateway.host, port), claim)
            except BaseException:
                os.close(claim)
                raise

    async def _colocate(self, settings, model_path: str, initial_version: int, deployment: str, capacity, trajectories):
        """This replica's own engine (following the run's PolicyStore) and its own
        sessions (journaled by slot): (engine client, sessions, peers)."""
        gateway, replica = settings.gateway, serve.get_replica_context()
        self.slot, peers = Slot.of_rank(replica.rank.rank, settings.rollout.replicas), None
        if self.slot.replicas > 1:
            peers = Peers(partial(serve.get_deployment_handle, "Gateway", app_name=replica.app_name), self.slot)
        self.engine = run_engine(settings, model_path, initial_version)
        await self.engine.ready()
        policy = get_or_create_policy_store(
            actor_name(gateway.run_name, "policy"),
            NAMESPACE,
            initial_version,
            str(Path(gateway.run_dir) / "policy.json"),
        )
        self.follower = PolicyFollower(self.engine, policy, replica.replica_id.unique_id)
        await self.follower.start()  # serve the current policy before taking traffic
        self.request_log = RequestLog(settings.rollout.request_log_size)
        folder = Path(gateway.run_dir) / "sessions"
        if self.slot.index:
            folder /= f"replica-{self.slot.index}"
        journal, resume = claim_journal(folder, deployment)
        holder = f"gateway-{self.slot.index}"  # its sessions, counted apart from other replicas
        sessions = owned_sessions(capacity, trajectories, gateway.model_dump(), journal, resume, holder)
        return LocalEngine(self.engine, self.request_log), sessions, peers

    def __serve_build_asgi_app__(self):
        return build_app(self.service, self.metrics)

    def record_replica_metadata(self) -> dict:
        """What this replica's router needs to know of it: its slot (colocated)."""
        return {"slot": self.slot.index} if self.slot is not None else {}

    async def session_stats(self) -> dict:
        """This replica's session counters (``/rl/status`` sums them over the replicas)."""
        return await self.sessions.stats()

    async def start_session_here(self, body: dict, base_url: str, authorization: str | None) -> dict:
        """``start_session`` forwarded by another replica: the refresh of a key of this slot."""
        try:
            request = api.StartSessionRequest(**body)
            started = await self.service.start_session(request, base_url, authorization, forwarded=True)
        except HTTPError as err:  # crosses the process boundary as the session error it is
            raise SessionError(err.status, err.message, err.retry_after) from None
        return started.model_dump()

    async def recent_requests(self, count: int = 16) -> list[dict]:
        """Colocated: the last requests as this replica's engine saw them (see
        RolloutServer); split: none (ask the RolloutServer)."""
        return self.request_log.recent(count)

    async def replica_status(self) -> dict:
        """This replica: its run, slot (colocated; None split), process id and open sessions (colocated)."""
        owned = self.sessions.open_count() if self.slot is not None else None
        return {"run": self.run, "slot": self.slot and self.slot.index, "pid": os.getpid(), "open_sessions": owned}

    async def check_health(self) -> None:
        """Serve's liveness probe: a dead engine (colocated) ends the replica, so Serve
        starts its successor, which takes its sessions back from the journal, now."""
        if self.engine is not None:
            await liveness_probe(self.engine, self.stopping)

    async def __del__(self) -> None:
        self.stopping = True
        if self.listener is not None:
            await self.listener.close()
        if self.engine is None:  # split: the RolloutServer's engine, the SessionStore's sessions
            return
        try:
            if self.sessions is not None:
                self.sessions.close()
            if self.follower is not None:  # (its PolicyStore may be gone: the engine still ends)
                await self.follower.stop()
        finally:
            await self.engine.shutdown()
