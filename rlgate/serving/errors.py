"""Errors on the serving path, all in OpenAI's error shape.

Every refusal is an :class:`HTTPError` (or a :class:`rlgate.sessions.manager.SessionError`
from the session store) and reaches the client as
``{"error": {"message", "type", "param", "code"}}`` with its status (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on its Messages route), so
the official SDKs raise the right exception carrying our message.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlgate.sessions.manager import SessionError

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


def invalid_translation(err) -> HTTPError:
    """A 400 for a request of another protocol whose chat translation is invalid (a pydantic ValidationError)."""
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return HTTPError(400, f"{where}: {first['msg']}", param=where or None)


class ServiceDown(HTTPError):
    """An actor behind a route died (Ray may be restarting it)."""


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    421: "misdirected_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}

# ``code`` is a string or null, as OpenAI sends it (the SDKs type it so); the
# status is on the response line. A short machine-readable reason per status.
ERROR_CODES = {
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    410: "gone",
    413: "request_too_large",
    421: "misdirected_request",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": ERROR_CODES.get(status),
        }
    }


# Anthropic's error ``type`` per status, for its Messages route.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    retry_after: float | None = None,
    path: str | None = None,
):
    """The error as its route's protocol shapes it: Anthropic's on ``.../messages``, else OpenAI's."""
    headers = {"Retry-After": str(int(retry_after + 0.999))} if retry_after is not None else None
    if path is not None and path.endswith("/messages"):
        body = anthropic_error_body(status, message)
    else:
        body = error_body(status, message, param)
    return JSONResponse(body, status_code=status, headers=headers)


def broken_stream(err: Exception) -> HTTPError:
    """An unexpected error after a stream has begun, as the error its last event
    carries (logged with its traceback): the client learns the answer is cut
    short, rather than reading an ended stream as a whole answer."""
    logger.error("a streamed answer failed part way", exc_info=err)
    return HTTPError(500, f"the answer failed part way ({err.__class__.__name__}); retry")


def sse_error(err: HTTPError | SessionError) -> str:
    """An error after a stream has begun (its status line is sent): one event."""
    return f"data: {json.dumps(error_body(err.status, err.message))}\n\n"


async def _http_error(request: Request, err: HTTPError):
    return error_response(err.status, err.message, err.param, err.retry_after, path=request.url.path)


async def _no_route(request: Request, err: StarletteHTTPException):
    """No such route (404) or method (405), in the same shape as everything else."""
    message = {404: "no such route", 405: "method not allowed on this route"}.get(err.status_code, str(err.detail))
    return error_response(err.status_code, message, path=request.url.path)


async def _session_error(request: Request, err: SessionError):
    return error_response(err.status, err.message, retry_after=err.retry_after, path=request.url.path)


async def _validation_error(request: Request, err: RequestValidationError):
    # the deepest: a value that fits no branch of a union fails each, and the branch it
    # came nearest to (a list of blocks, not the string) says what was wrong
    first = max(err.errors(), key=lambda error: len(error["loc"]))
    where = ".".join(str(part) for part in first["loc"] if part != "body")
    path = request.url.path
    if first["type"] == "json_invalid":
        return error_response(422, f"the body is not valid JSON: {first['msg']}", path=path)
    return error_response(422, f"{where or 'body'}: {first['msg']}", param=where or None, path=path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(StarletteHTTPException, _no_route)
    app.add_exception_handler(SessionError, _session_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
