"""Starting the application the ways a user does, each in its own process:
`python serve_app.py` joined to a running cluster, and `serve run
serve_app:app` with its own local Ray (HF engine on tiny-random, to start
quickly)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support import ROOT, free_port, hears_ctrl_c


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "app.toml"
    path.write_text(
        '[model]\nname = "tiny-random"\n[rollout]\nengine = "hf"\nmax_model_len = 512\n'
        f'[gateway]\nrun_dir = "{tmp_path / "runs"}"\nrun_name = "cli"\n'
    )
    return path


def environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLGATE_ADMIN_KEY")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 240) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited early"
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{url} never became healthy")


class Output:
    """Collects a process's output lines as they come."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self.thread.start()

    def wait_for(self, pattern: str, process: subprocess.Popen, seconds: float = 300) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if re.search(pattern, line):
                    return line
            assert process.poll() is None, "the server exited early:\n" + "".join(self.lines[-40:])
            time.sleep(0.5)
        pytest.fail(f"no line matching {pattern!r} within {seconds} s")


def stop(process: subprocess.Popen, output: Output) -> None:
    """Ctrl-C the server; then make sure nothing it started outlives it. Only this
    process tree: `ray stop` would also kill the test session's own cluster."""
    tree = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGINT)
    try:
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("Ctrl-C did not stop the server in 120 s; it said:\n" + "".join(output.lines[-40:]))
        assert code == 0, "".join(output.lines[-40:])
    finally:
        for child in tree:
            if child.is_running():
                child.kill()


@pytest.mark.parametrize("key", ["areal-admin-key", "short-key"])
def test_weak_admin_keys_are_refused_off_loopback(config_file, key):
    result = subprocess.run(
        [sys.executable, "serve_app.py", "--config", str(config_file), "--host", "0.0.0.0"],
        cwd=ROOT,
        env=environment(RLGATE_ADMIN_KEY=key),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "refusing to serve on 0.0.0.0 (beyond loopback) with a weak or generated admin key" in result.stderr
    assert key not in result.stderr  # the key itself is never echoed


def test_no_admin_key_is_made_where_its_print_would_land_in_rays_logs(ray_session, monkeypatch):
    """A config deploy builds the app in a Ray task: there a key is never generated
    (its print goes to Ray's log files), on loopback either; a given key is taken."""
    import ray

    from rlgate.serving import app as serve_app

    monkeypatch.delenv("RLGATE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("RLGATE_ADMIN_KEY_FILE", raising=False)

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"RLGATE_ADMIN_KEY": ""}})
    def build_task_key(given: str | None):
        if given:
            os.environ["RLGATE_ADMIN_KEY"] = given
        try:
            return serve_app.admin_key("127.0.0.1")
        except serve_app.AdminKeyRefused as refused:
            return str(refused)

    refused = ray.get(build_task_key.remote(None))
    assert "no admin key: set RLGATE_ADMIN_KEY or RLGATE_ADMIN_KEY_FILE" in refused
    assert "rlg-admin-" not in refused
    given = "a-long-enough-admin-key-for-tests"
    assert ray.get(build_task_key.remote(given)) == (given, False)
    assert serve_app.admin_key("127.0.0.1").generated  # a driver on loopback still gets one, printed to its user


def test_python_serve_app_prints_url_and_a_generated_admin_key_and_ends_what_it_made(ray_session, config_file):
    """`python serve_app.py` with RAY_ADDRESS, on a cluster whose Serve already
    listens: it serves at Serve's own address (not --port's), prints a generated
    admin key that works, holds its run and refuses a second ``serve_app.py``, and at
    Ctrl-C ends its application and its run's actors, while another application,
    and Serve itself, go on serving. (Starting Serve on the configured address is
    a driver's path too: test_cluster.py's job.)"""
    from ray import serve

    from rlgate.run import ROLES, actor_name, is_alive
    from rlgate.serving.app import Taken, claim_run

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Other:
        def __call__(self, request) -> str:
            return "still here"

    serve.run(Other.bind(), name="other", route_prefix="/other")
    url, address = ray_session.serve_url, ray_session.get_runtime_context().gcs_address
    process = subprocess.Popen(
        [sys.executable, "serve_app.py", "--config", str(config_file), "--port", str(free_port())],
        cwd=ROOT,
        env=environment(RAY_ADDRESS=address, RAY_AUTH_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=hears_ctrl_c,
    )
    output = Output(process)
    try:
        output.wait_for(f"rlgate: serving tiny-random at {url} ", process)  # Serve's address, not --port's
        assert wait_healthy(url, process) == {"status": "ok", "workers": 1, "policy_version": 0}
        key = re.search(r"admin key \(shown once.*?\): (\S+)", output.wait_for("admin key", process)).group(1)
        assert len(key) >= 32
        assert httpx.get(f"{url}/rl/status", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert is_alive("cli", "sessions") and is_alive("cli", "capacity")
        second = subprocess.run(  # started twice: refused, where serve.run would have replaced the first's app
            [sys.executable, "serve_app.py", "--config", str(config_file)],
            cwd=ROOT,
            env=environment(RAY_ADDRESS=address, RAY_AUTH_MODE="disabled"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert "rlgate: an application 'rlgate' is already served on this cluster" in second.stderr
        with pytest.raises(Taken, match="run 'cli' is in use on this cluster"):  # as a driver of the run would be
            claim_run("cli")
        assert wait_healthy(url, process)["status"] == "ok" and is_alive("cli", "sessions")
    finally:
        stop(process, output)
    try:
        assert set(serve.status().applications) == {"other"}
        assert httpx.get(f"{url}/other").text == "still here"
        alive = [actor_name("cli", role) for role in ROLES if is_alive("cli", role)]
        assert alive == [], f"left running: {alive}"
    finally:
        serve.delete("other")


def test_serve_run_serve_app_app(config_file):
    """`serve run` with an import path serves on Serve's default address, 127.0.0.1:8000."""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken; `serve run` needs it"
    key = "a-long-enough-admin-key-for-tests"
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "serve"), "run", "serve_app:app"],
        cwd=ROOT,
        env=environment(RLGATE_CONFIG=str(config_file), RLGATE_ADMIN_KEY=key, RAY_AUTH_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=hears_ctrl_c,
    )
    url = "http://127.0.0.1:8000"
    output = Output(process)  # drains the output, so the server never blocks on a full pipe
    try:
        wait_healthy(url, process)
        output.wait_for("Application 'default' is ready", process)  # Ctrl-C once `serve run` says so, as a user does
        status = httpx.get(f"{url}/rl/status", headers={"Authorization": f"Bearer {key}"})
        assert status.status_code == 200 and status.json()["sessions"]["open_sessions"] == 0
    finally:
        stop(process, output)
