"""`ServerThread`: an ASGI app (the gateway, the scripted provider) on a free loopback port in a thread of its own,
with its own event loop, for tests, benchmarks and the example. A process serves in its own loop with
`sessionlog.asgi.serve_asgi`; both bind the socket before uvicorn starts, so the port is known and never raced for.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import uvicorn

from sessionlog.asgi import bind, uvicorn_config

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else asyncio's (None). Every HTTP hop of the gateway's request path
    is event-loop work (socket reads and writes, callbacks, task switches), which uvloop does in C."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a gateway process's main coroutine on `loop_factory()`'s loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread on a free port; `url` once started."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self._sock = bind(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, **options))
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
