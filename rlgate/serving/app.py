"""Builds rlgate's Ray Serve application: the Gateway in front of the RolloutServer.

    python serve_app.py --config configs/serve.toml [--host 127.0.0.1] [--port 8000]
    serve run serve_app:app                  # config from $RLGATE_CONFIG or configs/serve.toml
    rlgate serve / serve run rlgate.serving.app:app    # the same, from an installed rlgate

A composition module: it puts the deployments of :mod:`rlgate.actors` together;
``serve_app.py`` at the top of a checkout is its thin entry point.

The admin key comes from ``RLGATE_ADMIN_KEY`` (or the file ``RLGATE_ADMIN_KEY_FILE``
names); without it a random key is generated and printed once, on loopback and
outside Ray's workers only (a config deploy builds the app in a Ray task, whose
output goes to Ray's log files). Beyond loopback a weak or generated key is
refused: here against the host asked for, and again in each Gateway replica
against the address Serve's proxies really listen on.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ray.serve import Application

from rlgate.actors.engine_pool import join_pool, leave_pool
from rlgate.actors.gateway import Gateway
from rlgate.actors.policy_store import get_or_create_policy_store
from rlgate.actors.rollout_server import RolloutServer
from rlgate.config import RLGateConfig, load_config
from rlgate.models import BUILTIN_DTYPES, prepare_model, tokenizer_class
from rlgate.rollout.pool import PoolRefused, PoolSpec, TenantInfo
from rlgate.run import NAMESPACE, ROLES, actor_name, answers, app_name, end_actors
from rlgate.serving.auth import AdminKeyRefused, is_weak, refuse_public_bind
from rlgate.serving.routing import router_config, serve_start_options
from rlgate.sessions.manager import hash_key, new_key
from rlgate.training.placement import replica_bundle

if TYPE_CHECKING:
    from ray.actor import ActorHandle

POOL_SERVED_S = 300.0  # how long a run joining an engine pool waits for every replica to serve it
DEFAULT_CONFIG = Path("configs") / "serve.toml"  # from the working directory: a checkout, or Ray's working_dir


def resolve_model(config: RLGateConfig) -> str:
    """Prepare the model on the driver so a bad name fails here, before any replica starts."""
    storage = config.model.dtype if config.model.dtype in BUILTIN_DTYPES else "float32"
    return str(prepare_model(config.model.name, storage))


class AdminKey(NamedTuple):
    value: str
    generated: bool

    @property
    def fit_for_public(self) -> bool:
        """May guard a port beyond loopback: chosen by the operator and strong."""
        return not self.generated and not is_weak(self.value)


def in_ray_worker() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def admin_key(host: str) -> AdminKey:
    """The admin key and whether it was generated. Beyond loopback, refuses a
    weak key and refuses to make one; in a Ray worker (a config deploy's build
    task) it never makes one, since its print would land in Ray's logs."""
    key = os.environ.get("RLGATE_ADMIN_KEY")
    if not key and os.environ.get("RLGATE_ADMIN_KEY_FILE"):  # for `ray job submit`: Ray shows a job's env vars
        key = Path(os.environ["RLGATE_ADMIN_KEY_FILE"]).read_text().strip()
    if key:
        refuse_public_bind(host, not is_weak(key))
        return AdminKey(key, False)
    refuse_public_bind(host, False)
    if in_ray_worker():
        raise AdminKeyRefused(
            "rlgate: no admin key: set RLGATE_ADMIN_KEY or RLGATE_ADMIN_KEY_FILE in the environment Ray builds "
            "the application in (a config file's runtime_env, or `serve run --runtime-env-json`); a generated "
            "key would be printed into Ray's log files"
        )
    return AdminKey(new_key("rlg-admin-"), True)


def serve_http_host() -> str:
    """Where Serve's proxies listen: a running Serve controller's ``http_options``
    (a config deploy starts it before building the app), else Serve's default."""
    import ray
    from ray.serve._private.constants import DEFAULT_HTTP_HOST

    if ray.is_initialized():  # never start Ray here: `serve run` inits it after building, with its runtime env
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        if client is not None:
            return client.http_config.host
    return DEFAULT_HTTP_HOST or "127.0.0.1"


def _settings(config: RLGateConfig) -> dict:
    settings = config.model_dump()
    # Actors run with another working directory: give them an absolute run folder.
    settings["gateway"]["run_dir"] = str(Path(config.gateway.run_dir, config.gateway.run_name).resolve())
    return settings


def build_rollout_app(config: RLGateConfig, initial_version: int = 0, pool: str | None = None) -> Application:
    """The RolloutServer deployment alone (no HTTP): engines behind a Serve handle;
    ``pool``: the engines of that engine pool, serving its runs' adapters."""
    bundle = replica_bundle(config)  # [compute] placement = "split" adds the rlgate_rollout resource
    settings = _settings(config)
    if pool is not None:  # a run's own adapter is its tenant's, not the engines'
        settings["model"]["adapter"] = None
    return RolloutServer.options(
        num_replicas=config.rollout.replicas,
        max_ongoing_requests=config.rollout.max_ongoing_requests,  # per replica, then
        max_queued_requests=config.rollout.max_queued_requests,  # per caller, then BackPressureError (503)
        ray_actor_options={"num_cpus": bundle.cpus, "num_gpus": bundle.gpus, "resources": bundle.custom()},
    ).bind(settings, resolve_model(config), initial_version, pool)


def policy_store(config: RLGateConfig, initial_version: int = 0):
    """The run's PolicyStore (needs Ray), made here if no one has yet, as each replica makes it."""
    run_dir = Path(config.gateway.run_dir, config.gateway.run_name).resolve()
    name = actor_name(config.gateway.run_name, "policy")
    return get_or_create_policy_store(name, NAMESPACE, initial_version, str(run_dir / "policy.json"))


def join_engine_pool(config: RLGateConfig, initial_version: int = 0) -> PoolSpec:
    """Join the run to its ``[rollout] pool`` (needs Ray): its PolicyStore made first
    (the pool's replicas follow it), then the pool deployed if it is not running;
    SystemExit with the reason when the run cannot join."""
    import ray

    gateway, pool = config.gateway, config.rollout.pool
    store = policy_store(config, initial_version)
    spec = PoolSpec.of(config, resolve_model(config))
    tenant = TenantInfo(initial_version, config.model.adapter)
    state = Path(gateway.run_dir).resolve() / "pools" / f"{pool}.json"
    try:
        joined = join_pool(config, spec, tenant, build_rollout_app(config, pool=pool), str(state))
    except PoolRefused as refused:
        ray.kill(store)  # made for the pool to follow: a run that cannot join leaves nothing behind
        raise SystemExit(f"rlgate: {refused}") from None
    # every replica serves this run (its follower acks this run's new store) before its first request
    if not ray.get(store.wait_served.remote(initial_version, joined.replicas, POOL_SERVED_S)):
        raise RuntimeError(f"engine pool {pool!r}: not every replica took run {gateway.run_name!r} in time")
    return joined


QUIET = {"enable_access_log": False}  # Serve's logging: a line per request would bury a driver's progress bar


@dataclass
class Serving:
    """Serve's HTTP proxy as this process found it: where it listens, and whether this process started it."""

    host: str
    port: int
    started: bool


class Taken(ValueError):
    """What a process would serve is another's: its run held by another process, or its application served."""


CLAIM_WAIT_S = 20.0  # a process stopped hard frees its run's name within a second or two (its claim ends with it)


def claim_run(run: str, first_command: int = 0) -> ActorHandle:
    """The run's claim on the cluster, taken before anything of the run is touched:
    its TrainChannel (a driver trains through it; ``serve_app.py`` and ``rlgate chat``
    hold it unused). It is this process's actor, not detached, and ends with it; so a
    second process of a run in use (the same config submitted twice, a driver beside
    ``rlgate serve``) is refused here, where it would have deleted the other's
    application and ended its stores. A claim whose process was stopped hard is waited
    out; one whose process answers, a second apart, is another's."""
    from rlgate.actors.train_channel import TrainChannel

    deadline, answered, ever = time.monotonic() + CLAIM_WAIT_S, 0, False
    while True:
        try:
            return TrainChannel.options(name=actor_name(run, "train"), namespace=NAMESPACE).remote(first_command)
        except ValueError:  # the name is taken: a process of this run lives, or one stopped hard is ending
            answered = answered + 1 if answers(run, "train") else 0
            ever = ever or answered > 0
            if answered == 2:
                raise Taken(
                    f"run '{run}' is in use on this cluster (a training driver, `rlgate serve` or `rlgate chat` "
                    "holds it): give this one another run name, or stop that one first"
                ) from None
            if time.monotonic() > deadline:
                raise Taken(
                    f"run '{run}' is still held by a process that {'stopped answering' if ever else 'does not answer'}"
                    " (its node lost?): try again once Ray has seen it go (a minute or so)"
                ) from None
            time.sleep(1.0)


def refuse_served(app: str) -> None:
    """An application of this name already served is another process's: ``serve.run`` would replace it."""
    from ray import serve
    from ray.serve.context import _get_global_client

    if _get_global_client(raise_if_no_controller_running=False) is not None and app in serve.status().applications:
        raise Taken(
            f"an application '{app}' is already served on this cluster: stop what serves it first "
            f"(or `serve delete {app}` if that process is gone)"
        )


def start_serve(config: RLGateConfig, version: int = 0) -> Serving:
    """Serve's HTTP proxy (a Serve already running keeps its own host and port),
    and a ``[rollout] pool``'s shared engines joined: the gateway calls them by name."""
    from ray import serve
    from ray.serve.context import _get_global_client

    gateway = config.gateway
    running = _get_global_client(raise_if_no_controller_running=False)
    if running is None:
        # One proxy, on the head: agents use one address (a proxy per node would also collide on a shared host).
        http = {"host": gateway.host, "port": gateway.port}
        serve.start(proxy_location="HeadOnly", http_options=http, logging_config=QUIET, **serve_start_options())
        serving = Serving(gateway.host, gateway.port, True)
    else:
        serving = Serving(running.http_config.host, running.http_config.port, False)
    if config.rollout.pool is not None:
        join_engine_pool(config, version)
    return serving


def end_served(config: RLGateConfig, started_serve: bool, app: str | None = None) -> None:
    """Nothing a process served for its run is left running: the application (``app``,
    else the run's own) deleted, the run's ``[rollout] pool`` left (the last run to leave
    deletes the pool), the run's detached actors ended, as a JobManager ends a job's (on a
    cluster that keeps running each would idle there for good, a process at ~1 % of a
    core), and Serve shut down when this process started it and nothing else is served:
    other applications on a shared cluster are left alone. The run's files stay."""
    from ray import serve

    serve.delete(app or app_name(config.gateway.run_name, config.gateway.route_prefix))
    if config.rollout.pool is not None:
        leave_pool(config.rollout.pool, config.gateway.run_name)
    end_actors(config.gateway.run_name, ROLES)
    if started_serve and not serve.status().applications:
        serve.shutdown()


def build_app(
    config: RLGateConfig, admin_key_hash: str, initial_version: int = 0, key_fit_for_public: bool = False
) -> Application:
    """The Gateway (HTTP ingress): in front of the RolloutServer deployment, or
    with ``[gateway] colocate`` each replica running its own engine.
    ``key_fit_for_public``: the admin key may guard a port beyond loopback (each
    replica refuses to start on such a port otherwise)."""
    # Serve's access log shows raw paths, and a scoped URL's path is a session key: the Gateway logs its own.
    no_access_log = {"enable_access_log": False}
    deployment = secrets.token_hex(8)  # a replica replacing a crashed one of this deployment resumes its sessions
    model = resolve_model(config)
    # the model's tokenizer class, resolved here once: each replica loads its tokenizer by it, without torch
    args = (_settings(config), model, admin_key_hash, initial_version, deployment, key_fit_for_public)
    args += (tokenizer_class(model),)
    if config.gateway.colocate:
        bundle = replica_bundle(config)
        gateway = Gateway.options(
            num_replicas=config.rollout.replicas,
            max_ongoing_requests=config.rollout.max_ongoing_requests,  # the engine's, as a RolloutServer's
            max_queued_requests=config.rollout.max_queued_requests,
            ray_actor_options={"num_cpus": bundle.cpus, "num_gpus": bundle.gpus, "resources": bundle.custom()},
            logging_config=no_access_log,
            request_router_config=router_config(config.rollout.replicas),  # a session's requests go to its owner
        )
        return gateway.bind(None, *args)
    # in an engine pool the Gateway finds the pool's engines by name (joined first: join_engine_pool)
    engines = build_rollout_app(config, initial_version) if config.rollout.pool is None else None
    gateway = Gateway.options(
        num_replicas=config.gateway.replicas, ray_actor_options={"num_cpus": 0}, logging_config=no_access_log
    )
    return gateway.bind(engines, *args)


def app_builder(args: dict) -> Application:
    """Entry point for ``serve run serve_app:app`` (or ``rlgate.serving.app:app``) and Serve YAML ``import_path``."""
    config = load_config(args.get("config") or os.environ.get("RLGATE_CONFIG") or DEFAULT_CONFIG)
    if config.rollout.pool is not None:
        raise ValueError("[rollout] pool: serve it with `rlgate serve` or a training run, which join the pool first")
    key = admin_key(serve_http_host())  # the proxies' real address, not the TOML's [gateway] host
    if key.generated:
        print(f"rlgate: admin key (shown once): {key.value}", file=sys.stderr, flush=True)
    return build_app(config, hash_key(key.value), key_fit_for_public=key.fit_for_public)


app = app_builder


APP = "rlgate"  # `python serve_app.py` / `rlgate serve`: at the root of Serve's proxy


def main() -> None:
    import signal
    import threading

    import ray
    from ray import serve

    parser = argparse.ArgumentParser(description="Run rlgate's gateway and rollout engines until interrupted.")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--host", help="bind address (default: [gateway] host)")
    parser.add_argument("--port", type=int, help="port (default: [gateway] port)")
    args = parser.parse_args()
    config = load_config(args.config)
    host = args.host or config.gateway.host
    port = args.port or config.gateway.port
    config.gateway.host, config.gateway.port = host, port
    try:
        key = admin_key(host)
    except AdminKeyRefused as refused:
        raise SystemExit(str(refused)) from None
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    try:
        refuse_served(APP)
        claim = claim_run(config.gateway.run_name)  # held until this process ends (end_served ends it first)
    except Taken as taken:
        raise SystemExit(f"rlgate: {taken}") from None
    serving = start_serve(config)  # a Serve already running on the cluster keeps its address
    app = build_app(config, hash_key(key.value), key_fit_for_public=key.fit_for_public)
    serve.run(app, name=APP, route_prefix="/")
    url = f"http://{serving.host}:{serving.port}"
    print(f"rlgate: serving {config.served_model_name} at {url} (OpenAI base URL {url}/v1)", flush=True)
    if key.generated:
        print(f"rlgate: admin key (shown once; set RLGATE_ADMIN_KEY to choose it): {key.value}", flush=True)
    stop.wait()
    end_served(config, serving.started, APP)
    del claim  # (ended by end_served; the handle kept it until then)


if __name__ == "__main__":
    main()
