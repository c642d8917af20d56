"""Helpers shared by test modules (the fixtures are in conftest.py, which uses these too)."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from rlgate.config import parse_config
from rlgate.rollout.engines import vllm_installed
from rlgate.serving.auth import Auth
from rlgate.serving.clients import JobsClient, LocalEngine
from rlgate.serving.owned import LocalSessions
from rlgate.serving.routes import build_app
from rlgate.serving.service import GatewayService
from rlgate.sessions.manager import SessionManager, hash_key

ROOT = Path(__file__).resolve().parents[1]

# Two tokens whose reference logprobs are this close are a near tie: which one
# greedy decoding picks is decided by kernel rounding (CPU model, thread count,
# engine, batch shape), not by the model. Engines agree with the float32
# reference to ~1e-5 nats, so 1e-3 is a wide berth on both sides.
GREEDY_TIE_NATS = 1e-3


def assert_same_greedy(reference, prompt: list[int], a: list[int], b: list[int], tol: float = GREEDY_TIE_NATS) -> int:
    """Two greedy decodings of ``prompt`` agree token for token, or part ways
    only at a near tie of ``reference`` (both tokens within ``tol`` nats of the
    best). Returns how many leading tokens they share."""
    import torch

    a, b = list(a), list(b)
    assert len(a) == len(b), f"greedy decodings of different lengths: {len(a)} and {len(b)}"
    shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if shared == len(a):
        return shared
    with torch.no_grad():
        logits = reference(torch.tensor([list(prompt) + a[:shared]])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    best = logprobs.max().item()
    gaps = best - logprobs[a[shared]].item(), best - logprobs[b[shared]].item()
    assert max(gaps) < tol, (
        f"greedy decodings part at token {shared} ({a[shared]} vs {b[shared]}), "
        f"{max(gaps):.2e} nats from the best: not a near tie (< {tol:.0e})"
    )
    return shared


def free_ports(count: int) -> list[int]:
    """``count`` different free ports (each as :func:`free_port`): separate draws of
    one port can return the same one, which a process given both refuses."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def free_port(count: int = 1) -> int:
    """A loopback TCP port nothing listens on right now (with ``count``, the first
    of that many in a row). Drawn from 20000-31999: above Ray's worker ports
    (10002-19999) and below the kernel's ephemeral range, where any outgoing
    connection (Ray starts hundreds) could take it before the server binds it.
    Under pytest-xdist each worker draws from its own slice of that range: two
    workers never hand the same free port to two servers about to bind it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    width = 12000 // workers
    low = 20000 + worker * width
    while True:
        first = random.randrange(low, low + width - count)
        if all(_free(port) for port in range(first, first + count)):
            return first


def hears_ctrl_c() -> None:
    """A ``preexec_fn`` for a server a test stops with SIGINT: SIGINT handled as in a
    terminal, whatever ran the tests (a shell without job control starts its
    background commands with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


BIN = Path(sys.executable).parent  # the ray and serve commands of this environment


@dataclass
class RayNodes:
    """Local ``ray start --block`` nodes on loopback: a head, then any workers, with
    every port and the temp dir their own, so they run beside any other cluster on
    the machine (two ``ray.init()`` clusters share the dashboard agent's default
    port: the second's job API then never answers)."""

    gcs: str  # host:port, for ray.init and `serve run --address`
    dashboard: str  # the job and state APIs
    metrics_ports: list[int]  # one a node
    env: dict
    logs: Path
    temp: Path
    processes: list
    _ports: Iterator[int] = iter(())  # the nodes' own ports, drawn with the head's

    @classmethod
    def head(cls, logs: Path, num_cpus: int, resources: dict | None = None, nodes: int = 1):
        """Start a head node, drawing every port of ``nodes`` nodes at once (separate
        draws can return the same port, and Ray refuses a port given twice), and wait
        until Ray's state API lists it."""
        import tempfile

        temp = Path(tempfile.mkdtemp(prefix="rlg", dir="/tmp"))  # short: Ray's socket paths are length-limited
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env |= {"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
        gcs, dashboard, client, *ports = free_ports(3 + 4 * nodes)
        head = cls(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", ports[:nodes], env, logs, temp, [])
        head._ports = iter(ports[nodes:])
        own = [f"--port={gcs}", f"--temp-dir={temp}", "--include-dashboard=true", "--dashboard-host=127.0.0.1"]
        own += [f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
        process = head._start("head", num_cpus, resources or {}, "--head", *own)
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:  # exited: say why at once, not after the whole wait
                raise AssertionError(f"the head node exited:\n{(logs / 'head.log').read_text()[-3000:]}")
            try:
                if head.state("nodes"):
                    return head
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the head node did not come up in 120 s:\n{(logs / 'head.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)

    def worker(self, name: str, num_cpus: int, resources: dict) -> None:
        """Start a worker node joining the head (the caller waits for it in the state API),
        with a temp dir of its own, as a node on another machine has: with the head's, a job
        driver on the head found its unpacked working_dir deleted under it (both nodes'
        runtime-env agents keep and clean that folder)."""
        temp = self.temp / name
        temp.mkdir()
        self._start(name, num_cpus, resources, f"--address={self.gcs}", f"--temp-dir={temp}")

    def _start(self, name: str, num_cpus: int, resources: dict, *args: str) -> subprocess.Popen:
        import json

        agent, agent_grpc, runtime_env = next(self._ports), next(self._ports), next(self._ports)
        own = [f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}"]
        metrics = self.metrics_ports[len(self.processes)]
        own += [f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}"]
        command = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        command += [f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}", *own, *args]
        with open(self.logs / f"{name}.log", "w") as out:  # a process group of its own: the node's, ended at once
            process = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes.append(process)
        return process

    def state(self, kind: str) -> list[dict]:
        """Ray's state API: nodes, actors, ..."""
        body = httpx.get(f"{self.dashboard}/api/v0/{kind}", params={"limit": 10000}, timeout=30).json()
        return body["data"]["result"]["result"]

    def stop(self) -> None:
        """End every node at once and wait for every process below them. A node's GCS,
        raylet and agents are in its ``ray start``'s process group: killed together (a
        SIGTERM to ``ray start --block`` stops them gracefully in ~30 s). Its workers,
        each in a group of its own, end when their raylet does, and the engines below
        them with their worker (the reaper)."""
        import shutil

        import psutil

        below = []
        for process in self.processes:
            try:
                below += psutil.Process(process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        deadline = time.monotonic() + 60
        while left := [p for p in below if alive(p)]:
            assert time.monotonic() < deadline, f"processes of the Ray nodes outlived them: {left}"
            time.sleep(0.2)
        shutil.rmtree(self.temp, ignore_errors=True)


def replica_process(app: str, deployment: str):
    """The live process of ``app``'s ``deployment`` replica (one), as this test session's
    cluster has it: its state API, not a process title another cluster on the machine
    (the other `make test` worker's) may share."""
    import psutil
    import ray
    from ray.util.state import list_actors

    filters = [("class_name", "=", f"ServeReplica:{app}:{deployment}"), ("state", "=", "ALIVE")]
    [replica] = list_actors(address=ray.get_runtime_context().gcs_address, filters=filters)
    return psutil.Process(replica.pid)


def publish_perturbed(ray_session, store, model, version: int, replicas: int, scale: float = 0.05):
    """Publish a randomly perturbed copy of ``model`` as ``version`` to the
    PolicyStore ``store`` and wait until ``replicas`` replicas serve it; returns the copy."""
    import copy

    import torch

    stepped = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in stepped.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)
    ray_session.get(store.publish.remote(version, [ray_session.put(stepped.state_dict())]))
    assert ray_session.get(store.wait_served.remote(version, replicas, 120))
    return stepped


class Disk:
    """A filesystem with ``room`` bytes left, for files opened with
    :meth:`open` or wrapped with :meth:`wrap`: a write past the room fails part
    way, as on a full disk (the bytes that fit reach the file, then ENOSPC).
    ``room = None`` is a disk with space to spare."""

    def __init__(self, room: int | None) -> None:
        self.room = room

    def open(self, path, mode: str = "r", buffering: int = -1) -> DiskFile:
        return DiskFile(open(path, mode, buffering=buffering), self)

    def wrap(self, file) -> DiskFile:
        return DiskFile(file, self)


class DiskFile:
    def __init__(self, file, disk: Disk) -> None:
        self.file, self.disk = file, disk

    def write(self, data) -> int:
        import errno

        if self.disk.room is None:
            return self.file.write(data)
        if self.disk.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = self.file.write(bytes(data[: self.disk.room]))
        self.disk.room -= written
        return written

    def __getattr__(self, name):  # everything else is the real file's
        return getattr(self.file, name)

    def __enter__(self) -> DiskFile:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


# synth-ai's SDK, as its users install it: the wheel alone (its declared
# dependencies pull in dspy, gymnasium, datasets, ...), plus what
# ``synth_ai.sdk.api.train.rl`` imports (importing synth_ai pulls in its CLI).
SYNTH_AI = "synth-ai==0.4.4"
SYNTH_AI_IMPORTS = [
    "pydantic",
    "requests",
    "httpx",
    "aiohttp",
    "python-dotenv",
    "fastapi",
    "uvicorn",
    "click>=8.1.7,<8.2",
    "mcp>=1.21,<2",  # 2.x dropped Server.list_tools, which synth_ai's MCP module uses at import
    "modal>=1.1.4,<2",
    "celery",
    "sqlalchemy",
    "libsql",
    "pynacl",
    "tomli_w",
]


def _test_cache() -> Path:
    folder = Path(os.environ.get("RLGATE_TEST_CACHE", Path.home() / ".cache" / "rlgate-tests"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def synth_ai_wheel() -> Path:
    """synth-ai 0.4.4's wheel from the package index (cached); skips the test when
    the index cannot be reached."""
    import pytest

    folder = _test_cache() / "wheels"
    found = sorted(folder.glob("synth_ai-0.4.4-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SYNTH_AI, "-d", str(folder)]
        fetched = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        found = sorted(folder.glob("synth_ai-0.4.4-*.whl"))
        if fetched.returncode or not found:
            pytest.skip(f"the package index cannot be reached for {SYNTH_AI}: {fetched.stderr.strip()[-300:]}")
    return found[-1]


def synth_ai_python() -> Path:
    """A Python with synth-ai 0.4.4's SDK and nothing of rlgate (a venv beside the
    test cache, made once); skips the test when the package index cannot be reached."""
    wheel = synth_ai_wheel()  # the index answers: from here on a failure is a failure
    venv = _test_cache() / "synth-ai-0.4.4-venv"
    python = venv / "bin" / "python"
    ready = venv / "ready"
    if not ready.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=600)
        subprocess.run([*pip, *SYNTH_AI_IMPORTS], check=True, timeout=1200)
        check = [str(python), "-c", "from synth_ai.sdk.api.train.rl import RLJob"]
        subprocess.run(check, check=True, timeout=300, cwd=venv, env=synth_ai_env(venv))
        ready.touch()
    return python


def synth_ai_env(folder: Path) -> dict:
    """The environment to run synth-ai's SDK in: its experiment queue database in
    ``folder`` (importing synth_ai makes one), nothing of rlgate's."""
    drop = ("RLGATE_ADMIN_KEY", "RLGATE_URL", "ENVIRONMENT_API_KEY", "SYNTH_API_KEY", "PYTHONPATH", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop} | {
        "EXPERIMENT_QUEUE_DB_PATH": str(Path(folder) / "experiment_queue.db")
    }


def alive(process) -> bool:
    """Whether a ``psutil.Process`` still runs: a zombie has ended (its new parent may never reap it)."""
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def lines(path: Path) -> list[dict]:
    """The JSON lines of a file (metrics.jsonl, batches.jsonl, a trajectory segment)."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the serving path in this process (no Ray Serve): tests/conftest.py's `served` ---

ADMIN = "serving-admin-key"


class Slots:
    """Admission without a trainer: up to ``limit`` open sessions."""

    def __init__(self, limit: int) -> None:
        self.limit, self.running = limit, 0

    async def acquire(self, timeout_s: float = 0.0, task_id=None, group_size=None) -> bool:
        if self.running >= self.limit:
            return False
        self.running += 1
        return True

    async def release(self, accepted: bool) -> None:
        self.running -= 1


class NoStores:
    """Status and trajectory reads are the actors' business; unused here."""


def serving_app(engine, tokenizer, tmp_path, model: str = "tiny-random", **gateway):
    """(the ASGI app, its SessionManager, the records it saved) of a gateway over
    ``engine`` in this process, with these ``[gateway]`` settings (export_style concat)."""
    saved: list[dict] = []

    async def persist(records: list[dict]) -> None:
        saved.extend(records)

    gateway = {"run_dir": str(tmp_path), "export_style": "concat", **gateway}
    settings = parse_config({"model": {"name": model}, "gateway": gateway})
    manager = SessionManager(Slots(4), persist, export_style="concat")
    service = GatewayService(
        settings,
        tokenizer,
        Auth(hash_key(ADMIN)),
        LocalSessions(manager),
        LocalEngine(engine),
        NoStores(),
        JobsClient(lambda: None),
    )
    return build_app(service), manager, saved


async def start(http: httpx.AsyncClient, task: str = "t") -> str:
    started = await http.post("/rl/start_session", json={"task_id": task}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert started.status_code == 200, started.text
    assert started.json()["inference_url"] == f"http://gateway/s/{started.json()['api_key']}/v1"
    return started.json()["api_key"]


def client(http: httpx.AsyncClient, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=http)


# --- colocated gateway replicas over HTTP ---


def key_of(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def prompt_len(record: dict) -> int:
    return record["loss_mask"].index(1)


def until_served(call, seconds: float = 180):
    """Call until the replica's successor answers (connection refused or 5xx meanwhile)."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            response = call()
            if response.status_code < 500:
                return response
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "no replica took over"
        time.sleep(0.5)


needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")

# Every key rlgate makes (rlgate.sessions.manager.new_key): session keys rlg-<secret> and
# rlg<slot>-<secret>, RL job keys rlg-job-<secret>, admin keys rlg-admin-<secret>
# (a job's gateway, a generated one), the secret being 256 bits in 43 URL-safe
# characters. Tests grep for the pattern, so keys no test ever sees count too.
GENERATED_KEY = re.compile(rb"rlg\d*-(?:job-|admin-)?[A-Za-z0-9_-]{43}")


def generated_keys(data: bytes | str) -> list[str]:
    """The generated keys in ``data``."""
    data = data.encode() if isinstance(data, str) else data
    return [found.decode() for found in GENERATED_KEY.findall(data)]


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
    from rlgate.serving.app import build_app
    from rlgate.sessions.manager import hash_key

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


def lora_model(reference_model, rank: int, seed: int):
    """``reference_model`` (copied) with a LoRA adapter of ``rank`` whose B is drawn, not
    zero, so that it changes the model's outputs."""
    import copy

    import torch

    from rlgate.config import LoraSettings
    from rlgate.rollout import lora

    torch.manual_seed(seed)
    model = lora.attach(copy.deepcopy(reference_model), LoraSettings(rank=rank, alpha=2.0 * rank))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return model.eval()
