"""Running ASGI apps with uvicorn: in the current event loop until cancelled, or in a background thread.

`serve_app` is what `sessionlog serve gateway` runs; `ServerThread` runs an app (the gateway, the scripted
provider) on a free loopback port in a thread of its own, with its own event loop, for tests, benchmarks and the
example. Sockets are bound before uvicorn starts, so the port is known and never raced for.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Any

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
    # Nagle's algorithm meets delayed ACKs and a small response waits ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _config(app: Any, **options: Any) -> uvicorn.Config:
    options.setdefault("log_level", "warning")
    options.setdefault("access_log", False)
    options.setdefault("lifespan", "on")
    return uvicorn.Config(app, **options)


async def serve_app(app: Any, host: str, port: int, **options: Any) -> None:
    """Serve `app` on host:port until cancelled, then shut down gracefully (lifespan shutdown included)."""
    server = uvicorn.Server(_config(app, **options))
    sock = bind(host, port)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=10)
        raise
    finally:
        sock.close()


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread on a free port; `url` once started."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self._sock = bind(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.server = uvicorn.Server(_config(app, **options))
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self.server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by start()
            self._error = exc
        finally:
            loop.close()

    def start(self, timeout_s: float = 15.0) -> ServerThread:
        self._thread.start()
        deadline = timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or deadline <= 0:
                self.stop()
                raise RuntimeError(f"server on {self.url} did not start: {self._error or 'timeout'}")
            self._thread.join(0.01)
            deadline -= 0.01
        return self

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (to reach state that lives there) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
