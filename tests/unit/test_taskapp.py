"""The task-app contract: rlgate.sdk.taskapp's app helper and the client the trainer
uses, over real HTTP on loopback. The policy here is a small fake OpenAI server
(the gateway itself is exercised in test_gateway.py and test_training.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from rlgate.sdk.taskapp import (
    EnvSpec,
    Episode,
    Outcome,
    PolicySpec,
    RolloutRequest,
    RolloutResponse,
    TaskAppClient,
    TaskAppError,
    create_task_app,
)
from tests.support import serve_asgi


def fake_policy(reply: str) -> FastAPI:
    """An OpenAI-compatible endpoint that always answers ``reply`` and records requests."""
    app = FastAPI()
    app.state.seen = []

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        app.state.seen.append(body)
        message = {"role": "assistant", "content": reply}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice]}

    return app


async def add(episode: Episode) -> Outcome:
    a, b = episode.seed, 2
    reply = await episode.chat([{"role": "user", "content": f"{a} + {b}?"}])
    return Outcome(float(reply.strip() == str(a + b)), event_rewards=[0.5], steps=1, details={"reply": reply})


def request(inference_url: str | None, seed: int = 2) -> RolloutRequest:
    config = {"model": "policy", "temperature": 0.5} | ({"inference_url": inference_url} if inference_url else {})
    return RolloutRequest(run_id="r1", env=EnvSpec(env_name="add", seed=seed), policy=PolicySpec(config=config))


def test_rollout_calls_the_policy_and_reports_the_outcome():
    policy = fake_policy("4")
    with serve_asgi(policy) as policy_url, serve_asgi(create_task_app("add", add, api_key="env-key")) as url:
        client = TaskAppClient(url, api_key="env-key")
        info = asyncio.run(client.check())
        assert info.task["name"] == "add" and info.environments == ["add"]
        right = asyncio.run(client.rollout(request(f"{policy_url}/v1", seed=2)))
        wrong = asyncio.run(TaskAppClient(url, api_key="env-key").rollout(request(f"{policy_url}/v1", seed=3)))
    assert (right.metrics.reward(), wrong.metrics.reward()) == (1.0, 0.0)
    assert right.run_id == "r1" and right.metrics.event_rewards == [0.5] and right.metrics.details == {"reply": "4"}
    # the policy was called with the model and sampling settings of policy.config
    assert [(s["model"], s["temperature"]) for s in policy.state.seen] == [("policy", 0.5), ("policy", 0.5)]


def test_checks_name_what_failed():
    with serve_asgi(create_task_app("add", add, api_key="env-key")) as url:
        with pytest.raises(TaskAppError, match=r"GET .*/health: 401 unauthorised; set ENVIRONMENT_API_KEY"):
            asyncio.run(TaskAppClient(url, api_key="wrong").check())
        with pytest.raises(TaskAppError, match="401"):
            asyncio.run(TaskAppClient(url).check())
        assert httpx.get(f"{url}/task_info").status_code == 401
        # a request without an inference URL is the caller's mistake: 422 that says so
        answer = httpx.post(f"{url}/rollout", json=request(None).model_dump(), headers={"X-API-Key": "env-key"})
        assert answer.status_code == 422 and "inference_url" in answer.text
    with pytest.raises(TaskAppError, match="unreachable"):
        asyncio.run(TaskAppClient(url).check())  # the app is gone now


def test_a_failing_environment_is_a_rollout_error_not_a_crash():
    async def broken(episode: Episode) -> float:
        raise RuntimeError("simulator crashed")

    with serve_asgi(create_task_app("broken", broken, api_key="")) as url:
        with pytest.raises(TaskAppError, match=r"POST /rollout: 500 Internal Server Error \(application/json") as err:
            asyncio.run(TaskAppClient(url).rollout(request("http://127.0.0.1:9/v1")))
    assert "simulator crashed" not in str(err.value)  # the app logs its own error; the trainer says 500


SECRET = "AKIA-SECRET-INTERNAL-BODY"


def internal_service() -> FastAPI:
    """Something a task-app URL should not reach: every answer carries a secret."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return PlainTextResponse(f"metadata: {SECRET}", status_code=500)

    @app.get("/shape/health")
    async def healthy():
        return {"healthy": True}

    @app.get("/shape/task_info")
    async def task_info():
        return {"task": f"not a table: {SECRET}"}

    @app.get("/redirect/health")
    async def redirect():
        return PlainTextResponse(SECRET, status_code=302, headers={"Location": f"http://{SECRET}/"})

    @app.post("/rollout")
    async def rollout():
        return {"run_id": "x", "metrics": {"outcome_reward": SECRET}}

    @app.post("/fail/rollout")
    async def fail():
        return PlainTextResponse(SECRET * 10, status_code=503)

    return app


def test_errors_never_repeat_what_the_task_app_answered():
    """A job's error is readable with the job's key: a task-app URL pointing at an
    internal service must not turn its answers into readable text. Errors give the
    status, reason phrase, content type and length; never the body, nor the
    values pydantic quotes when a shape is wrong."""
    with serve_asgi(internal_service()) as url:
        client = TaskAppClient(url)
        failures = []
        for call in (
            client.check,
            lambda: TaskAppClient(f"{url}/redirect").check(),
            lambda: client.rollout(request("http://127.0.0.1:9/v1")),
            lambda: TaskAppClient(f"{url}/fail").rollout(request("http://127.0.0.1:9/v1")),
            lambda: TaskAppClient(f"{url}/shape").check(),
        ):
            with pytest.raises(TaskAppError) as failed:
                asyncio.run(call())
            failures.append(str(failed.value))
    assert not [f for f in failures if SECRET in f], failures
    assert failures[0].endswith("/health: 500 Internal Server Error (text/plain, 35 bytes)"), failures[0]
    redirect = "/redirect/health: 302 Found (text/plain, 25 bytes); redirects are not followed: give the final URL"
    assert failures[1].endswith(redirect), failures[1]
    assert failures[2].startswith("POST /rollout: not a RolloutResponse: metrics.outcome_reward: "), failures[2]
    assert failures[3] == "POST /rollout: 503 Service Unavailable (text/plain, 250 bytes)"
    assert "/task_info: not a TaskInfo: task: " in failures[4]


def test_a_client_with_an_allowlist_refuses_what_it_does_not_admit():
    from rlgate.jobs.egress import Allowlist

    with serve_asgi(create_task_app("add", add, api_key="")) as url:
        with pytest.raises(TaskAppError, match=r"GET .*/health: task app host '127.0.0.1' resolves to 127.0.0.1"):
            asyncio.run(TaskAppClient(url, allowed=Allowlist.parse([])).check())
        with pytest.raises(TaskAppError, match=r"POST /rollout: task app host '127.0.0.1' resolves to 127.0.0.1"):
            asyncio.run(TaskAppClient(url, allowed=Allowlist.parse([])).rollout(request("http://127.0.0.1:9/v1")))
        assert asyncio.run(TaskAppClient(url, allowed=Allowlist.parse(["127.0.0.1"])).check()).task["name"] == "add"


def test_responses_of_other_task_apps_parse():
    """Task apps written for synth-ai: older field names, extra fields kept."""
    older = {
        "run_id": "x",
        "trajectories": [{"env_id": "e", "policy_id": "p", "steps": [], "length": 0}],
        "metrics": {"episode_returns": [0.25], "mean_return": 0.25, "num_steps": 3, "outcome_score": 0.75},
        "trace": {"anything": 1},
    }
    response = RolloutResponse.model_validate(older)
    assert response.metrics.reward() == 0.75 and response.model_extra == {"trace": {"anything": 1}}
    only_returns = RolloutResponse.model_validate({"run_id": "x", "metrics": {"mean_return": 0.5}})
    assert only_returns.metrics.reward() == 0.5
    assert RolloutResponse.model_validate({"run_id": "x", "metrics": {}}).metrics.reward() is None


def test_a_key_given_in_a_file_is_required_and_an_empty_file_refused(tmp_path, monkeypatch):
    """The key may come in a file (``$ENVIRONMENT_API_KEY_FILE``, as SECURITY.md
    advises): the app must then require it, as the trainer sends it; an empty
    file would leave the app open, so it is an error, not a silent default."""
    (tmp_path / "key").write_text("file-key\n")
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    monkeypatch.setenv("ENVIRONMENT_API_KEY_FILE", str(tmp_path / "key"))
    with serve_asgi(create_task_app("add", add)) as url:
        assert httpx.get(f"{url}/health").status_code == 401
        assert httpx.get(f"{url}/health", headers={"X-API-Key": "file-key"}).status_code == 200
    (tmp_path / "key").write_text("\n")
    with pytest.raises(ValueError, match="key file .* is empty"):
        create_task_app("add", add)


def test_a_key_synth_ais_task_apps_refuse_with_400_gets_the_key_hint(monkeypatch, tmp_path):
    """synth-ai 0.4.4's task apps refuse a wrong key with 400 ("unauthorised") and
    answer 503 when they have no key of their own; the hint said nothing of keys."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({"detail": {"error": {"code": "unauthorised", "message": "API key missing"}}}, 400)

    with serve_asgi(app) as url:
        with pytest.raises(TaskAppError, match=r"/health: 400 unauthorised; set ENVIRONMENT_API_KEY"):
            asyncio.run(TaskAppClient(url, api_key="wrong").check())
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    monkeypatch.setenv("ENVIRONMENT_API_KEY_FILE", str(tmp_path / "absent"))
    from rlgate.sdk.taskapp import KeyFileError, environment_key

    with pytest.raises(KeyFileError, match="ENVIRONMENT_API_KEY_FILE names .*absent, which cannot be read"):
        environment_key()


def test_an_episode_asks_for_the_sampling_its_policy_config_names():
    """synth-ai's stop_sequences and top_k were mapped into policy.config, then dropped."""
    from rlgate.sdk.taskapp import sampling

    config = {"temperature": 0.2, "stop_sequences": ["</answer>"], "top_k": 20, "policy_name": "x"}
    assert sampling(config) == {"temperature": 0.2, "stop": ["</answer>"], "extra_body": {"top_k": 20}}
