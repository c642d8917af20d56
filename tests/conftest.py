"""Shared fixtures: one tiny model, one engine of each kind and one Ray cluster
per test session (the machine has two cores; starting them once keeps the
suite fast)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import pytest

from rlgate.engines import vllm_installed
from rlgate.models import prepare_model
from rlgate.serving.routing import serve_start_options
from tests.support import free_port

needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")

# Every key rlgate makes (rlgate.sessions.new_key): session keys rlg-<secret> and
# rlg<slot>-<secret>, RL job keys rlg-job-<secret>, admin keys rlg-admin-<secret>
# (a job's gateway, a generated one), the secret being 256 bits in 43 URL-safe
# characters. Tests grep for the pattern, so keys no test ever sees count too.
GENERATED_KEY = re.compile(rb"rlg\d*-(?:job-|admin-)?[A-Za-z0-9_-]{43}")


def generated_keys(data: bytes | str) -> list[str]:
    """The generated keys in ``data``."""
    data = data.encode() if isinstance(data, str) else data
    return [found.decode() for found in GENERATED_KEY.findall(data)]


# Test tiers (`pytest -m unit|integration|system`; `make test-fast` runs the unit tier):
# system tests run their own clusters or processes (the driver, `serve run`, a
# two-node cluster) or kill parts of the system; integration tests use the shared
# Ray session or start a vLLM engine; the rest are unit tests (seconds each).
SYSTEM_MODULES = {"test_cluster", "test_training", "test_faults", "test_serve_app", "test_cli"}
INTEGRATION_FIXTURES = {"ray_session", "vllm_engine", "smollm2_vllm"}


def tier(item) -> str:
    if item.module.__name__.rsplit(".", 1)[-1] in SYSTEM_MODULES:
        return "system"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & INTEGRATION_FIXTURES or ("engine" in fixtures and "[vllm]" in item.nodeid):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_path():
    return prepare_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer):
    questions = ["What is 2+2?", "Hello there", "def add(a, b):", "List three colours."]
    return [
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]


@pytest.fixture(scope="session")
async def hf_engine(tiny_path):
    from rlgate.engines.hf import HFEngine

    engine = HFEngine(tiny_path, max_model_len=1024)
    await engine.ready()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
async def vllm_engine(tiny_path):
    if not vllm_installed():
        pytest.skip("vLLM is not installed")
    from rlgate.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_path, max_model_len=1024, cpu_kv_cache_gib=0.5)
    await engine.ready()
    yield engine
    await engine.shutdown()


@pytest.fixture(params=["vllm", "hf"])
def engine(request):
    """Each engine in turn, for tests of the shared interface."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="session")
def reference_model(tiny_path):
    """A float32 transformers copy of tiny-random, the parity reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster with Serve's HTTP proxy on a free loopback port."""

    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=True, log_to_driver=False)  # the dashboard serves the job API
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **serve_start_options())
    ray.serve_url = f"http://127.0.0.1:{port}"
    yield ray
    serve.shutdown()
    ray.shutdown()


@dataclass
class GatewayApp:
    """A running gateway application: its base URL (the app root), admin key,
    settings, run folder, and a handle to its engines (the RolloutServer, or the
    Gateway itself when colocated)."""

    name: str
    url: str
    admin_key: str
    config: object
    run_dir: Path
    rollout: object

    @property
    def admin(self) -> dict:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def start_session(self, task_id: str = "task", **body) -> dict:
        import httpx

        response = httpx.post(f"{self.url}/rl/start_session", json={"task_id": task_id, **body}, headers=self.admin)
        assert response.status_code == 200, response.text
        return response.json()

    def trajectories(self, since: int = 0) -> list[dict]:
        import json

        import httpx

        response = httpx.get(f"{self.url}/rl/trajectories", params={"since": since}, headers=self.admin)
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.text.splitlines()]


def start_gateway(ray_session, tmp_path_factory, name: str, settings: dict) -> GatewayApp:
    """Deploy a gateway app under ``/<name>`` on the shared Serve proxy."""
    import secrets

    from ray import serve

    from rlgate.config import parse_config
    from rlgate.sessions import hash_key
    from serve_app import build_app

    run_root = tmp_path_factory.mktemp(name)
    settings = {**settings, "gateway": {"run_dir": str(run_root), "run_name": name, **settings.get("gateway", {})}}
    config = parse_config(settings)
    admin_key = "test-admin-" + secrets.token_hex(16)
    serve.run(build_app(config, hash_key(admin_key)), name=name, route_prefix=f"/{name}")
    rollout = serve.get_deployment_handle("Gateway" if config.gateway.colocate else "RolloutServer", app_name=name)
    return GatewayApp(name, f"{ray_session.serve_url}/{name}", admin_key, config, run_root / name, rollout)


def gateway_fixture(name: str, settings: dict):
    """A module-scoped fixture: a gateway app under ``/<name>``, deleted after the module."""

    @pytest.fixture(scope="module")
    def deployed(ray_session, tmp_path_factory):
        from ray import serve

        app = start_gateway(ray_session, tmp_path_factory, name, settings)
        yield app
        serve.delete(name)

    return deployed


@contextmanager
def serve_asgi(app):
    """Serve an ASGI app (e.g. a task app) with uvicorn on a free loopback port,
    in a thread; yields its base URL."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the ASGI app did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
async def served(hf_engine, tiny_tokenizer, tmp_path):
    """(an httpx client on the serving path in this process, its SessionManager, the records it saved)."""
    import httpx

    from tests.support import serving_app

    app, manager, saved = serving_app(hf_engine, tiny_tokenizer, tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http, manager, saved
