"""Gateway: the Ray Serve deployment of the HTTP API, a shell over ``rlgate.serving``.

Created by ``serve_app.build_app`` in front of the RolloutServer deployment.
Called by agents (OpenAI routes with a session key), operators (session
routes and status with the admin key) and task apps. On start it gets or
creates the run's named actors (CapacityActor, TrajectoryStore, SessionStore),
wraps them and the RolloutServer handle in the clients of
:mod:`rlgate.serving.clients`, and serves :func:`rlgate.serving.routes.build_app`
over a :class:`rlgate.serving.service.GatewayService`. Stateless and scalable:
it owns nothing durable.
"""

from __future__ import annotations

from pathlib import Path

from ray import serve

from actors.capacity import get_or_create_capacity
from actors.job_manager import get_or_create_job_manager
from actors.session_store import SessionStore
from actors.trajectory_store import TrajectoryStore
from rlgate.config import RLGateConfig
from rlgate.serving.auth import Auth
from rlgate.serving.clients import EngineClient, JobsClient, SessionClient, StoreClient
from rlgate.serving.routes import build_app
from rlgate.serving.service import GatewayService
from rlgate.telemetry import Metrics

NAMESPACE = "rlgate"


@serve.deployment(name="Gateway", max_ongoing_requests=2048, health_check_period_s=10)
@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class Gateway:
    def __init__(self, rollout, config: dict, model_path: str, admin_key_hash: str) -> None:
        from transformers import AutoTokenizer

        settings = RLGateConfig.model_validate(config)
        gateway = settings.gateway
        run = f"rlgate-{gateway.run_name}"
        capacity = get_or_create_capacity(f"{run}-capacity", NAMESPACE, gateway.max_concurrent)
        trajectories = TrajectoryStore.options(
            name=f"{run}-trajectories", namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote(gateway.run_dir)
        sessions = SessionStore.options(
            name=f"{run}-sessions", namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote(capacity, trajectories, gateway.model_dump())

        def job_manager():
            where = {"host": gateway.host, "port": gateway.port}
            jobs_dir = str(Path(gateway.run_dir).parent / "jobs")
            return get_or_create_job_manager(gateway.run_name, jobs_dir, where, gateway.max_running_jobs)

        self.service = GatewayService(
            settings,
            AutoTokenizer.from_pretrained(model_path),
            Auth(admin_key_hash),
            SessionClient(sessions),
            EngineClient(rollout),
            StoreClient(capacity, trajectories),
            JobsClient(job_manager),
        )
        self.metrics = Metrics(gateway.run_name)

    def __serve_build_asgi_app__(self):
        return build_app(self.service, self.metrics)
