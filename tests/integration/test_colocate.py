"""``[gateway] colocate``: each Gateway replica runs its own engine and owns its
sessions (real Serve app on loopback, the official openai client, tiny-random
on the HF engine). A turn is served and recorded in the replica, also on its
own listener (``[gateway] direct_port``, no proxy hop), published weights
reach its engine, and a SIGKILLed replica's successor takes its open sessions
back from the journal."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from rlgate.rollout.parity import _reference_logprobs
from tests.support import (
    free_port,
    gateway_fixture,
    key_of,
    prompt_len,
    publish_perturbed,
    replica_process,
    until_served,
)

NAME = "gw-colo"
SETTINGS = {
    "model": {"name": "tiny-random"},
    "rollout": {"engine": "hf", "max_model_len": 512, "request_log_size": 8},
    "gateway": {"colocate": True, "direct_port": free_port()},
}

colo = gateway_fixture(NAME, SETTINGS)


def chat(app, key: str, messages: list[dict], temperature: float = 0.0):
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0) as client:
        return client.chat.completions.create(
            model="tiny-random",
            messages=messages,
            max_tokens=4,
            temperature=temperature,
            extra_body={"ignore_eos": True},
        )


def test_a_colocated_replica_serves_records_and_exports_on_its_own_port(colo, ray_session):
    from ray import serve

    direct = f"http://127.0.0.1:{colo.config.gateway.direct_port}"
    app = dataclasses.replace(colo, url=direct)  # every call below skips Serve's proxy
    started = app.start_session("one")
    assert started["inference_url"] == f"{direct}/s/{started['api_key']}/v1"
    messages = [{"role": "user", "content": "hi"}]
    first = chat(app, started["api_key"], messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    with openai.OpenAI(base_url=started["inference_url"], api_key="unused", max_retries=0) as client:  # scoped URL
        client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)
    assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 1.0}, headers=key_of(started["api_key"])).is_success
    assert httpx.post(f"{app.url}/rl/end_session", headers=key_of(started["api_key"])).status_code == 200

    first_turn, second_turn = app.trajectories()
    assert (first_turn["task_id"], second_turn["reward"]) == ("one", 1.0)
    assert second_turn["input_ids"][: len(first_turn["input_ids"])] == first_turn["input_ids"]
    # what the replica's own engine saw is what was recorded
    seen = app.rollout.recent_requests.remote(2).result()
    assert [r["prompt_ids"] for r in seen] == [t["input_ids"][: prompt_len(t)] for t in (first_turn, second_turn)]
    # one deployment, no SessionStore: the turn stayed in the replica
    assert set(serve.status().applications[NAME].deployments) == {"Gateway"}
    with pytest.raises(ValueError):
        ray_session.get_actor(f"rlgate-{NAME}-sessions", namespace="rlgate")
    # the direct port logs no raw path: the scoped URL's key is in no log of any process
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path())
    time.sleep(3)  # log lines reach their files asynchronously
    leaks = [p for p in logs.rglob("*") if p.is_file() and started["api_key"].encode() in p.read_bytes()]
    assert not leaks, f"the session key is in {leaks}"


def test_published_weights_reach_the_colocated_engine(colo, ray_session, reference_model, tiny_tokenizer):
    app = colo
    store = ray_session.get_actor(f"rlgate-{NAME}-policy", namespace="rlgate")
    stepped = publish_perturbed(ray_session, store, reference_model, version=1, replicas=1)

    started = app.start_session("weights")
    chat(app, started["api_key"], [{"role": "user", "content": "hello"}], temperature=1.0)
    assert httpx.post(f"{app.url}/rl/end_session", headers=key_of(started["api_key"])).status_code == 200
    [record] = [r for r in app.trajectories() if r["task_id"] == "weights"]
    start = prompt_len(record)
    prompt, completion = record["input_ids"][:start], record["input_ids"][start:]
    assert set(record["versions"][start:]) == {1}
    assert record["logprobs"][start:] == pytest.approx(_reference_logprobs(stepped, prompt, completion), abs=1e-4)


def test_a_killed_colocated_replica_hands_its_sessions_to_its_successor(colo, ray_session, reference_model):
    app = colo
    store = ray_session.get_actor(f"rlgate-{NAME}-policy", namespace="rlgate")
    current = ray_session.get(store.status.remote())["version"] + 1
    publish_perturbed(ray_session, store, reference_model, version=current, replicas=1)
    before = len(app.trajectories())
    done, going = app.start_session("done"), app.start_session("going")
    messages = [{"role": "user", "content": "hi"}]
    first = chat(app, going["api_key"], messages)
    assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 0.25}, headers=key_of(going["api_key"])).is_success
    chat(app, done["api_key"], messages)
    assert httpx.post(f"{app.url}/rl/end_session", headers=key_of(done["api_key"])).status_code == 200

    os.kill(replica_process(NAME, "Gateway").pid, signal.SIGKILL)

    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 4}
    second = until_served(
        lambda: httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=key_of(going["api_key"]), timeout=60)
    )
    assert second.status_code == 200, second.text
    assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 1.0}, headers=key_of(going["api_key"])).is_success
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["sessions"]["open_sessions"] == 1 and status["capacity"]["running"] == 1
    assert httpx.post(f"{app.url}/rl/end_session", headers=key_of(done["api_key"])).status_code == 410
    assert httpx.post(f"{app.url}/rl/end_session", headers=key_of(going["api_key"])).status_code == 200

    records = app.trajectories()[before:]
    assert sorted(r["task_id"] for r in records) == ["done", "going", "going"]
    first_turn, second_turn = [r for r in records if r["task_id"] == "going"]
    assert second_turn["input_ids"][: len(first_turn["input_ids"])] == first_turn["input_ids"]
    assert (first_turn["reward"], second_turn["reward"]) == (1.25, 1.0)  # rewards on both sides of the crash
    # the successor caught up to the policy published before the crash before it served
    start = prompt_len(second_turn)
    assert set(second_turn["versions"][start:]) == {current}
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["capacity"]["running"] == 0 and status["sessions"]["open_sessions"] == 0
