"""The task-app contract: rlgate.taskapp's app helper and the client the trainer
uses, over real HTTP on loopback. The policy here is a small fake OpenAI server
(the gateway itself is exercised in test_gateway.py and test_training.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from rlgate.taskapp import (
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
from tests.conftest import serve_asgi


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
        with pytest.raises(TaskAppError, match="POST /rollout: 500 .*simulator crashed"):
            asyncio.run(TaskAppClient(url).rollout(request("http://127.0.0.1:9/v1")))


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
