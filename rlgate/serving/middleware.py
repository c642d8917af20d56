"""Pure ASGI middleware of the gateway: the body limit, request metrics, the access
log, and the in-flight limit of a replica's own listener.

Pure ASGI: Starlette's ``BaseHTTPMiddleware`` runs every request through a
task group and memory streams, which cost more CPU than a tiny engine step.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlgate.serving.errors import error_response
from rlgate.telemetry import Metrics

access_log = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own lines


class BodyLimit:
    """413 for a body over ``limit`` bytes: at once when its Content-Length
    says so, else (a chunked body) as soon as that much has arrived."""

    def __init__(self, asgi, limit: int) -> None:
        self.asgi, self.limit = asgi, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        limit = self.limit
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            too_big = error_response(
                413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit", path=scope["path"]
            )
            return await too_big(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI passes HTTP exceptions raised while reading the body through
                raise StarletteHTTPException(413, f"request body exceeds the {limit}-byte limit")
            return message

        return await self.asgi(scope, counted, send)


class InFlightLimit:
    """503 with ``Retry-After: 1`` at once for a request beyond ``limit`` in flight.

    Serve's proxy bounds what reaches a replica (``max_ongoing_requests``, then
    ``max_queued_requests``); a replica's own listener (``[gateway]
    direct_port``) bounds it here, so a flood queues no unbounded work in the
    engine. A streamed answer counts until its last byte.
    """

    def __init__(self, asgi, limit: int) -> None:
        self.asgi, self.limit, self.running = asgi, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        if self.running >= self.limit:
            busy = error_response(
                503,
                f"this gateway replica has {self.limit} requests in flight; retry shortly",
                retry_after=1,
                path=scope["path"],
            )
            return await busy(scope, receive, send)
        self.running += 1
        try:
            return await self.asgi(scope, receive, send)
        finally:
            self.running -= 1


class Measure:
    """Requests and latency (to the first byte) per route template, so a scoped
    URL's key stays out of metrics and logs."""

    def __init__(self, asgi, metrics: Metrics | None, log_requests: bool) -> None:
        self.asgi, self.metrics, self.log_requests = asgi, metrics, log_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        started = time.monotonic()

        async def measured(message):
            if message["type"] == "http.response.start":
                self.record(scope, message["status"], time.monotonic() - started)
            await send(message)

        return await self.asgi(scope, receive, measured)

    def record(self, scope, status: int, elapsed: float) -> None:
        route = getattr(scope.get("route"), "path", "unmatched")
        # Serve's own access log is off for the Gateway: it logs raw paths, and a scoped URL's path holds a key.
        if self.log_requests:
            access_log.info("%s %s %d %.1fms", scope["method"], route, status, elapsed * 1000)
        if self.metrics is not None:
            self.metrics.inc("rlgate_requests_total", route=route, status=str(status))
            self.metrics.observe("rlgate_request_seconds", elapsed, route=route)


def install_middleware(app: FastAPI, max_body_bytes: int, metrics: Metrics | None, log_requests: bool) -> None:
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(Measure, metrics=metrics, log_requests=log_requests)  # outermost: it sees the 413s too
