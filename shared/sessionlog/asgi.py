"""Serving an ASGI app with uvicorn: `serve_asgi`, the one way every HTTP server of the system starts (the gateway,
the ui-replayer, each process's health and metrics server, the scripted provider).

The socket is bound before uvicorn starts, so the port is known (port 0 picks a free one) and a port in use is one
clear `PORT_IN_USE` instead of uvicorn's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn

from .errors import PortInUse


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when the host has a colon); `OSError` when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
    # Nagle's algorithm meets delayed ACKs and a small response waits ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


# How long a stopping server lets its open requests (a long streamed answer) go on before it cancels them and runs
# the app's lifespan shutdown, which must happen before `AsgiServer.stop` gives up on the server (its timeout):
# the gateway's shutdown parks the leases of sessions whose client runs a tool, over the NATS connection that the
# process closes next.
GRACEFUL_SHUTDOWN_S = 7.0
STOP_TIMEOUT_S = 10.0


def uvicorn_config(app: Any, **options: Any) -> uvicorn.Config:
    """Quiet by default (warnings only, no access log); the app's lifespan runs unless `lifespan="off"`; open
    requests are cancelled `GRACEFUL_SHUTDOWN_S` into a shutdown."""
    options.setdefault("log_level", "warning")
    options.setdefault("access_log", False)
    options.setdefault("lifespan", "on")
    options.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    return uvicorn.Config(app, **options)


class AsgiServer:
    """An app being served in the running event loop; `stop()` ends it gracefully (lifespan shutdown included)."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, task: asyncio.Task[None]) -> None:
        self.server = server
        self.host, self.port = sock.getsockname()[:2]
        self._sock = sock
        self.task = task

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def wait(self) -> None:
        """Until the server ends; cancelling this stops the server first."""
        try:
            await asyncio.shield(self.task)
        except asyncio.CancelledError:
            await self.stop()
            raise

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self.task, timeout_s)
        self._sock.close()


async def serve_asgi(app: Any, host: str, port: int, *, name: str, hint: str = "", **options: Any) -> AsgiServer:
    """Serve `app` on host:port in the running loop; returns once it accepts requests (its lifespan startup done).

    `name` says what is served in errors and the task's name; `hint` is the advice a `PORT_IN_USE` carries (which
    setting moves the port). `options` are uvicorn's (see `uvicorn_config`).
    """
    try:
        sock = bind(host, port)
    except OSError as exc:
        advice = f" ({hint})" if hint else ""
        raise PortInUse(f"cannot serve {name} on {host}:{port}: {exc.strerror}{advice}") from None
    server = uvicorn.Server(uvicorn_config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]), name=name)
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # the server's own failure, if it raised one
            raise RuntimeError(f"{name} on {host}:{port} stopped before it started (see its log)")
        await asyncio.sleep(0.01)
    return AsgiServer(server, sock, task)


async def serve_until_cancelled(app: Any, host: str, port: int, **options: Any) -> None:
    """Serve `app` until this is cancelled, then shut it down gracefully (a process's main task)."""
    server = await serve_asgi(app, host, port, name=options.pop("name", f"http {host}:{port}"), **options)
    await server.wait()
