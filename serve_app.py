"""Builds rlgate's Ray Serve application.

    serve run serve_app:app                      # config from $RLGATE_CONFIG or configs/serve.toml
    python serve_app.py --config configs/serve.toml

Today the application is the RolloutServer deployment (one engine per
replica); the session gateway is bound in front of it as its ingress.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ray.serve import Application

from actors.rollout_server import RolloutServer
from rlgate.config import RLGateConfig, load_config
from rlgate.models import BUILTIN_DTYPES, prepare_model

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "serve.toml"


def resolve_model(config: RLGateConfig) -> str:
    """Prepare the model on the driver so a bad name fails here, before any replica starts."""
    storage = config.model.dtype if config.model.dtype in BUILTIN_DTYPES else "float32"
    return str(prepare_model(config.model.name, storage))


def build_app(config: RLGateConfig, initial_version: int = 0) -> Application:
    rollout = config.rollout
    return RolloutServer.options(
        num_replicas=rollout.replicas,
        ray_actor_options={"num_cpus": rollout.num_cpus, "num_gpus": rollout.num_gpus},
    ).bind(config.model_dump(), resolve_model(config), initial_version)


def app_builder(args: dict) -> Application:
    """Entry point for ``serve run serve_app:app`` and Serve YAML ``import_path``."""
    return build_app(load_config(args.get("config") or os.environ.get("RLGATE_CONFIG") or DEFAULT_CONFIG))


def main() -> None:
    import signal
    import threading

    import ray
    from ray import serve

    parser = argparse.ArgumentParser(description="Run rlgate's Serve application until interrupted.")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    args = parser.parse_args()
    config = load_config(args.config)
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    handle = serve.run(build_app(config), name="rlgate", route_prefix=None)
    print(f"rlgate: RolloutServer ready: {handle.health.remote().result()}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()


app = app_builder


if __name__ == "__main__":
    main()
