"""Who may call what: every route against every kind of credential, over real
HTTP, and the keys themselves, those the test holds and every key rlgate made,
never showing up where they should not: Ray's logs, the metrics endpoint,
exported trajectories, a job's folder, answers to other callers."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx

from tests.support import free_port, gateway_fixture, generated_keys

SETTINGS = {
    "model": {"name": "tiny-random"},
    "rollout": {"engine": "hf", "max_model_len": 512},
    "gateway": {"max_concurrent": 32},
    "jobs": {"task_app_hosts": ["127.0.0.1"]},  # the failing job's task app is on loopback
}
CREDENTIALS = ("none", "malformed", "wrong", "admin", "own", "other", "ended", "job")


sec = gateway_fixture("gw-sec", SETTINGS)


def unreachable_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a loopback port nothing listens on


def failed_job(sec) -> tuple[str, str]:
    """A real RL job (its task app is down, so it fails at once): its id and key."""
    body = {"config": {"model": {"name": "tiny-random"}, "training": {"total_steps": 1}}}
    created = httpx.post(
        f"{sec.url}/api/rl/jobs", json=body | {"task_app_url": unreachable_url()}, headers=sec.admin, timeout=60
    )
    assert created.status_code == 200, created.text
    job_id, key = created.json()["job_id"], created.json()["api_key"]
    deadline = time.monotonic() + 300
    while httpx.get(f"{sec.url}/api/rl/jobs/{job_id}", headers=sec.admin).json()["status"] != "failed":
        assert time.monotonic() < deadline, "the job did not fail"
        time.sleep(1)
    return job_id, key


def job_folder(sec, job_id: str) -> Path:
    """Where the JobManager keeps the job (its records, config and run folder)."""
    import ray

    manager = ray.get_actor("rlgate-gw-sec-jobs", namespace="rlgate")
    return Path(ray.get(manager.__ray_call__.remote(lambda self: str(self.book.folder(job_id)))))


# Expected status per credential; "*" for the rest. "own" is the session the
# route acts on (A); "other" is another live session's key (B).
SESSION_ROUTE = {"own": 200, "other": 200, "admin": 400, "ended": 410, "*": 401}
ADMIN_ROUTE = {"admin": 200, "*": 401}
JOB_ROUTE = {"admin": 200, "job": 200, "*": 401}


def routes(job_id: str, interaction: str) -> list[tuple[str, str, dict | None, dict]]:
    chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    text = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}
    message = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = {"model": "tiny-random", "input": "hi", "max_output_tokens": 2}
    too_big = {"config": {"model": {"name": "tiny-random"}, "rollout": {"num_gpus": 64}}}
    # a cloud's metadata endpoint as the task app: not allowed ([jobs] task_app_hosts), so never called
    metadata = {"config": {"model": {"name": "tiny-random"}}, "task_app_url": "http://169.254.169.254/latest"}
    return [
        ("GET", "/health", None, {"*": 200}),
        ("GET", "/openapi.json", None, ADMIN_ROUTE),
        ("GET", "/docs", None, {"*": 404}),
        ("GET", "/redoc", None, {"*": 404}),
        # the served model names are told to a live session only
        ("POST", "/v1/chat/completions", chat | {"model": "no-such-model"}, SESSION_ROUTE | {"own": 404, "other": 404}),
        ("POST", "/v1/completions", text | {"model": "no-such-model"}, SESSION_ROUTE | {"own": 404, "other": 404}),
        ("GET", "/rl/status", None, ADMIN_ROUTE),
        ("GET", "/rl/trajectories", None, ADMIN_ROUTE),
        ("POST", "/rl/start_session", {"task_id": "matrix", "train": False}, ADMIN_ROUTE),
        ("GET", "/v1/models", None, SESSION_ROUTE | {"admin": 200}),
        ("GET", "/models", None, SESSION_ROUTE | {"admin": 200}),
        ("POST", "/v1/chat/completions", chat, SESSION_ROUTE),
        ("POST", "/chat/completions", chat, SESSION_ROUTE),
        ("POST", "/v1/completions", text, SESSION_ROUTE),
        ("POST", "/completions", text, SESSION_ROUTE),
        ("POST", "/v1/messages", message, SESSION_ROUTE),  # Anthropic Messages: a bearer key,
        ("POST", "x-api-key /v1/messages", message, SESSION_ROUTE),  # or Anthropic's own header
        ("POST", "/v1/responses", response, SESSION_ROUTE),
        ("POST", "/responses", response, SESSION_ROUTE),
        # another session's key names its own session, never A's interactions
        ("POST", "/rl/set_reward", {"reward": 0.5, "interaction_id": interaction}, SESSION_ROUTE | {"other": 404}),
        # the scoped URL: the key is the path (the header is ignored); no key is no route
        ("GET", "/s/{key}/v1/models", None, SESSION_ROUTE | {"none": 404}),
        ("GET", "/s/{key}/models", None, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/v1/chat/completions", chat, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/chat/completions", chat, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/v1/completions", text, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/completions", text, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/v1/messages", message, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/v1/responses", response, SESSION_ROUTE | {"none": 404}),
        ("POST", "/s/{key}/responses", response, SESSION_ROUTE | {"none": 404}),
        ("GET", "/api/rl/jobs", None, ADMIN_ROUTE),
        ("POST", "/api/rl/jobs", too_big, {"admin": 422, "*": 401}),  # authorised, then refused: no GPUs
        ("POST", "/api/rl/jobs", metadata, {"admin": 422, "*": 401}),  # authorised, then refused: the host
        ("GET", f"/api/rl/jobs/{job_id}", None, JOB_ROUTE),
        ("GET", f"/api/rl/jobs/{job_id}/events", None, JOB_ROUTE),
        ("GET", f"/api/rl/jobs/{job_id}/metrics", None, JOB_ROUTE),
        ("POST", f"/api/rl/jobs/{job_id}/cancel", None, {"admin": 409, "job": 409, "*": 401}),  # it has failed
        ("GET", "/api/rl/jobs/job-000000000000", None, {"admin": 404, "job": 404, "*": 401}),  # no such job
    ]


def test_every_route_answers_every_credential_as_intended_and_no_key_leaks(sec, ray_session):
    a, b, ended = sec.start_session("a"), sec.start_session("b"), sec.start_session("ended")
    assert httpx.post(f"{sec.url}/rl/end_session", headers={"Authorization": f"Bearer {ended['api_key']}"}).is_success
    first = httpx.post(
        f"{sec.url}/v1/chat/completions",
        json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {a['api_key']}"},
    )
    assert first.status_code == 200, first.text
    job_id, job_key = failed_job(sec)
    keys = {
        "none": None,
        "malformed": "Basic Zm9vOmJhcg==",
        "wrong": "rlg-" + secrets.token_urlsafe(32),
        "admin": sec.admin_key,
        "own": a["api_key"],
        "other": b["api_key"],
        "ended": ended["api_key"],
        "job": job_key,
    }
    answers: list[str] = []
    wrong: list[str] = []
    for method, path, body, expected in routes(job_id, first.json()["id"]):
        for credential in CREDENTIALS:
            key = keys[credential]
            if "{key}" in path:  # the credential is the path; a header with another key changes nothing
                url = sec.url + path.replace("{key}", "" if key is None else key.replace(" ", "%20"))
                headers = {"Authorization": f"Bearer {keys['wrong']}"}
            elif path.startswith("x-api-key "):  # the key alone, in Anthropic's header
                url = sec.url + path.split()[1]
                headers = {} if key is None else {"x-api-key": key}
            else:
                url = sec.url + path
                headers = {} if key is None else {"Authorization": key if " " in key else f"Bearer {key}"}
            response = httpx.request(method, url, json=body, headers=headers, timeout=60)
            want = expected.get(credential, expected["*"])
            if response.status_code != want:
                wrong.append(f"{method} {path} with {credential}: {response.status_code}, wanted {want}")
            if response.status_code >= 400 and not response.json().get("error", {}).get("message"):
                wrong.append(f"{method} {path} with {credential}: no error message in {response.text[:200]}")
            if path == "/rl/start_session" and response.status_code == 200:
                ended_key = response.json()["api_key"]
                httpx.post(f"{sec.url}/rl/end_session", headers={"Authorization": f"Bearer {ended_key}"})
            else:
                answers.append(response.text)
    assert not wrong, "\n".join(wrong)

    # ending: a session's own key ends it (and only it); every other credential is refused
    for credential in ("none", "malformed", "wrong", "admin", "ended", "job"):
        key = keys[credential]
        headers = {} if key is None else {"Authorization": key if " " in key else f"Bearer {key}"}
        response = httpx.post(f"{sec.url}/rl/end_session", headers=headers)
        assert response.status_code == {"admin": 400, "ended": 410}.get(credential, 401), (credential, response.text)
        answers.append(response.text)
    assert httpx.post(f"{sec.url}/rl/end_session", headers={"Authorization": f"Bearer {b['api_key']}"}).is_success
    status = httpx.get(f"{sec.url}/rl/status", headers=sec.admin).json()
    assert status["sessions"]["open_sessions"] == 1  # A alone: B's key ended B
    assert httpx.post(f"{sec.url}/rl/end_session", headers={"Authorization": f"Bearer {a['api_key']}"}).is_success

    # The keys this test holds, and every key rlgate made (found by its shape: session keys, job keys,
    # the failed job's gateway admin key, which no test ever sees), in no answer to anyone
    # (start_session's own answer aside), exported trajectory, job file, Ray log or metric.
    secrets_used = [sec.admin_key, a["api_key"], b["api_key"], ended["api_key"], job_key]
    assert not [k for k in secrets_used for text in answers if k in text]
    assert not [text for text in answers if generated_keys(text)]
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path())  # every process's log
    time.sleep(3)  # log lines reach their files asynchronously
    for folder in (sec.run_dir.parent, job_folder(sec, job_id), logs):
        for path in folder.rglob("*"):
            if path.is_file() and path.stat().st_size < 200 * 2**20:
                data = path.read_bytes()
                assert not [k for k in secrets_used if k.encode() in data], f"a key is in {path}"
                assert not generated_keys(data), f"a key rlgate made is in {path}"
    assert not [p.name for p in job_folder(sec, job_id).iterdir() if p.name in ("admin_key", "task_app_key")]
    port = next(node["MetricsExportPort"] for node in ray_session.nodes() if node["Alive"])
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    assert not [k for k in secrets_used if k in metrics] and not generated_keys(metrics)
