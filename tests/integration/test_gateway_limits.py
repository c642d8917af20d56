"""Capacity, refresh races, idle timeouts and a crashed engine, over real HTTP
(a second small gateway app: max 2 sessions, 6 s idle timeout)."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import gateway_fixture, replica_process

pytestmark = pytest.mark.long  # one to two minutes: `make test` hands this module out early, not last

SETTINGS = {
    "model": {"name": "tiny-random"},
    "rollout": {"max_model_len": 512, "kv_cache_gib": 0.25},
    "gateway": {
        "max_concurrent": 2,
        "session_timeout_s": 6.0,
        "refresh_timeout_s": 1.0,
        "max_session_interactions": 6,
        "max_session_tokens": 1024,
    },
}


small = gateway_fixture("gw-small", SETTINGS)


@pytest.fixture
def clean(small):
    """Each test starts with no open sessions and leaves none behind."""
    yield small
    status = httpx.get(f"{small.url}/rl/status", headers=small.admin).json()
    assert status["sessions"]["open_sessions"] == 0, "a test left sessions open"


def end(app, key) -> int:
    return httpx.post(f"{app.url}/rl/end_session", headers={"Authorization": f"Bearer {key}"}).status_code


def chat(app, key, **extra):
    api = openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0)
    return api.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
    )


def open_sessions(app) -> int:
    return httpx.get(f"{app.url}/rl/status", headers=app.admin).json()["sessions"]["open_sessions"]


def test_no_capacity_is_a_429_with_retry_after_then_recovers(clean):
    first, second = clean.start_session(), clean.start_session()
    refused = httpx.post(f"{clean.url}/rl/start_session", json={"task_id": "t"}, headers=clean.admin)
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert "no capacity" in refused.json()["error"]["message"]
    assert end(clean, first["api_key"]) == 200
    third = clean.start_session()
    for session in (second, third):
        assert end(clean, session["api_key"]) == 200


def test_refresh_without_capacity_says_the_old_session_was_ended(clean, ray_session):
    capacity = ray_session.get_actor("rlgate-gw-small-capacity", namespace="rlgate")
    a, b = clean.start_session(), clean.start_session()
    chat(clean, a["api_key"])
    ray_session.get(capacity.grant.remote(1, 0))  # a trainer attaches with batch 1: no room left
    try:
        refused = httpx.post(
            f"{clean.url}/rl/start_session",
            json={"task_id": "t", "api_key": a["api_key"]},
            headers=clean.admin,
            timeout=30,
        )
        assert refused.status_code == 429
        assert "previous session of this key was ended and exported" in refused.json()["error"]["message"]
        [record] = [r for r in clean.trajectories() if r["session_id"] == a["session_id"]]
        assert record["end_reason"] == "refreshed"
    finally:
        ray_session.get(capacity.detach.remote())
    again = clean.start_session(api_key=a["api_key"])  # the same key starts afresh once capacity is back
    assert again["api_key"] == a["api_key"]
    assert end(clean, a["api_key"]) == 200
    # b only held the second seat; idle since it started, the 6 s idle timeout may have ended it already
    assert end(clean, b["api_key"]) in (200, 410)


def test_concurrent_refreshes_of_one_key_never_give_two_sessions(clean):
    session = clean.start_session()
    chat(clean, session["api_key"])

    def refresh(_):
        return httpx.post(
            f"{clean.url}/rl/start_session",
            json={"task_id": "t", "api_key": session["api_key"]},
            headers=clean.admin,
            timeout=30,
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(refresh, range(8)))
    assert 200 in codes and set(codes) <= {200, 409, 429}
    assert open_sessions(clean) == 1  # exactly one live session for the key
    assert chat(clean, session["api_key"]).usage.completion_tokens > 0
    assert end(clean, session["api_key"]) == 200


def test_a_session_cannot_grow_past_its_limits(clean, tiny_tokenizer):
    """A key holder repeating a long prompt with many choices: the session stops
    at its limits (409 for completions, 413 for stored tokens, naming the
    setting), keeps nothing of a refused turn, and still ends and saves."""
    content = "hello " * 10
    while len(prompt_of(tiny_tokenizer, content)) < 400:  # ~400 tokens: three fill the 1024 of the limit
        content += "hello " * 10
    key = clean.start_session("t")["api_key"]
    headers = {"Authorization": f"Bearer {key}"}

    def turn(n: int) -> httpx.Response:
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": content}], "n": n, "max_tokens": 1}
        return httpx.post(f"{clean.url}/v1/chat/completions", json=body, headers=headers, timeout=60)

    first = turn(4)
    assert first.status_code == 200, first.text
    prompt = first.json()["usage"]["prompt_tokens"]
    stored, held = prompt + 4, 4  # the prompt once for its four choices
    refused = turn(4)  # 4 + 4 completions > 6
    assert refused.status_code == 409 and "max_session_interactions (6)" in refused.json()["error"]["message"]
    while stored + prompt + 1 <= 1024:
        assert turn(1).status_code == 200
        stored, held = stored + prompt + 1, held + 1
    refused = turn(1)
    assert refused.status_code == 413 and "max_session_tokens (1024)" in refused.json()["error"]["message"]
    ended = httpx.post(f"{clean.url}/rl/end_session", headers=headers)
    assert ended.status_code == 200 and ended.json()["interaction_count"] == held


def prompt_of(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_idle_sessions_are_ended_and_exported(clean):
    session = clean.start_session("idle")
    chat(clean, session["api_key"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        records = [r for r in clean.trajectories() if r["session_id"] == session["session_id"]]
        if records:
            break
        time.sleep(0.5)
    assert records and records[0]["end_reason"] == "timeout"
    with pytest.raises(openai.APIStatusError) as gone:
        chat(clean, session["api_key"])
    assert gone.value.status_code == 410


def test_a_crashed_engine_gives_503_then_serve_replaces_it(clean, ray_session):
    children = replica_process("gw-small", "RolloutServer").children(recursive=True)
    assert children, "expected vLLM's engine processes under the replica"
    session = clean.start_session("crash")  # after the state API's answer (seconds under load): 6 s idle timeout
    for child in children:
        child.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as down:
        chat(clean, session["api_key"])
    assert down.value.status_code == 503 and "rollout engine" in down.value.message
    # /health says so too: at once while the replica lives, after its 10 s wait for an engine once the replica has
    # ended itself. Asked beside the agent's retries, which keep its session from idling out (6 s) meanwhile.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        health = pool.submit(httpx.get, f"{clean.url}/health", timeout=30)
        # Serve's health check finds the dead engine and replaces the replica; the session survives.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if chat(clean, session["api_key"]).usage.completion_tokens > 0:
                    break
            except openai.APIStatusError as err:
                assert err.status_code == 503
            time.sleep(2)
        else:
            pytest.fail("the engine did not come back within 300 s")
        assert health.result().status_code == 503
    assert httpx.get(f"{clean.url}/health").json()["status"] == "ok"
    assert end(clean, session["api_key"]) == 200
    # the replica ended itself at its first failed probe (Serve replaces a replica that died at once, one that
    # only fails its probes after three of them): its stderr, in Ray's log folder, says so
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path())
    assert any(b"rollout engine is dead; ending this replica" in p.read_bytes() for p in logs.glob("worker-*.err"))


# One engine taking 1 request at a time and 1 more waiting.
TIGHT = {
    "model": {"name": "tiny-random"},
    "rollout": {"engine": "hf", "max_model_len": 512, "max_ongoing_requests": 1, "max_queued_requests": 1},
}
tight = gateway_fixture("gw-tight", TIGHT)


def test_a_saturated_engine_answers_503_with_retry_after_at_once_then_recovers(tight):
    sessions = [tight.start_session(f"load{i}") for i in range(8)]

    def ask(i: int) -> httpx.Response:
        body = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 200,
            "stream": i % 2 == 1,  # streaming requests are refused the same way: before anything is sent
        }
        headers = {"Authorization": f"Bearer {sessions[i]['api_key']}"}
        return httpx.post(f"{tight.url}/v1/chat/completions", json=body, headers=headers, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        answers = list(pool.map(ask, range(len(sessions))))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    assert 503 in codes[1::2], codes  # at most two of eight are taken, so streams are among those refused
    for answer in answers:
        if answer.status_code == 503:
            assert answer.headers["Retry-After"] == "1" and answer.elapsed.total_seconds() < 30
            assert "saturated" in answer.json()["error"]["message"]
        elif answer.headers["content-type"].startswith("text/event-stream"):
            assert answer.text.rstrip().endswith("data: [DONE]")
    # a refused request recorded nothing, and its session goes on: it is asked again and answered
    for session in sessions:
        assert chat(tight, session["api_key"]).usage.completion_tokens > 0
        assert end(tight, session["api_key"]) == 200
    turns = {s["session_id"]: 0 for s in sessions}
    for record in tight.trajectories():  # one record per turn ("individual" export)
        turns[record["session_id"]] += len(record["interaction_ids"])
    assert [turns[s["session_id"]] for s in sessions] == [1 + (code == 200) for code in codes]
