"""Processes killed with SIGKILL under a live gateway (real HTTP, the official
openai client, tiny-random on the HF engine): the SessionStore and the
TrajectoryStore come back from disk; nothing acknowledged is lost or saved twice."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import start_gateway

SETTINGS = {"model": {"name": "tiny-random"}, "rollout": {"engine": "hf", "max_model_len": 512}}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def faults(ray_session, tmp_path_factory):
    from ray import serve

    app = start_gateway(ray_session, tmp_path_factory, "gw-faults", SETTINGS)
    yield app
    serve.delete("gw-faults")


def kill_actor(ray_session, name: str) -> int:
    """SIGKILL the process of the run's named actor; returns its pid."""
    actor = ray_session.get_actor(f"rlgate-gw-faults-{name}", namespace="rlgate")
    pid = ray_session.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    return pid


def session(app, key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def retrying(call, seconds: float = 120):
    """Call until it stops answering 503 (the actor behind it is being restarted)."""
    deadline = time.monotonic() + seconds
    while True:
        response = call()
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        assert "unavailable" in response.json()["error"]["message"] or "could not save" in response.text
        time.sleep(0.5)


def test_a_killed_session_store_resumes_every_open_session_from_its_journal(faults, ray_session):
    app = faults
    done, open_a, open_b = app.start_session("done"), app.start_session("a"), app.start_session("b")
    messages = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key=open_a["api_key"], max_retries=0) as client:
        first = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)
    assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 0.25}, headers=session(app, open_a["api_key"]))
    for key in (done["api_key"], open_b["api_key"]):
        with openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0) as client:
            client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, done["api_key"])).status_code == 200

    kill_actor(ray_session, "sessions")

    # A goes on where it was: the continuation of its first turn, a reward, the end
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 4}
    second = retrying(
        lambda: httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=session(app, open_a["api_key"]))
    )
    assert second.status_code == 200, second.text
    assert httpx.post(
        f"{app.url}/rl/set_reward", json={"reward": 1.0}, headers=session(app, open_a["api_key"])
    ).is_success
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["sessions"]["open_sessions"] == 2 and status["capacity"]["running"] == 2  # A and B hold their slots
    # the ended session stays ended
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, done["api_key"])).status_code == 410
    for key in (open_a["api_key"], open_b["api_key"]):
        assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)).status_code == 200

    records = app.trajectories()
    by_session = {}
    for record in records:
        by_session.setdefault(record["task_id"], []).append(record)
    assert sorted(by_session) == ["a", "b", "done"] and len(by_session["done"]) == 1 and len(by_session["b"]) == 1
    first_turn, second_turn = by_session["a"]  # a record per turn ("individual" export)
    # the second turn continued the first verbatim, across the crash
    assert second_turn["input_ids"][: len(first_turn["input_ids"])] == first_turn["input_ids"]
    # the reward set before the crash and the one after both count: 0.25 + 1.0 flows back to the first turn
    assert (first_turn["reward"], second_turn["reward"]) == (1.25, 1.0)
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["capacity"]["running"] == 0 and status["sessions"]["open_sessions"] == 0


def test_a_killed_trajectory_store_loses_nothing_and_saves_nothing_twice(faults, ray_session):
    app = faults
    before = len(app.trajectories())
    keys = [app.start_session(f"t{i}")["api_key"] for i in range(3)]
    for key in keys:
        with openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0) as client:
            client.chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, keys[0])).status_code == 200

    kill_actor(ray_session, "trajectories")

    # an end while it is down answers 503 and keeps the session open; retried, it is saved once
    for key in keys[1:]:
        ended = retrying(lambda key=key: httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)))
        assert ended.status_code == 200, ended.text
    records = app.trajectories()[before:]
    assert sorted(r["task_id"] for r in records) == ["t0", "t1", "t2"]
    assert [r["seq"] for r in records] == list(range(before + 1, before + 4))
