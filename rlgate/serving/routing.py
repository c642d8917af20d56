"""Which colocated gateway replica serves a request: the one that owns its session.

With ``[gateway] colocate = true`` each Gateway replica holds its sessions in
process (:mod:`rlgate.serving.owned`), so every request of a session must
reach the replica that started it. The owner is named in the session key
itself: a replica of slot ``n`` (its Serve replica rank, which a replacement
for a crashed replica inherits together with the journal) hands out keys
``rlg<n>-<secret>``. The slot is only a routing hint; the replica still
checks the whole key.

Two pieces put a request on its owner without any lookup:

* :class:`SessionHeader`, a pure ASGI middleware installed in Ray Serve's HTTP
  proxy (the proxy imports :func:`proxy_middlewares` through
  ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``; :func:`serve_start_options`
  sets it for the Serve controller, whose proxies inherit it), copies the slot
  of the key a request carries (``Authorization: Bearer`` or a scoped
  ``/s/<key>/`` URL) into Serve's session header;
* :class:`OwnerRouter`, the Gateway deployment's request router, sends a
  request with a slot to the replica of that slot (it waits, up to
  ``owner_wait_s``, while a crashed owner restarts), and anything else (a
  new session, models, status) to the replica with the fewest requests in
  flight, ties taken in turn.

A replica that receives another slot's request anyway (Serve started without
the hook) answers 421 and says so; a refresh (``start_session`` with an
``api_key``) is forwarded to the key's owner through the same router.
"""

from __future__ import annotations

import os
import re
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.middleware import Middleware

from rlgate.serving.auth import key_slot

HOOK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HOOK = "rlgate.serving.routing.proxy_middlewares"
ROUTER = "rlgate.serving.routing.OwnerRouter"
_SCOPED = re.compile(r"/s/rlg(\d{1,4})-", re.ASCII)


def request_slot(path: str, authorization: bytes | None) -> int | None:
    """The slot of the session key a request carries: in a scoped URL, else as its bearer token."""
    scoped = _SCOPED.search(path)
    if scoped:
        return int(scoped.group(1))
    if authorization:
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        if scheme.lower() == "bearer":
            return key_slot(token.strip())
    return None


def session_header() -> bytes:
    """Serve's session header as the proxy reads it (``RAY_SERVE_SESSION_ID_HEADER_KEY``)."""
    from ray.serve._private.constants import SERVE_SESSION_ID

    return SERVE_SESSION_ID.lower().encode()


class SessionHeader:
    """Pure ASGI middleware: sets Serve's session header to the slot of the
    request's session key (replacing any the client sent), or drops it."""

    def __init__(self, app) -> None:
        self.app, self.header = app, session_header()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            # Serve also reads the header spelt with underscores: a client's, in any spelling, goes
            headers = [(k, v) for k, v in scope["headers"] if _spelling(k) != _spelling(self.header)]
            authorization = next((v for k, v in headers if k.lower() == b"authorization"), None)
            slot = request_slot(scope.get("path", ""), authorization)
            if slot is not None:
                headers.append((self.header, str(slot).encode()))
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


def _spelling(name: bytes) -> bytes:
    return name.lower().replace(b"_", b"-")


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    return [Middleware(SessionHeader)]


# Serve gives a starting proxy 5 s to say it is ready (more after each restart), then restarts it: a proxy
# process on a busy small node can take longer than that just to start (seen under load on 2 cores)
PROXY_READY_ENV, PROXY_READY_S = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30"


def serve_start_options() -> dict:
    """Keyword arguments for ``serve.start``: the proxies it starts route by session key,
    and are given ``PROXY_READY_S`` to start (the environment's own value, if set)."""
    env = {HOOK_ENV: HOOK, PROXY_READY_ENV: os.environ.get(PROXY_READY_ENV, PROXY_READY_S)}
    return {"controller_options": {"runtime_env": {"env_vars": env}}}


def router_config(replicas: int):
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=ROUTER, request_router_kwargs={"replicas": replicas})


class OwnerRouter(RequestRouter):
    """Serve request router of the colocated Gateway: a session's requests go to
    the replica of its slot; anything else to the fewest requests in flight.

    Deliberately stateless about sessions (no routing stats): every change of a
    replica's stats makes the controller broadcast the replica set, and a
    broadcast that still lists a replica this router has just seen die makes
    Serve look that actor up again, which can stall the router for minutes."""

    def initialize_state(self, replicas: int = 1, owner_wait_s: float = 120.0) -> None:
        self.replicas, self.owner_wait_s = replicas, owner_wait_s
        self._turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = ""
        if pending_request is not None:
            # one tier of candidates: after it, wait before choosing again (else Serve retries at once, in a loop
            # that never yields to the event loop, so the replica set it waits for never arrives)
            pending_request.routing_context.should_backoff = True
            session = pending_request.metadata.session_id
        # ASCII digits only: str.isdigit admits "²", which int() refuses (the routing task would die)
        slot = int(session) if session.isascii() and session.isdigit() and len(session) <= 4 else None
        if slot is not None and slot < self.replicas:
            owner = [r for r in candidate_replicas if r.replica_metadata.get("slot") == slot]
            if owner:
                return [owner]
            if time.time() - pending_request.created_at < self.owner_wait_s:
                return []  # its owner is (re)starting: back off and look again
        # the shortest queue; among equals the first, so start the list at each replica in turn
        self._turn = (self._turn + 1) % max(1, len(candidate_replicas))
        return [candidate_replicas[self._turn :] + candidate_replicas[: self._turn]]
