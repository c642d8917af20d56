"""Routing a session's requests to the colocated replica that owns it
(``rlgate.serving.routing``), without Ray: the slot a key names, the proxy
middleware that copies it into Serve's session header, the replica's own
check (421), and the request router's choices."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from rlgate.serving.auth import Slot, key_slot
from rlgate.serving.errors import HTTPError
from rlgate.serving.routing import OwnerRouter, SessionHeader, request_slot, session_header
from rlgate.sessions.manager import new_session_key


def test_a_key_names_its_slot_and_only_session_keys_do():
    assert key_slot(new_session_key(0)) == 0
    assert key_slot(new_session_key(12)) == 12
    assert key_slot(new_session_key()) is None  # the split shape's keys route anywhere
    for other in ("rlg-admin-abc", "sk-rlg1-abc", "rlg12345-abc", "rlg1abc", "", "Bearer rlg1-x"):
        assert key_slot(other) is None, other


def test_a_request_carries_its_slot_in_a_scoped_url_or_as_its_bearer_key():
    assert request_slot("/run/s/rlg1-abc/v1/chat/completions", None) == 1
    assert request_slot("/v1/chat/completions", b"Bearer rlg3-xyz") == 3
    assert request_slot("/v1/chat/completions", b"bearer  rlg3-xyz") == 3
    assert request_slot("/s/rlg2-abc/v1/models", b"Bearer rlg3-xyz") == 2  # the URL's key is the session's
    assert request_slot("/v1/models", b"Basic cmxnMS14") is None
    assert request_slot("/rl/status", b"Bearer rlg-admin-abc") is None
    assert request_slot("/v1/models", None) is None


def test_the_proxy_middleware_sets_the_session_header_and_drops_a_client_sent_one():
    seen = []

    async def app(scope, receive, send):
        # the header in any spelling Serve reads (it takes underscores for hyphens too)
        seen.append(next((v for k, v in scope["headers"] if k.lower().replace(b"_", b"-") == session_header()), None))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def calls():
        transport = httpx.ASGITransport(app=SessionHeader(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            spoofed = {session_header().decode(): "7"}
            await client.post("/s/rlg1-abc/v1/chat/completions", headers=spoofed)
            await client.post("/v1/chat/completions", headers={"Authorization": "Bearer rlg0-abc", **spoofed})
            await client.get("/v1/models", headers=spoofed)
            await client.get("/health", headers={session_header().decode().replace("-", "_"): "1"})  # Serve reads it

    asyncio.run(calls())
    assert seen == [b"1", b"0", None, None]


def test_a_replica_serves_its_own_keys_and_answers_421_for_another_replicas():
    slot = Slot(index=0, replicas=2)
    slot.check(new_session_key(0))
    slot.check(new_session_key())  # no slot: simply unknown here (401 later)
    slot.check(new_session_key(5))  # names no replica of this deployment: unknown too
    with pytest.raises(HTTPError) as refused:
        slot.check(new_session_key(1))
    assert refused.value.status == 421
    assert "replica 1" in refused.value.message and "serve_start_options" in refused.value.message
    assert slot.owner(new_session_key(1)) == 1 and slot.owner(new_session_key(0)) is None


def test_a_replacement_ranked_past_the_slots_is_refused_until_its_slot_is_free():
    """Serve ranks a replacement past the end while the replica it replaces still
    stops: taking that rank as a slot would open a new journal and leave the dead
    replica's sessions unreachable (their keys name its slot)."""
    assert Slot.of_rank(1, 2) == Slot(1, 2)
    with pytest.raises(RuntimeError, match="Serve rank 2, past its 2 slots: the replica it replaces still holds"):
        Slot.of_rank(2, 2)


def replica(slot: int):
    return SimpleNamespace(replica_metadata={"slot": slot}, name=f"r{slot}")


def pending(session: str = "", age_s: float = 0.0):
    return SimpleNamespace(
        metadata=SimpleNamespace(session_id=session),
        created_at=time.time() - age_s,
        routing_context=SimpleNamespace(should_backoff=False),
    )


def router(replicas: int = 2, owner_wait_s: float = 60.0) -> OwnerRouter:
    chooser = OwnerRouter.__new__(OwnerRouter)  # its choices need none of Serve's machinery
    chooser.initialize_state(replicas=replicas, owner_wait_s=owner_wait_s)
    return chooser


def test_the_router_sends_a_session_to_its_owner_and_waits_while_the_owner_restarts():
    chooser, zero, one = router(), replica(0), replica(1)
    request = pending("1")
    assert asyncio.run(chooser.choose_replicas([zero, one], request)) == [[one]]
    assert request.routing_context.should_backoff  # one tier: wait before choosing again
    assert asyncio.run(chooser.choose_replicas([zero], pending("1"))) == []  # its owner is restarting
    # after owner_wait_s it goes anywhere (the replica answers 421 rather than the agent waiting forever)
    assert asyncio.run(chooser.choose_replicas([zero], pending("1", age_s=61))) == [[zero]]
    # a slot no replica of this deployment has, or none at all: the shortest queue among all
    assert len(asyncio.run(chooser.choose_replicas([zero, one], pending("9")))[0]) == 2
    assert len(asyncio.run(chooser.choose_replicas([zero, one], pending("x1")))[0]) == 2
    # digits int() refuses ("²" is a digit to str.isdigit): no slot, not an error that kills the routing task
    assert len(asyncio.run(chooser.choose_replicas([zero, one], pending("²")))[0]) == 2


def test_the_router_offers_new_sessions_to_each_replica_first_in_turn():
    chooser, replicas = router(3), [replica(0), replica(1), replica(2)]
    firsts = [asyncio.run(chooser.choose_replicas(replicas, pending()))[0][0].name for _ in range(6)]
    assert sorted(firsts) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert all(len(asyncio.run(chooser.choose_replicas(replicas, pending()))[0]) == 3 for _ in range(3))


def test_serve_gives_its_proxies_time_to_start_on_a_busy_node(monkeypatch):
    from rlgate.serving.routing import HOOK, HOOK_ENV, PROXY_READY_ENV, serve_start_options

    env = serve_start_options()["controller_options"]["runtime_env"]["env_vars"]
    assert env == {HOOK_ENV: HOOK, PROXY_READY_ENV: "30"}  # Serve's own 5 s restarts a proxy still starting
    monkeypatch.setenv(PROXY_READY_ENV, "90")  # an operator's own choice is kept
    assert serve_start_options()["controller_options"]["runtime_env"]["env_vars"][PROXY_READY_ENV] == "90"
