"""Builds rlgate's Ray Serve application: the Gateway in front of the RolloutServer.

    python serve_app.py --config configs/serve.toml [--host 127.0.0.1] [--port 8000]
    serve run serve_app:app                  # config from $RLGATE_CONFIG or configs/serve.toml

The admin key comes from ``RLGATE_ADMIN_KEY`` (or the file ``RLGATE_ADMIN_KEY_FILE``
names); without it a random key is generated and printed once. A weak key is refused off loopback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import sys
from pathlib import Path

from ray.serve import Application

from actors.gateway import Gateway
from actors.rollout_server import RolloutServer
from rlgate.config import RLGateConfig, load_config
from rlgate.models import BUILTIN_DTYPES, prepare_model
from rlgate.placement import replica_bundle
from rlgate.serving.routing import router_config, serve_start_options
from rlgate.sessions import hash_key, new_key

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "serve.toml"
# Keys published in other projects' docs and examples: never acceptable off loopback.
KNOWN_WEAK_KEYS = {"areal-admin-key", "admin", "changeme", "password", "secret", "test", "sk-test"}
MIN_KEY_LENGTH = 16


def resolve_model(config: RLGateConfig) -> str:
    """Prepare the model on the driver so a bad name fails here, before any replica starts."""
    storage = config.model.dtype if config.model.dtype in BUILTIN_DTYPES else "float32"
    return str(prepare_model(config.model.name, storage))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_key(host: str) -> tuple[str, bool]:
    """The admin key and whether it was generated. Refuses a weak key off loopback."""
    key = os.environ.get("RLGATE_ADMIN_KEY")
    if not key and os.environ.get("RLGATE_ADMIN_KEY_FILE"):  # for `ray job submit`: Ray shows a job's env vars
        key = Path(os.environ["RLGATE_ADMIN_KEY_FILE"]).read_text().strip()
    if not key:
        return new_key("rlg-admin-"), True
    if not is_loopback(host) and (key in KNOWN_WEAK_KEYS or len(key) < MIN_KEY_LENGTH):
        raise SystemExit(
            f"rlgate: refusing to bind {host} with a weak RLGATE_ADMIN_KEY (a published default or under "
            f"{MIN_KEY_LENGTH} characters); set a long random key, e.g. `openssl rand -hex 32`"
        )
    return key, False


def _settings(config: RLGateConfig) -> dict:
    settings = config.model_dump()
    # Actors run with another working directory: give them an absolute run folder.
    settings["gateway"]["run_dir"] = str(Path(config.gateway.run_dir, config.gateway.run_name).resolve())
    return settings


def build_rollout_app(config: RLGateConfig, initial_version: int = 0) -> Application:
    """The RolloutServer deployment alone (no HTTP): engines behind a Serve handle."""
    bundle = replica_bundle(config)  # [compute] placement = "split" adds the rlgate_rollout resource
    return RolloutServer.options(
        num_replicas=config.rollout.replicas,
        max_ongoing_requests=config.rollout.max_ongoing_requests,  # per replica, then
        max_queued_requests=config.rollout.max_queued_requests,  # per caller, then BackPressureError (503)
        ray_actor_options={"num_cpus": bundle.cpus, "num_gpus": bundle.gpus, "resources": bundle.custom()},
    ).bind(_settings(config), resolve_model(config), initial_version)


def build_app(config: RLGateConfig, admin_key_hash: str, initial_version: int = 0) -> Application:
    """The Gateway (HTTP ingress): in front of the RolloutServer deployment, or
    with ``[gateway] colocate`` each replica running its own engine."""
    # Serve's access log shows raw paths, and a scoped URL's path is a session key: the Gateway logs its own.
    no_access_log = {"enable_access_log": False}
    deployment = secrets.token_hex(8)  # a replica replacing a crashed one of this deployment resumes its sessions
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
        return gateway.bind(None, _settings(config), resolve_model(config), admin_key_hash, initial_version, deployment)
    engines = build_rollout_app(config, initial_version)
    gateway = Gateway.options(
        num_replicas=config.gateway.replicas, ray_actor_options={"num_cpus": 0}, logging_config=no_access_log
    )
    return gateway.bind(engines, _settings(config), resolve_model(config), admin_key_hash, initial_version, deployment)


def app_builder(args: dict) -> Application:
    """Entry point for ``serve run serve_app:app`` and Serve YAML ``import_path``."""
    config = load_config(args.get("config") or os.environ.get("RLGATE_CONFIG") or DEFAULT_CONFIG)
    key, generated = admin_key(config.gateway.host)
    if generated:
        print(f"rlgate: admin key (shown once): {key}", file=sys.stderr, flush=True)
    return build_app(config, hash_key(key))


app = app_builder


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
    key, generated = admin_key(host)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    # agents use the head; its proxy routes each session's requests to the replica that owns it
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port}, **serve_start_options())
    serve.run(build_app(config, hash_key(key)), name="rlgate", route_prefix="/")
    url = f"http://{host}:{port}"
    print(f"rlgate: serving {config.served_model_name} at {url} (OpenAI base URL {url}/v1)", flush=True)
    if generated:
        print(f"rlgate: admin key (shown once; set RLGATE_ADMIN_KEY to choose it): {key}", flush=True)
    stop.wait()
    serve.shutdown()


if __name__ == "__main__":
    main()
