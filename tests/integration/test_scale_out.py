"""Two colocated gateway replicas, each with its own engine (real Serve app on
loopback, Serve's proxy with rlgate's routing hook, the official openai client,
tiny-random on the HF engine): new sessions spread over both, every turn of a
session reaches its owner's engine, admission stays exact across them, a
refresh finds the key's owner, and a SIGKILLed replica's sessions go on on its
successor."""

from __future__ import annotations

import os
import secrets
import signal

import httpx
import openai

from rlgate.serving.auth import key_slot
from rlgate.training.driver import serving_run
from tests.support import free_port, gateway_fixture, key_of, prompt_len, until_served

NAME = "gw-scale"
SETTINGS = {
    "model": {"name": "tiny-random"},
    "rollout": {"engine": "hf", "replicas": 2, "max_model_len": 512, "request_log_size": 32},
    "gateway": {"colocate": True, "max_concurrent": 4, "direct_port": free_port(2)},
}

two = gateway_fixture(NAME, SETTINGS)


def turn(app, key: str, messages: list[dict]) -> str:
    with openai.OpenAI(base_url=f"{app.url}/s/{key}/v1", api_key="unused", max_retries=0, timeout=180) as client:
        answer = client.chat.completions.create(
            model="tiny-random", messages=messages, max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True}
        )
    return answer.choices[0].message.content


def replica(app, slot: int):
    """The Gateway replica of ``slot``, through the deployment's own router."""
    return app.rollout.options(session_id=str(slot))


def test_sessions_spread_stay_on_their_engine_and_survive_a_killed_replica(two):
    app = two
    started = [app.start_session(f"s{i}") for i in range(4)]
    slots = [key_slot(s["api_key"]) for s in started]
    assert sorted(slots) == [0, 0, 1, 1], slots  # placed on the replica holding fewer
    # admission is one bound over both replicas
    refused = httpx.post(f"{app.url}/rl/start_session", json={"task_id": "over"}, headers=app.admin)
    assert refused.status_code == 429, refused.text

    conversations = {}
    for i, session in enumerate(started):
        messages = [{"role": "user", "content": f"session {i} says hello"}]
        messages += [{"role": "assistant", "content": turn(app, session["api_key"], messages)}]
        messages += [{"role": "user", "content": "and again"}]
        messages += [{"role": "assistant", "content": turn(app, session["api_key"], messages)}]
        conversations[session["api_key"]] = messages
    seen = {slot: replica(app, slot).recent_requests.remote(32).result() for slot in (0, 1)}
    assert len(seen[0]) + len(seen[1]) == 8
    status = {slot: replica(app, slot).replica_status.remote().result() for slot in (0, 1)}
    assert {slot: s["slot"] for slot, s in status.items()} == {0: 0, 1: 1}
    assert {s["run"] for s in status.values()} == {NAME} and serving_run(NAME) == NAME  # what a driver asks
    assert status[0]["open_sessions"] + status[1]["open_sessions"] == 4
    summed = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()["sessions"]
    assert (summed["open_sessions"], summed["replicas_answered"], summed["started"]) == (4, 2, 4)

    # each replica also listens on its own port: direct_port + slot, and serves only its own sessions there
    direct = [f"http://127.0.0.1:{app.config.gateway.direct_port + slot}" for slot in (0, 1)]
    on_one = next(s for s in started if key_slot(s["api_key"]) == 1)
    assert httpx.get(f"{direct[1]}/s/{on_one['api_key']}/v1/models").status_code == 200
    served = {slot: replica(app, slot).recent_requests.remote(32).result() for slot in (0, 1)}
    refused = httpx.get(f"{direct[0]}/s/{on_one['api_key']}/v1/models")
    assert refused.status_code == 421 and "replica 1" in refused.json()["error"]["message"]
    chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    misrouted = httpx.post(f"{direct[0]}/s/{on_one['api_key']}/v1/chat/completions", json=chat, timeout=60)
    assert misrouted.status_code == 421  # and its session is untouched: nothing generated, nothing ended
    assert {slot: replica(app, slot).recent_requests.remote(32).result() for slot in (0, 1)} == served
    assert replica(app, 1).replica_status.remote().result()["open_sessions"] == status[1]["open_sessions"]
    # a made-up key with replica 1's slot reaches replica 1 (through Serve's proxy too) and is refused there
    # and one naming no replica there is (slot 9 of 2) reaches some replica, which refuses it alike
    for forged in (f"rlg1-{secrets.token_urlsafe(32)}", f"rlg9-{secrets.token_urlsafe(32)}"):
        for base in (direct[1], app.url):
            answer = httpx.get(f"{base}/s/{forged}/v1/models", timeout=60)
            assert answer.status_code == 401 and answer.json()["error"]["message"], answer.text

    # a refresh through any replica reaches the key's owner: the old session ends, one opens under the key
    refreshed = next(s for s in started if key_slot(s["api_key"]) == 1)
    again = app.start_session("s-refreshed", api_key=refreshed["api_key"])
    assert again["api_key"] == refreshed["api_key"] and again["session_id"] != refreshed["session_id"]
    conversations[refreshed["api_key"]] = [{"role": "user", "content": "a fresh start"}]
    turn(app, refreshed["api_key"], conversations[refreshed["api_key"]])

    os.kill(status[1]["pid"], signal.SIGKILL)
    # slot 0 serves on meanwhile; slot 1's requests wait in the proxy for its successor
    for session in started:
        if key_slot(session["api_key"]) == 0:
            turn(app, session["api_key"], [*conversations[session["api_key"]], {"role": "user", "content": "on"}])
    going = next(s for s in started if key_slot(s["api_key"]) == 1 and s is not refreshed)
    body = {"model": "tiny-random", "messages": [*conversations[going["api_key"]], {"role": "user", "content": "on"}]}
    body["max_tokens"] = 3
    after = until_served(
        lambda: httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=key_of(going["api_key"]), timeout=180)
    )
    assert after.status_code == 200, after.text
    assert replica(app, 1).replica_status.remote().result()["pid"] != status[1]["pid"]

    for session in started:
        headers = key_of(session["api_key"])
        assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 1.0}, headers=headers).is_success
        assert httpx.post(f"{app.url}/rl/end_session", headers=headers).status_code == 200
    records = app.trajectories()
    by_task = {}
    for record in records:
        by_task.setdefault(record["task_id"], []).append(record)
    # each session exported once with all its turns: two before the crash, one after for those that went on
    expected = {f"s{i}": 2 if s is refreshed else 3 for i, s in enumerate(started)}
    assert {task: len(turns) for task, turns in by_task.items()} == {**expected, "s-refreshed": 1}
    # every turn of a session reached its owner's engine, none the other's
    for i, session in enumerate(started):
        owner = key_slot(session["api_key"])
        prompts = [r["input_ids"][: prompt_len(r)] for r in by_task[f"s{i}"][:2]]
        assert all(p in [e["prompt_ids"] for e in seen[owner]] for p in prompts)
        assert not any(p in [e["prompt_ids"] for e in seen[1 - owner]] for p in prompts)
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["capacity"]["running"] == 0
