"""The serving path without Ray Serve: ``rlgate.serving.build_app`` over a
GatewayService with an in-process SessionManager and the real HF engine on
tiny-random, called with the official openai client through httpx's ASGI transport."""

from __future__ import annotations

import openai
import pytest

from tests.support import ADMIN, client, start


async def test_a_session_of_two_turns_is_served_recorded_and_exported(served, tiny_tokenizer):
    http, manager, saved = served
    key = await start(http)
    messages = [{"role": "user", "content": "Hello"}]
    first = await client(http, key).chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go"}]
    stream = await client(http, key).chat.completions.create(
        model="default", messages=messages, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    reward = await http.post("/rl/set_reward", json={"reward": 1.0}, headers={"Authorization": f"Bearer {key}"})
    assert reward.status_code == 200, reward.text
    ended = await http.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
    assert ended.json()["interaction_count"] == 2
    [record] = saved  # one sequence: the second turn continued the first
    assert record["reward"] == 1.0 and sum(record["loss_mask"]) == 5 + 4
    assert tiny_tokenizer.decode(record["input_ids"][-4:]) == text
    assert manager.stats()["open_sessions"] == 0


async def test_refusals_are_openai_errors_and_leave_the_session_usable(served):
    http, manager, _ = served
    key = await start(http)
    chat = client(http, key).chat.completions
    with pytest.raises(openai.BadRequestError, match="exceeds this gateway's limit"):
        await chat.create(model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        await chat.create(model="gpt-9", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not a session key"):
        await client(http, ADMIN).chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    keyless = await http.post(
        "/v1/chat/completions", json={"model": "tiny-random", "messages": [{"role": "user", "content": "x"}]}
    )
    assert keyless.status_code == 401 and "missing API key" in keyless.json()["error"]["message"]
    # OpenAI's error shape: code a string (or null), type, param naming the field
    assert keyless.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    with pytest.raises(openai.BadRequestError) as refused:
        await chat.create(model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert refused.value.code is None and refused.value.type == "invalid_request_error"
    assert refused.value.param == "max_tokens"
    reply = await chat.create(model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.choices[0].message.content is not None
    stats = manager.stats()
    assert (stats["open_sessions"], stats["open_interactions"]) == (1, 1)  # refusals recorded nothing


def test_the_serving_path_imports_without_ray():
    """Only rlgate.serving.clients talks to Ray; the rest is plain code."""
    import subprocess
    import sys

    modules = ", ".join(f"rlgate.serving.{name}" for name in ("routes", "service", "turns", "auth", "errors", "owned"))
    check = f"import sys, {modules}; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    found = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout


async def test_a_stream_whose_client_is_gone_before_its_first_chunk_leaves_nothing_in_flight(served):
    """The client goes away while the response starts (its first send fails): the
    stream never runs, yet the request is no longer counted in its session (it
    would keep the session from idling out for 15 minutes)."""
    import json

    http, manager, _ = served
    key = await start(http)
    app = http._transport.app
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64, "stream": True}
    incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("gateway", 80),
    }

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            raise OSError("the client is gone")

    with pytest.raises(Exception):  # noqa: B017 - whichever error the server stack turns it into
        await app(scope, receive, send)
    [session] = manager.sessions.values()
    assert session.requests == [] and len(session.trajectory) == 0


async def test_too_many_messages_or_choices_are_refused_naming_the_limit(served):
    http, manager, _ = served
    key = await start(http)
    chat = client(http, key).chat.completions
    many = [{"role": "user", "content": "x"}] * 1025
    with pytest.raises(openai.BadRequestError, match="1025 messages exceed the limit of 1024"):
        await chat.create(model="tiny-random", messages=many, max_tokens=2)
    for n in (17, 129):  # 129: past what sampling itself takes, too
        with pytest.raises(openai.BadRequestError, match=f"n={n} exceeds this gateway's limit of 16"):
            await chat.create(model="tiny-random", messages=many[:1], max_tokens=2, n=n)
    with pytest.raises(openai.UnprocessableEntityError, match="seed"):  # past 64 bits: no engine takes it
        await chat.create(model="tiny-random", messages=many[:1], max_tokens=2, seed=2**64)
    assert manager.stats()["open_interactions"] == 0  # refused before anything was generated


async def test_a_large_prompt_is_tokenised_off_the_event_loop(served, monkeypatch):
    """One request near max_body_bytes must not stall every other request this
    process serves: past OFF_LOOP_CHARS its prompt is rendered and tokenised in a
    worker thread (short prompts stay on the loop, where a thread hop costs more)."""
    import threading

    from rlgate.serving import service
    from rlgate.serving.chat import ChatRenderer

    http, _, _ = served
    threads = []
    real = ChatRenderer.prompt_ids

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "prompt_ids", spy)
    key = await start(http)
    for content in ("hi", "word " * (service.OFF_LOOP_CHARS // 5 + 1)):
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "tiny-random", "messages": [{"role": "user", "content": content}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code in (200, 400), answer.text  # the long one is past tiny-random's context
    assert threads[0] is threading.main_thread()
    assert threads[1] is not threading.main_thread() and threads[1].name.startswith("rlgate-tokenize")
    # the size counts the tools too, not only the messages' text
    tool = {"type": "function", "function": {"name": "f", "description": "d" * service.OFF_LOOP_CHARS}}
    short = [{"role": "user", "content": "hi"}]
    answer = await http.post(
        "/v1/chat/completions",
        json={"model": "tiny-random", "messages": short, "tools": [tool], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert answer.status_code in (200, 400), answer.text
    assert threads[2].name.startswith("rlgate-tokenize")
    long = await http.post(
        "/v1/completions",
        json={"model": "tiny-random", "prompt": "word " * (service.OFF_LOOP_CHARS // 5 + 1), "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert long.status_code == 400 and "the model's context holds" in long.json()["error"]["message"]


async def test_a_session_that_opens_after_its_caller_hung_up_is_ended_with_nothing_saved(tmp_path, tiny_tokenizer):
    """A start waiting for capacity (``wait_s``) whose client hangs up is cancelled,
    but the session store's side goes on (a remote call is not cancelled with its
    caller) and may open the session: no agent has its key, so it is ended at
    once, saving nothing, and its slot is free for the next agent."""
    import asyncio

    from rlgate.config import parse_config
    from rlgate.serving import api
    from rlgate.serving.auth import Auth
    from rlgate.serving.clients import JobsClient
    from rlgate.serving.owned import LocalSessions
    from rlgate.serving.service import GatewayService
    from rlgate.sessions.manager import SessionManager, hash_key

    freed = asyncio.Event()

    class Slots:  # one slot, held by another agent until `freed`
        running = 0

        async def acquire(self, timeout_s=0.0, task_id=None, group_size=None) -> bool:
            await freed.wait()
            self.running += 1
            return True

        async def release(self, accepted: bool) -> None:
            self.running -= 1

    saved: list[dict] = []

    async def persist(records):
        saved.extend(records)

    slots = Slots()
    manager = SessionManager(slots, persist)
    settings = parse_config({"model": {"name": "tiny-random"}, "gateway": {"run_dir": str(tmp_path)}})
    service = GatewayService(
        settings, tiny_tokenizer, Auth(hash_key(ADMIN)), LocalSessions(manager), None, None, JobsClient(lambda: None)
    )
    body = api.StartSessionRequest(task_id="t", wait_s=30)
    starting = asyncio.ensure_future(service.start_session(body, "http://gateway", f"Bearer {ADMIN}"))
    await asyncio.sleep(0.01)
    starting.cancel()  # the client hung up while it waited
    freed.set()
    for _ in range(100):
        if manager.counters["ended"]:
            break
        await asyncio.sleep(0.005)
    assert starting.cancelled()
    assert (manager.counters["started"], manager.counters["ended"], manager.sessions) == (1, 1, {})
    assert slots.running == 0 and saved == []


async def test_a_stream_that_fails_part_way_ends_with_an_error_event_on_every_protocol(tiny_tokenizer, tmp_path):
    """An error inside the engine or a parser after the first chunks (past the
    status line) must end the stream with an error event, in each protocol's
    shape, not just stop: a client would read a cut-off answer as a whole one.
    Nothing of the failed turn is recorded, and the session is not left busy."""
    import json

    import httpx

    from rlgate.rollout.engines.base import TokenChunk
    from tests.support import serving_app

    class Failing:  # two tokens, then an error of the engine's own
        async def generate(self, prompt_ids, params, whole=False):
            for token in (5, 6):
                yield TokenChunk(index=0, token_ids=[token], logprobs=[-0.5], versions=[0])
            raise RuntimeError("the engine core died")

    app, manager, saved = serving_app(Failing(), tiny_tokenizer, tmp_path)
    user = [{"role": "user", "content": "Hi"}]
    routes = {
        "/v1/chat/completions": {"model": "tiny-random", "messages": user, "max_tokens": 4, "stream": True},
        "/v1/messages": {"model": "tiny-random", "messages": user, "max_tokens": 4, "stream": True},
        "/v1/responses": {"model": "tiny-random", "input": "Hi", "max_output_tokens": 4, "stream": True},
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        key = await start(http)
        for route, body in routes.items():
            answer = await http.post(route, json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200, answer.text
            events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
            last = events[-1]
            error = last.get("error") or last  # chat: {"error": {...}}; messages: {"type": "error", "error": ...}
            assert "failed part way" in json.dumps(error), (route, answer.text[-500:])
    [session] = manager.sessions.values()
    assert session.requests == [] and len(session.trajectory) == 0 and saved == []


async def test_a_turn_the_session_refuses_to_record_leaves_its_other_requests_in_flight(served):
    """A record the session refuses (here: past max_session_interactions) ends
    that request's flight in the session; the gateway must not end it a second
    time, which would take another request of the session out of flight (the
    idle sweep could then end the session under it)."""
    http, manager, _ = served
    key = await start(http)
    manager.max_interactions = 1
    [session] = manager.sessions.values()
    manager.begin(session.key_hash, [])  # another request of the session, still generating
    with pytest.raises(openai.ConflictError, match="past \\[gateway\\] max_session_interactions"):
        await client(http, key).chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2
        )
    assert len(session.requests) == 1 and len(session.trajectory) == 0


async def test_a_refresh_forwarded_to_a_replica_that_is_not_the_keys_owner_is_421_not_forwarded_again(
    tmp_path, tiny_tokenizer
):
    """A refresh of another slot's key is forwarded to its owner; if the router gave
    up waiting for an owner that is away and sent it elsewhere, that replica answers
    421 rather than forward it once more (a chain that grew while the owner was gone)."""
    from rlgate.config import parse_config
    from rlgate.serving import api
    from rlgate.serving.auth import Auth, Slot
    from rlgate.serving.clients import JobsClient
    from rlgate.serving.errors import HTTPError
    from rlgate.serving.service import GatewayService
    from rlgate.sessions.manager import hash_key, new_session_key

    class Peers:
        def __init__(self) -> None:
            self.forwarded: list[int] = []

        async def start_session(self, owner, body, base_url, authorization):
            self.forwarded.append(owner)
            return api.StartSessionResponse(session_id="s", api_key=body.api_key, inference_url="u")

    settings = parse_config({"model": {"name": "tiny-random"}, "gateway": {"run_dir": str(tmp_path)}})
    peers = Peers()
    service = GatewayService(
        settings, tiny_tokenizer, Auth(hash_key(ADMIN), Slot(0, 3)), None, None, None, JobsClient(lambda: None), peers
    )
    body = api.StartSessionRequest(task_id="t", api_key=new_session_key(2))
    await service.start_session(body, "http://gateway", f"Bearer {ADMIN}")  # from an agent: to its owner
    with pytest.raises(HTTPError) as refused:
        await service.start_session(body, "http://gateway", f"Bearer {ADMIN}", forwarded=True)
    assert refused.value.status == 421 and peers.forwarded == [2]


async def test_a_request_whose_caller_leaves_while_its_session_counts_it_is_not_left_in_flight():
    """Split shape: the SessionStore counts a request in flight at ``begin``; a caller
    that hung up during that call never learned which session to settle, and the
    session looked busy (never idle-ended) for 15 minutes."""
    import asyncio
    from types import SimpleNamespace

    from rlgate.serving.clients import SessionClient

    answer, abandoned = asyncio.get_running_loop().create_future(), []
    store = SimpleNamespace(
        begin=SimpleNamespace(remote=lambda key_hash, candidates: answer),
        abandon=SimpleNamespace(remote=abandoned.append),
    )
    begun = asyncio.create_task(SessionClient(store).begin("hash", []))
    await asyncio.sleep(0)
    begun.cancel()
    await asyncio.sleep(0)
    answer.set_result(("session-1", None))  # the store counted it after the caller left
    with pytest.raises(asyncio.CancelledError):
        await begun
    for _ in range(10):
        await asyncio.sleep(0)
    assert abandoned == ["session-1"]
