"""Hostile input over HTTP: every route of the gateway's OpenAPI document gets
generated garbage (random JSON of any shape and depth, huge numbers, unknown
fields, wrong types, malformed UTF-8, valid requests with one field broken),
with no key, the admin key and a live session key. No answer may be a 5xx,
none may hang, and afterwards the gateway works as before."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import start_gateway

SETTINGS = {
    "model": {"name": "tiny-random"},
    "rollout": {"engine": "hf", "max_model_len": 256},
    "gateway": {"max_completion_tokens": 8, "max_concurrent": 1000},
}
FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def fuzz(ray_session, tmp_path_factory):
    from ray import serve

    app = start_gateway(ray_session, tmp_path_factory, "gw-fuzz", SETTINGS)
    session = app.start_session("fuzz")
    app.session_key = session["api_key"]
    document = httpx.get(f"{app.url}/openapi.json", headers=app.admin).json()
    app.operations = [
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post")
    ]
    yield app
    serve.delete("gw-fuzz")


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**18, max_value=10**400)  # beyond any int64 (Python's JSON writes them)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
)
deeply_nested = st.integers(50, 3000).map(lambda depth: "[" * depth + "]" * depth)
malformed_utf8 = st.binary(min_size=1, max_size=64).map(lambda b: b'{"model": "' + b + b'\xff\xfe"}')
near_json = st.text(alphabet='{}[]":,0123456789abcdefnulltrue \\', max_size=60)

CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
valid_bodies = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "tiny-random", "prompt": "hi", "max_tokens": 2},
    "/rl/start_session": {"task_id": "fuzz", "train": False},
    "/rl/set_reward": {"reward": 1.0},
    "/api/rl/jobs": {"config": {"model": {"name": "tiny-random"}}},
}


@st.composite
def broken(draw, body: dict):
    """A valid body with one field replaced by anything, or an unknown field added."""
    body = json.loads(json.dumps(body))
    key = draw(st.sampled_from([*body, "unknown_field", "messages"]))
    body[key] = draw(json_values | st.just([{"role": "assistant", "content": TOOL_CALL_TEXT[:-3]}]))
    return json.dumps(body).encode()


raw_bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    deeply_nested.map(str.encode),
    malformed_utf8,
    near_json.map(str.encode),
    st.binary(max_size=128),
)


def ask(app, method: str, path: str, body: bytes, who: str) -> httpx.Response:
    key = {"none": None, "admin": app.admin_key, "session": app.session_key}[who]
    path = path.replace("{session_key}", app.session_key).replace("{job_id}", "job-0123456789ab")
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.request(
        method, app.url + path, content=body if method == "POST" else None, headers=headers, timeout=60
    )


def check(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        assert response.json()["error"]["message"], what


@FUZZ
@given(data=st.data())
def test_no_route_answers_garbage_with_a_5xx(fuzz, data):
    method, path = data.draw(st.sampled_from(fuzz.operations))
    who = data.draw(st.sampled_from(["none", "admin", "session"]))
    valid = valid_bodies.get(path.replace("/s/{session_key}", ""))
    body = data.draw(raw_bodies | broken(valid) if valid else raw_bodies)
    response = ask(fuzz, method, path, body, who)
    check(response, f"{method} {path} as {who} with {body[:200]!r}")
    if path == "/rl/start_session" and response.status_code == 200:  # leave nothing open
        httpx.post(f"{fuzz.url}/rl/end_session", headers={"Authorization": f"Bearer {response.json()['api_key']}"})


@FUZZ
@given(
    text=st.text(max_size=200) | st.just(TOOL_CALL_TEXT).flatmap(lambda t: st.integers(0, len(t)).map(lambda n: t[:n]))
)
def test_any_conversation_text_is_answered_or_refused_cleanly(fuzz, text):
    """Message contents the chat template and the tool-call machinery must take:
    any Unicode, lone surrogates escaped in JSON, half-written tool calls."""
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": text},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "go on"},
    ]
    body = json.dumps(CHAT | {"messages": messages}).encode()
    check(ask(fuzz, "POST", "/v1/chat/completions", body, "session"), f"messages with {text!r}")


def test_after_the_fuzz_the_gateway_works_as_before(fuzz):
    assert httpx.get(f"{fuzz.url}/health").json()["status"] == "ok"
    status = httpx.get(f"{fuzz.url}/rl/status", headers=fuzz.admin).json()
    # the fuzz session may have been ended by a fuzzed end_session; the books agree either way
    assert status["capacity"]["running"] == status["sessions"]["open_sessions"] <= 1
    fresh = fuzz.start_session("after")
    headers = {"Authorization": f"Bearer {fresh['api_key']}"}
    assert httpx.post(f"{fuzz.url}/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    assert httpx.post(f"{fuzz.url}/rl/set_reward", json={"reward": 1}, headers=headers).is_success
    assert httpx.post(f"{fuzz.url}/rl/end_session", headers=headers).is_success
    [record] = [r for r in fuzz.trajectories() if r["session_id"] == fresh["session_id"]]
    assert record["reward"] == 1.0 and len(record["interaction_ids"]) == 1
