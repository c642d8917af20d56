"""A gateway replica's own HTTP listener, beside Ray Serve's proxy.

With ``[gateway] direct_port`` each Gateway replica also serves its app with
uvicorn on that port, in its own event loop: a request then reaches the
replica without the proxy hop (the proxy parses HTTP, then forwards every
request and each body chunk to the replica through Ray calls). Same routes,
same keys, same answers; Serve's proxy keeps serving route prefixes, RL jobs
and the dashboard's view of the app.

The socket is bound with ``SO_REUSEPORT``: a replica replacing another on the
same node binds while the old one drains, and several replicas on one node
share the port (the kernel spreads connections over them).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The replica's process owns its signals (Ray handles them), not this server."""
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that replicas on this node may share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeError(
            f"the gateway cannot listen on {host}:{port} ([gateway] direct_port): {err.strerror}; "
            "choose a free port or leave direct_port unset"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Listener:
    """Serves ``app`` on a bound socket until :meth:`close`."""

    def __init__(self, app, sock: socket.socket) -> None:
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=75)
        self.server, self.sock = _Server(config), sock
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close()
