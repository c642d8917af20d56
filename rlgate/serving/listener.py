"""A gateway replica's own HTTP listener, beside Ray Serve's proxy.

With ``[gateway] direct_port`` each Gateway replica also serves its app with
uvicorn on that port, in its own event loop: a request then reaches the
replica without the proxy hop (the proxy parses HTTP, then forwards every
request and each body chunk to the replica through Ray calls). Same routes,
same keys, same answers; Serve's proxy keeps serving route prefixes, RL jobs
and the dashboard's view of the app.

The socket is bound with ``SO_REUSEPORT``: a replica replacing another on the
same node binds while the old one drains, and several replicas on one node
share the port (the kernel spreads connections over them). The kernel would
as gladly spread them over two runs' gateways given the same port (each would
answer the other's keys 401), so a port is claimed for one run first
(:func:`claim_port`): a lock file per port that every replica serving it holds
while it lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import tempfile
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescedWrites:
    """A connection's transport whose writes within one turn of the event loop
    leave as one: uvicorn writes a response's head and its body apart, two
    sends, and on loopback each send also runs the receiving side of TCP, which
    was a fifth of a replica's CPU under load. Everything else is the
    transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._pending = transport, loop, []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        data, self._pending = b"".join(self._pending), []
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _Protocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(CoalescedWrites(transport, self.loop))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The replica's process owns its signals (Ray handles them), not this server."""
        yield


def claim_port(port: int, owner: str, folder: str | Path | None = None) -> int:
    """Claim ``port`` on this node for ``owner`` (a run's folder): the replicas of one
    run share it, another run's is refused with a RuntimeError naming the run
    serving it. Returns a file descriptor whose lock is the claim; it lasts until
    the descriptor is closed or the process ends."""
    folder = Path(folder or Path(tempfile.gettempdir()) / f"rlgate-ports-{os.getuid()}")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(folder / "claims.lock", "a") as guard:  # one claim at a time on this node
        fcntl.flock(guard, fcntl.LOCK_EX)
        fd = os.open(folder / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: by replicas of which run?
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            if holder != owner:
                os.close(fd)
                raise RuntimeError(
                    f"port {port} ([gateway] direct_port) is served on this node by another run's gateway "
                    f"({holder}); the kernel would share connections between the two: give this run another port"
                ) from None
        else:  # nobody's: ours
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner.encode(), 0)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while the replica lives
        return fd


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

    def __init__(self, app, sock: socket.socket, claim: int | None = None) -> None:
        config = uvicorn.Config(
            app, http=_Protocol, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=75
        )
        self.server, self.sock, self.claim = _Server(config), sock, claim
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sock.close()
        if self.claim is not None:
            os.close(self.claim)
