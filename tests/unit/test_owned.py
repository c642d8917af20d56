"""Sessions held in process (``rlgate.serving.owned``) and a replica's own
listener (``rlgate.serving.listener``), without Ray: what a successor does with
a predecessor's journal, and the direct port's binding and serving."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI

from rlgate.serving.listener import Listener, bind, claim_port
from rlgate.serving.middleware import InFlightLimit
from rlgate.serving.owned import OwnedSessions, claim_journal
from rlgate.sessions.manager import hash_key
from rlgate.sessions.trajectory import Interaction
from tests.support import free_port

SETTINGS = {
    "export_style": "individual",
    "turn_discount": 1.0,
    "session_timeout_s": 3600.0,
    "refresh_timeout_s": 1.0,
    "run_name": "owned-test",
    "max_session_interactions": 1024,
    "max_session_tokens": 1_048_576,
}


class Slots:
    def __init__(self) -> None:
        self.running, self.reconciled = 0, []

    async def acquire(self, timeout_s=0.0, task_id=None, group_size=None) -> bool:
        self.running += 1
        return True

    async def release(self, accepted: bool) -> None:
        self.running -= 1

    def reconcile(self, running: int) -> None:
        self.reconciled.append(running)
        self.running = running


def owner(journal, slots: Slots, saved: list, resume: bool) -> OwnedSessions:
    async def persist(records):
        saved.extend(records)

    return OwnedSessions(slots, persist, SETTINGS, journal, resume=resume, reconcile=slots.reconcile)


def turn(number: int) -> list[Interaction]:
    return [Interaction(f"i{number}", [1, 2, 3], [4, 5], [-0.5, -0.25], [0, 0], "stop")]


async def open_two(journal, slots: Slots, saved: list) -> OwnedSessions:
    first = owner(journal, slots, saved, resume=False)
    for name in ("a", "b"):
        session_id = await first.start(name, hash_key(name), None, None, 0.0, True)
        await first.record(session_id, turn(0))
    await first.set_reward(hash_key("a"), 0.5, None, None)
    return first


async def test_a_successor_that_resumes_keeps_the_sessions_going(tmp_path):
    journal, slots, saved = tmp_path / "journal.jsonl", Slots(), []
    first = await open_two(journal, slots, saved)
    first.close()

    successor = owner(journal, slots, saved, resume=True)
    assert slots.reconciled == [0, 2]  # the slots its sessions hold, counted again
    assert (await successor.stats())["open_sessions"] == 2
    await asyncio.sleep(0)
    assert saved == []  # nothing ended on its behalf
    assert await successor.end(hash_key("a")) == 1
    [record] = saved
    assert (record["task_id"], record["reward"], record["end_reason"]) == ("a", 0.5, "ended")
    successor.close()


async def test_a_new_application_ends_and_exports_what_it_finds(tmp_path):
    journal, slots, saved = tmp_path / "journal.jsonl", Slots(), []
    (await open_two(journal, slots, saved)).close()

    fresh = owner(journal, slots, saved, resume=False)
    await fresh.stats()  # the first call ends the orphans, in the background
    for _ in range(100):
        if len(saved) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted((r["task_id"], r["end_reason"]) for r in saved) == [("a", "restart"), ("b", "restart")]
    assert (await fresh.stats())["open_sessions"] == 0 and slots.running == 0
    fresh.close()


def test_only_the_same_deployment_resumes_a_journal(tmp_path):
    path, resume = claim_journal(tmp_path / "sessions", "deploy-1")
    assert path == tmp_path / "sessions" / "journal.jsonl" and not resume  # nothing to take over
    assert claim_journal(tmp_path / "sessions", "deploy-1")[1]  # a replica of the same deployment: resume
    assert not claim_journal(tmp_path / "sessions", "deploy-2")[1]  # a new deployment: end them
    assert not claim_journal(tmp_path / "sessions", "")[1]  # no token: never resume


async def listening(*listeners) -> None:
    """Wait (up to 2 s) until every listener's server has started."""
    for _ in range(200):
        if all(listener.server.started for listener in listeners):
            return
        await asyncio.sleep(0.01)


async def test_the_listener_serves_the_app_and_shares_its_port():
    app = FastAPI()

    @app.get("/ping")
    async def ping():
        return {"pong": True}

    port = free_port()
    first, second = Listener(app, bind("127.0.0.1", port)), Listener(app, bind("127.0.0.1", port))
    try:
        async with httpx.AsyncClient() as http:
            await listening(first, second)
            answer = await http.get(f"http://127.0.0.1:{port}/ping")
        assert answer.json() == {"pong": True} and first.port == second.port == port
        # no access log: a raw path may hold a scoped URL's session key
        assert first.server.config.access_log is False
    finally:
        await first.close()
        await second.close()


async def test_a_responses_writes_in_one_turn_of_the_loop_leave_as_one_send():
    """uvicorn writes a response's head and body apart; the listener's transport
    sends them together (a send on loopback costs the receiving side's TCP too),
    in order, and a close sends what is pending first."""
    from rlgate.serving.listener import CoalescedWrites

    class Transport:
        def __init__(self) -> None:
            self.sent, self.closed = [], False

        def write(self, data: bytes) -> None:
            assert not self.closed
            self.sent.append(data)

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str):
            return f"info:{name}"

    raw = Transport()
    transport = CoalescedWrites(raw, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.writelines([b"body", b"-more"])
    assert raw.sent == []
    await asyncio.sleep(0)
    assert raw.sent == [b"HTTP/1.1 200 OK\r\n\r\nbody-more"]
    transport.write(b"last")
    transport.close()
    assert raw.sent[-1] == b"last" and raw.closed and transport.get_extra_info("peername") == "info:peername"
    transport.write(b"after close")  # a peer gone: dropped, as a closing transport would
    await asyncio.sleep(0)
    assert raw.sent[-1] == b"last"


async def test_the_listener_answers_whole_and_streamed_responses_on_one_connection():
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/whole/{n}")
    async def whole(n: int):
        return {"n": n, "pad": "x" * 100_000 * (n % 2)}  # odd ones larger than a socket buffer

    @app.get("/stream")
    async def stream():
        async def chunks():
            for n in range(50):
                yield f"data: {n}\n\n"
                if n % 7 == 0:
                    await asyncio.sleep(0)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = free_port()
    listener = Listener(app, bind("127.0.0.1", port))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            await listening(listener)
            for n in range(6):  # one kept-alive connection: each answer whole, none running into the next
                answer = await http.get(f"/whole/{n}")
                assert answer.json() == {"n": n, "pad": "x" * 100_000 * (n % 2)}
                streamed = await http.get("/stream")
                assert streamed.text == "".join(f"data: {n}\n\n" for n in range(50))
    finally:
        await listener.close()


def test_a_port_taken_by_another_program_is_a_clear_error():
    with socket.socket() as taken:  # no SO_REUSEPORT: not shareable
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port} \(\[gateway\] direct_port\)"):
            bind("127.0.0.1", port)


def test_a_port_is_shared_by_one_runs_replicas_and_refused_to_another_run(tmp_path):
    import os

    port = 8101
    first = claim_port(port, "/runs/demo-1", tmp_path)
    second = claim_port(port, "/runs/demo-1", tmp_path)  # its other replica, or its replacement
    with pytest.raises(
        RuntimeError, match=r"port 8101 .* served on this node by another run's gateway \(/runs/demo-1\)"
    ):
        claim_port(port, "/runs/lora-2", tmp_path)
    assert claim_port(port + 1, "/runs/lora-2", tmp_path) >= 0  # ports are claimed one by one
    os.close(first)
    with pytest.raises(RuntimeError, match="another run's gateway"):  # one replica of demo-1 still serves it
        claim_port(port, "/runs/lora-2", tmp_path)
    os.close(second)
    third = claim_port(port, "/runs/lora-2", tmp_path)  # demo-1 gone (a process that ends closes its claim)
    with pytest.raises(RuntimeError, match=r"\(/runs/lora-2\)"):
        claim_port(port, "/runs/demo-1", tmp_path)
    os.close(third)


async def test_beyond_its_in_flight_limit_the_listener_answers_503_at_once():
    app, release = FastAPI(), asyncio.Event()

    @app.get("/slow")
    async def slow():
        await release.wait()
        return {"done": True}

    port = free_port()
    limited = InFlightLimit(app, 2)
    listener = Listener(limited, bind("127.0.0.1", port))
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            await listening(listener)
            held = [asyncio.create_task(http.get("/slow")) for _ in range(2)]
            for _ in range(200):  # both admitted and waiting
                if limited.running == 2:
                    break
                await asyncio.sleep(0.01)
            assert limited.running == 2
            refused = await http.get("/slow")
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert "2 requests in flight" in refused.json()["error"]["message"]
            release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            assert (await http.get("/slow")).status_code == 200  # the slots came back
    finally:
        await listener.close()


def test_the_training_driver_plays_on_the_direct_port_only_where_it_answers():
    from rlgate.config import parse_config
    from rlgate.training.driver import direct_url
    from tests.support import serve_asgi

    health = FastAPI()

    @health.get("/health")
    async def answer():
        return {"status": "ok", "workers": 1, "policy_version": 0}

    with serve_asgi(health) as url:
        port = int(url.rsplit(":", 1)[1])
        one = parse_config({"gateway": {"colocate": True, "direct_port": port}})
        assert direct_url(one, "127.0.0.1") == url
        split = parse_config({"gateway": {"direct_port": port}})
        assert direct_url(split, "127.0.0.1") == url
        # several colocated replicas each serve their own sessions only: Serve's proxy routes them
        two = parse_config({"gateway": {"colocate": True, "replicas": 2, "direct_port": port}})
        assert direct_url(two, "127.0.0.1") is None
    assert direct_url(parse_config({}), "127.0.0.1") is None  # no direct port
    nobody = parse_config({"gateway": {"direct_port": free_port()}})
    assert direct_url(nobody, "127.0.0.1") is None  # nothing answers there (the replica is on another node)


async def test_a_new_applications_first_call_already_finds_the_old_keys_ended(tmp_path):
    """The orphans are saved in the background, but from the moment the new owner
    exists their keys answer 410, whichever call comes first: none adds to a
    session of an application that is gone, nor ends it as if its agent had."""
    from rlgate.sessions.manager import SessionError

    journal, slots, saved = tmp_path / "journal.jsonl", Slots(), []
    (await open_two(journal, slots, saved)).close()

    fresh = owner(journal, slots, saved, resume=False)
    for call in (
        lambda: fresh.set_reward(hash_key("a"), 1.0, None, None),
        lambda: fresh.end(hash_key("b")),
        lambda: fresh.begin(hash_key("a"), []),
        lambda: fresh.check(hash_key("b")),
    ):
        with pytest.raises(SessionError) as refused:
            await call()
        assert refused.value.status == 410, refused.value.message
    for _ in range(100):
        if len(saved) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted((r["task_id"], r["reward"], r["end_reason"]) for r in saved) == [
        ("a", 0.5, "restart"),
        ("b", 0.0, "restart"),
    ]
    fresh.close()


async def test_refreshing_an_earlier_applications_key_saves_its_session_first(tmp_path):
    """A refresh of a key whose session the new owner has not saved yet (an
    earlier application's, closed to its key) saves that session first, as a
    refresh of a live key does, so the new session under the key is the key's
    alone: the background save of the old one must not take the key from it."""
    journal, slots, saved = tmp_path / "journal.jsonl", Slots(), []
    (await open_two(journal, slots, saved)).close()

    fresh = owner(journal, slots, saved, resume=False)
    renewed = await fresh.start("a", hash_key("a"), hash_key("a"), None, 0.0, True)
    for _ in range(100):
        if len(saved) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted((r["task_id"], r["end_reason"]) for r in saved) == [("a", "restart"), ("b", "restart")]
    assert (await fresh.begin(hash_key("a"), []))[0] == renewed and slots.running == 1
    fresh.close()
