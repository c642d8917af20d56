"""The Python SDK (``rlgate.sdk.client``) against a small HTTP server speaking the
gateway's job and session routes over real loopback HTTP: typed errors with
the server's message, retries that honour Retry-After, one pooled connection
per client, defaults from the environment, and the async variant."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlgate.sdk import client as sdk
from tests.support import serve_asgi

ADMIN = "admin-key-for-the-sdk-tests"


def fake_gateway() -> tuple[FastAPI, dict]:
    """Job and session routes with just enough behaviour; ``seen`` records each request."""
    app, seen = FastAPI(), {"requests": [], "ports": [], "busy": 0, "lose_answers": 0, "ended": False}
    jobs: dict[str, int] = {}
    keyed: dict[str, str] = {}  # Idempotency-Key -> job id

    def refuse(status: int, message: str, retry_after: str | None = None) -> JSONResponse:
        headers = {"Retry-After": retry_after} if retry_after is not None else None
        return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)

    @app.middleware("http")
    async def note(request: Request, call_next):
        body = await request.body()
        seen["requests"].append((request.method, request.url.path, request.headers.get("authorization"), body))
        seen["ports"].append(request.client.port)
        if request.headers.get("authorization") not in (f"Bearer {ADMIN}", "Bearer job-key", "Bearer rlg-session"):
            return refuse(401, "invalid API key")
        return await call_next(request)

    @app.post("/api/rl/jobs")
    async def submit(request: Request):
        body = await request.json()
        if body["data"]["config"].get("training", {}).get("batch_size") == 7:
            return refuse(422, "training.batch_size: not a multiple of group_size")
        key = request.headers.get("idempotency-key") or f"unkeyed-{len(jobs)}"
        job_id = keyed.setdefault(key, f"job-{len(jobs)}")
        jobs.setdefault(job_id, 0)
        return lost_answer() or {"job_id": job_id, "status": "queued", "api_key": "job-key"}

    def lost_answer() -> JSONResponse | None:
        """The work is done, and the answer is a 503 (as when an actor dies after it)."""
        if seen["lose_answers"] > 0:
            seen["lose_answers"] -= 1
            return refuse(503, "session service unavailable: ActorDiedError; retry", retry_after="0")
        return None

    @app.get("/api/rl/jobs/{job_id}")
    async def status(job_id: str, request: Request):
        if job_id not in jobs:
            return refuse(404, f"no job {job_id}")
        if request.headers["authorization"] == "Bearer job-key" and job_id != "job-0":
            return refuse(403, "this key belongs to another job")
        jobs[job_id] += 1
        done = jobs[job_id] >= 3
        results = {"final_reward": 0.75, "checkpoints": [], "model_path": "/m"} if done else None
        return {"job_id": job_id, "status": "succeeded" if done else "running", "results": results}

    @app.get("/api/rl/jobs/{job_id}/metrics")
    async def metrics(job_id: str, after_step: int = 0):
        return {"points": [{"step": s} for s in range(after_step + 1, 4)]}

    @app.post("/rl/start_session")
    async def start(request: Request):
        seen["busy"] += 1
        if seen["busy"] <= 2:  # no capacity twice, then a slot
            return refuse(429, "no capacity for a new session; retry later", retry_after="0")
        return {"session_id": "s1", "api_key": "rlg-session", "inference_url": "http://x/s/rlg-session/v1"}

    @app.post("/rl/set_reward")
    async def reward(request: Request):
        return {"message": "reward set", "interaction_id": "i1"}

    @app.post("/rl/end_session")
    async def end(request: Request):
        if seen["ended"]:
            return refuse(410, "this session has ended; start a new one with /rl/start_session")
        seen["ended"] = True
        return lost_answer() or {"message": "ended", "interaction_count": 1}

    @app.post("/jobs/job-0/cancel")
    async def cancel():
        return lost_answer() or {"status": "cancelled"}

    @app.get("/down")
    async def down():
        return refuse(503, "session service unavailable: ActorDiedError; retry", retry_after="0")

    return app, seen


@pytest.fixture
def gateway():
    app, seen = fake_gateway()
    with serve_asgi(app) as url:
        yield url, seen


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "tiny-random"\n[training]\nbatch_size = 8\ngroup_size = 4\n')
    return path


def test_a_job_is_submitted_polled_and_read_over_one_connection(gateway, config):
    url, seen = gateway
    with sdk.Client(url, ADMIN) as client:
        job = sdk.RLJob.from_config(config, client=client, task_app_url="http://127.0.0.1:9", idempotency_key="k1")
        assert job.submit() == "job-0" and job.job_api_key == "job-key"
        statuses = []
        final = job.poll_until_complete(timeout=60, interval=0.01, on_status=lambda s: statuses.append(s["status"]))
        assert final["status"] == "succeeded" and statuses == ["running", "running", "succeeded"]
        assert job.get_results()["final_reward"] == 0.75 and job.metrics(after_step=1) == [{"step": 2}, {"step": 3}]
    [(_, _, _, body)] = [r for r in seen["requests"] if r[:2] == ("POST", "/api/rl/jobs")]
    sent = httpx.Response(200, content=body).json()
    assert sent["job_type"] == "rl" and sent["data"]["endpoint_base_url"] == "http://127.0.0.1:9"
    assert sent["data"]["config"]["training"] == {"batch_size": 8, "group_size": 4}
    assert len(set(seen["ports"])) == 1  # every call on the client's one pooled connection


def test_refusals_are_typed_and_carry_the_servers_message(gateway, config, tmp_path):
    url, _ = gateway
    with sdk.Client(url, ADMIN) as client:
        with pytest.raises(sdk.NotFoundError, match="404: no job job-9"):
            sdk.RLJob.from_job_id("job-9", client=client).get_status()
        bad = tmp_path / "bad.toml"
        bad.write_text("[training]\nbatch_size = 7\n")
        with pytest.raises(sdk.UnprocessableEntityError, match="not a multiple") as refused:
            sdk.RLJob.from_config(bad, client=client).submit()
        assert refused.value.status == 422 and isinstance(refused.value, sdk.RLGateError)
    with pytest.raises(sdk.AuthenticationError, match="invalid API key"):
        sdk.RLJob.from_job_id("job-0", url, "wrong").get_status()
    with sdk.Client(url, ADMIN) as client:
        sdk.RLJob.from_config(config, client=client).submit()  # job-0
        sdk.RLJob.from_config(config, client=client).submit()  # job-1
    with pytest.raises(sdk.PermissionDeniedError, match="another job"):
        sdk.RLJob.from_job_id("job-1", url, "job-key").get_status()
    with pytest.raises(sdk.APIConnectionError) as unreachable:
        sdk.Client("http://127.0.0.1:9", ADMIN, max_retries=0).list_jobs()
    assert unreachable.value.status == 0


def test_429_and_503_are_retried_as_the_server_says_then_raised(gateway):
    url, seen = gateway
    with sdk.Client(url, ADMIN) as client:
        session = sdk.Session.start(task_id="t", client=client)  # two 429s (Retry-After: 0), then a slot
        assert session.api_key == "rlg-session" and seen["busy"] == 3
        with pytest.raises(sdk.InternalServerError, match="503: session service unavailable"):
            client.request("GET", "/down")
        assert sum(r[1] == "/down" for r in seen["requests"]) == 3  # the first try and max_retries = 2
    with pytest.raises(sdk.RateLimitError):
        seen["busy"] = 0
        sdk.Session.start(url, ADMIN, task_id="t", client=sdk.Client(url, ADMIN, max_retries=1))


def test_a_503_is_retried_only_where_making_the_call_twice_does_no_harm(gateway, config):
    url, seen = gateway
    with sdk.Client(url, ADMIN) as client:
        seen["lose_answers"] = 1  # the first submission makes the job and its answer is lost
        job = sdk.RLJob.from_config(config, client=client)
        assert job.submit() == "job-0"  # the retry carried the same generated key: one job
        submits = [r for r in seen["requests"] if r[:2] == ("POST", "/api/rl/jobs")]
        assert len(submits) == 2 and job.get_status()["job_id"] == "job-0"
        with pytest.raises(sdk.NotFoundError):
            sdk.RLJob.from_job_id("job-1", client=client).get_status()
        assert sdk.RLJob.from_config(config, client=client).submit() == "job-1"  # another call: another job

        seen["lose_answers"] = 1  # a POST that is not known to be harmless twice: the 503 is the caller's
        with pytest.raises(sdk.InternalServerError, match="503"):
            client.request("POST", "/jobs/job-0/cancel")
        assert sum(r[1] == "/jobs/job-0/cancel" for r in seen["requests"]) == 1

        seen["lose_answers"] = 1  # the end was done; the retry's 410 says so
        ended = sdk.Session.of_key("rlg-session", client=client).end()
        assert "an earlier attempt most likely did it" in ended["message"]
        with pytest.raises(sdk.GoneError, match="410"):  # a first attempt's 410 is the caller's to know
            sdk.Session.of_key("rlg-session", client=client).end()


def test_a_success_that_is_not_json_is_a_typed_error(gateway):
    url, _ = gateway
    with sdk.Client(url, ADMIN) as client, pytest.raises(sdk.APIStatusError, match="200 but not JSON"):
        client.request("GET", "/docs")  # FastAPI's HTML page


def test_the_wait_before_a_retry_is_the_servers_retry_after_else_a_growing_backoff():
    def answer(retry_after: str | None) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": retry_after} if retry_after else {})

    assert sdk._wait_s(0, answer("7")) == 7.0
    assert sdk._wait_s(0, answer("3600")) == sdk.MAX_RETRY_AFTER_S  # capped
    assert 0.375 <= sdk._wait_s(0, answer(None)) <= 0.625  # 0.5 s +- 25%
    assert 3.0 <= sdk._wait_s(3, None) <= 5.0 and sdk._wait_s(10, None) <= 10.0  # doubling, at most 8 s (+25%)


def test_the_client_defaults_to_the_environment(gateway, monkeypatch):
    url, seen = gateway
    monkeypatch.setenv("RLGATE_URL", url + "/")
    monkeypatch.setenv("RLGATE_ADMIN_KEY", ADMIN)
    with sdk.Client() as client:
        assert client.base_url == url
        session = sdk.Session.start(task_id="t", client=client)
        assert seen["requests"][-1][2] == f"Bearer {ADMIN}"
        session.set_reward(0.0, turn_rewards=[0.5, 1.0])
    method, path, key, body = seen["requests"][-1]
    assert (path, key) == ("/rl/set_reward", "Bearer rlg-session")  # a session's calls carry its own key
    assert httpx.Response(200, content=body).json() == {"reward": 0.0, "turn_rewards": [0.5, 1.0]}
    monkeypatch.delenv("RLGATE_ADMIN_KEY")
    with pytest.raises(sdk.AuthenticationError, match="RLGATE_ADMIN_KEY"):
        sdk.Client().list_jobs()


def test_the_async_client_is_the_same_api_with_await(gateway, config):
    url, seen = gateway

    async def run() -> None:
        async with sdk.AsyncClient(url, ADMIN) as client:
            job = sdk.AsyncRLJob.from_config(config, client=client)
            assert await job.submit() == "job-0"
            final = await job.poll_until_complete(timeout=60, interval=0.01)
            assert final["status"] == "succeeded" and (await job.get_results())["final_reward"] == 0.75
            async with await sdk.AsyncSession.start(task_id="t", client=client) as session:
                await session.set_reward(1.0)
        assert [r[1] for r in seen["requests"][-2:]] == ["/rl/set_reward", "/rl/end_session"]

    asyncio.run(run())
    assert len(set(seen["ports"])) == 1


def test_rlgate_train_runs_here_without_a_gateway_and_submits_with_one(gateway, config, tmp_path):
    """No --backend and no $RLGATE_URL: the run is trained here (a bad config is
    refused before the driver starts); with one, the job is submitted there. Options for the other
    mode are refused, not ignored."""
    import os
    import subprocess
    import sys

    url, seen = gateway
    env = {k: v for k, v in os.environ.items() if k not in ("RLGATE_URL", "RLGATE_ADMIN_KEY", "ENVIRONMENT_API_KEY")}

    def rlgate(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rlgate.cli", "train", "--config", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    broken = tmp_path / "broken.toml"
    broken.write_text("[training]\nbatch_size = 0\n")
    here = rlgate(str(broken))  # refused before Ray or the driver is imported
    assert here.returncode == 2 and "Traceback" not in here.stderr
    assert here.stderr.startswith("rlgate: error: ") and "training.batch_size" in here.stderr
    polled = rlgate(str(config), "--poll")
    assert polled.returncode == 2 and "--backend or RLGATE_URL" in polled.stderr
    submitted = rlgate(str(config), "--backend", url, "--api-key", ADMIN)
    assert submitted.returncode == 0 and "rlgate: job job-0 submitted" in submitted.stdout
    resumed = rlgate(str(config), "--backend", url, "--api-key", ADMIN, "--resume")
    assert resumed.returncode == 2 and "--resume and --run-dir are for training here" in resumed.stderr
    assert "is the gateway running" not in resumed.stderr and "fix the command line" in resumed.stderr
    keyed = rlgate(str(config), "--backend", url, "--api-key", ADMIN, "--task-app-key", "env-secret")
    assert keyed.returncode == 0  # the job's calls to its task app carry the key (kept out of its records)
    sent = httpx.Response(200, content=seen["requests"][-1][3]).json()
    assert sent["task_app_api_key"] == "env-secret"
    missing = rlgate(str(tmp_path / "absent.toml"), "--backend", url, "--api-key", ADMIN)
    assert missing.returncode == 2 and "no such config file" in missing.stderr
    assert "is the gateway running" not in missing.stderr


def test_a_dropped_connection_is_retried_where_the_call_may_be_made_twice():
    """A GET whose connection broke (a keep-alive race, a gateway restart) ended a
    job's polling; a POST that may have been done is not sent again."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        if len(sent) % 2 == 1:
            raise httpx.RemoteProtocolError("the server closed the connection", request=request)
        return httpx.Response(200, json={"job_id": "j", "status": "running"})

    http = httpx.Client(transport=httpx.MockTransport(answer))
    client = sdk.Client("http://gateway", ADMIN, http_client=http)
    assert sdk.RLJob.from_job_id("j", client=client).get_status()["status"] == "running" and sent == ["GET", "GET"]
    with pytest.raises(sdk.APIConnectionError, match="RemoteProtocolError"):
        sdk.RLJob.from_job_id("j", client=client).cancel()
    assert sent == ["GET", "GET", "POST"]
    with pytest.raises(sdk.RLGateError, match="not a URL this client can call"):
        sdk.Client("http://localhost:8000x", ADMIN).list_jobs()


def test_a_410_after_a_retry_counts_as_done_only_if_an_earlier_attempt_may_have_done_it():
    """After a 429 (nothing done) a 410 means the session had already gone (ended
    idle, or by someone else): that is the caller's to know, not "done"."""
    answers = [
        httpx.Response(429, headers={"Retry-After": "0"}),
        httpx.Response(410, json={"error": {"message": "ended"}}),
    ]
    http = httpx.Client(transport=httpx.MockTransport(lambda request: answers.pop(0)))
    with pytest.raises(sdk.GoneError):
        sdk.Session.of_key("rlg-session", client=sdk.Client("http://gateway", ADMIN, http_client=http)).end()
