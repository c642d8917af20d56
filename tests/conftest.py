"""Shared fixtures: one tiny model, one engine of each kind and one Ray cluster
per test session (the machine has two cores; starting them once keeps the
suite fast)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Ray Train's node-preemption watcher is an actor (a process) per run, for clusters whose nodes are drained
# before they go: no test drains a node, and the suite starts a dozen runs on two cores
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# OpenMP threads (torch in trainers and drivers) spin 10,000 rounds before sleeping, as the CPU
# engines do, not libgomp's 300,000: `make test` runs two workers on two cores, and a thread
# spinning between parallel sections takes the core the other worker's processes wait for
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# Serve's controller runs its control loop every 0.25 s, not 0.1 s: on an idle cluster with one app that
# takes it from 2.7 to 1.3 % of a core and the GCS it polls from 1.6 to 0.9 % (each session cluster lives the
# whole suite, beside the clusters drivers start); a deploy or a replica's replacement waits a loop or two more
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.25")
# A raylet starts no idle workers for the first driver to join it (by default one a CPU, two on a session
# cluster): the tests' drivers mostly make detached actors, whose workers start on demand anyway, and an idle
# worker that is never used costs its start and ~0.5 % of a core for the whole suite (18 such, 33 CPU-s, seen)
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray's log monitor lists the log folder every 0.1 s while it holds under this many files; at 0 it
# lists it every 0.5 s (new workers' logs still reach drivers): 4.3 ms/s of CPU an idle cluster, not 10.3
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# Each `make test` worker computes on one thread, its vLLM engines bound to a core of their own:
# two workers' engines and trainers each asking for both cores meet at every parallel section
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    core = int(os.environ["PYTEST_XDIST_WORKER"][2:]) % (os.cpu_count() or 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from rlgate.models import prepare_model
from rlgate.rollout.engines import vllm_installed
from rlgate.serving.routing import serve_start_options
from tests.support import RayNodes, free_port

# Test tiers are folders: tests/unit (no Ray, no vLLM: seconds each), tests/integration
# (the shared Ray session below, real Serve apps and engines), tests/system (the driver,
# `serve run`, jobs, a two-node cluster, kill tests). Each test is also marked with its
# tier, so `pytest -m unit` works from anywhere.
TIERS = ("unit", "integration", "system")


def tier(item) -> str:
    return next(part for part in item.path.relative_to(Path(__file__).parent).parts if part in TIERS)


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        item.add_marker(getattr(pytest.mark, tier(item)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `make test` (the workers collect, not the controller)
        hand_out_order(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def hand_out_order(items) -> None:
    """The order in which `make test` hands test modules to its workers (pytest-xdist's
    loadfile: a module's tests go to one worker together, so its module fixtures are
    made once; each worker has a Ray session of its own). The unit tier first, before
    a worker joins Ray (its tests assume a process without it); then the modules with
    tests marked ``long``, then the rest from the slowest tier, so the short modules
    fill in at the end and both workers finish close together."""

    long = {item.module.__name__ for item in items if "long" in item.keywords}

    def order(item) -> tuple:
        return (tier(item) != "unit", item.module.__name__ not in long, -TIERS.index(tier(item)))

    items.sort(key=order)


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
    from rlgate.rollout.engines.hf import HFEngine

    engine = HFEngine(tiny_path, max_model_len=1024)
    await engine.ready()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="session")
async def vllm_engine(tiny_path):
    if not vllm_installed():
        pytest.skip("vLLM is not installed")
    from rlgate.rollout.engines.vllm import VLLMEngine

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
def ray_session(tmp_path_factory):
    """One local Ray cluster (a ``ray start`` head with four CPUs, the dashboard
    serving the job API, every port its own) with Serve's HTTP proxy on a free
    loopback port. Its own ports let the test tiers run side by side, each with
    a cluster of its own (`make test`)."""

    import ray
    from ray import serve

    node = RayNodes.head(tmp_path_factory.mktemp("ray-session"), num_cpus=4)
    try:
        ray.init(address=node.gcs, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **serve_start_options())
        ray.serve_url = f"http://127.0.0.1:{port}"
        yield ray
        serve.shutdown()
        ray.shutdown()
    finally:
        node.stop()


def _left_in_cluster() -> tuple[set[str], set[str]]:
    """(the rlgate run actors alive, the Serve applications) in this process's Ray
    cluster; empty when this process has not joined one."""
    import ray

    if not ray.is_initialized():
        return set(), set()
    from ray import serve

    from rlgate.run import NAMESPACE

    actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
    try:
        applications = set(serve.status().applications)
    except Exception:  # Serve not started
        applications = set()
    return actors, applications


@pytest.fixture(scope="module", autouse=True)
def _ends_what_the_module_left():
    """Hand the shared cluster to the next module as this one found it: the run
    actors (detached, so deleting an app leaves them) and Serve applications the
    module made are ended after its own fixtures. Each idle actor costs about 1 %
    of a core in its own loops; a session's leftovers otherwise slow every later test."""
    actors, applications = _left_in_cluster()
    yield
    now_actors, now_applications = _left_in_cluster()
    if not now_actors and not now_applications:
        return
    import ray
    from ray import serve

    from rlgate.run import NAMESPACE

    for name in now_applications - applications:
        serve.delete(name)
    for name in now_actors - actors:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass  # gone meanwhile


@pytest.fixture
async def served(hf_engine, tiny_tokenizer, tmp_path):
    """(an httpx client on the serving path in this process, its SessionManager, the records it saved)."""
    import httpx

    from tests.support import serving_app

    app, manager, saved = serving_app(hf_engine, tiny_tokenizer, tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http, manager, saved
