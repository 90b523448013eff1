"""Running services in one process: `sessionlog serve NAME` and `sessionlog serve all`.

Each service is started by a factory `async (log, options) -> handle` where the handle has `stop()` and
`health() -> dict`. Services are imported lazily, so the library does not depend on the service packages.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol

from nats.micro import add_service
from nats.micro.service import EndpointConfig, Service

from .log import SessionLog
from .metrics import HealthServer
from .micro import Handler, Immediate, spawning
from .runner import ProjectionRunner, S
from .settings import Settings
from .tasks import cancel_and_wait

log = logging.getLogger("sessionlog.services")


class ServiceHandle(Protocol):
    async def stop(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


class ProjectionService(Generic[S]):
    """What every projection service shares: its runner, its NATS micro endpoints (a task per request), a start
    that stops whatever it had started when a step fails, and a stop that ends the endpoints, the requests they
    are answering and the runner. A service adds its own steps by extending `_start` and `stop`."""

    def __init__(self, log_: SessionLog, runner: ProjectionRunner[S]) -> None:
        self.log = log_
        self.settings = log_.settings
        self.runner = runner
        self._service: Service | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        await self.runner.start()

    async def _serve_endpoints(
        self,
        name: str,
        description: str,
        group: str,
        endpoints: Mapping[str, Handler],
        immediate: Mapping[str, Immediate] | None = None,
    ) -> None:
        """The micro service `name` with one endpoint per entry, under the subject prefix `group`."""
        self._service = await add_service(
            self.log.nc, name=name, version=importlib.metadata.version("sessionlog"), description=description
        )
        subjects = self._service.add_group(name=group)
        for endpoint, handler in endpoints.items():
            answer = spawning(name, endpoint, handler, self._tasks, (immediate or {}).get(endpoint))
            await subjects.add_endpoint(EndpointConfig(name=endpoint, handler=answer))

    def health(self) -> dict[str, Any]:
        return self.runner.health()

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
            self._service = None
        for task in list(self._tasks):
            await cancel_and_wait(task)
        await self.runner.stop()


@dataclass(frozen=True)
class RunOptions:
    from_seq: int | None = None
    rebuild: bool = False


Factory = Callable[[SessionLog, RunOptions], Awaitable[ServiceHandle]]

# name -> "module:function"; each function is a Factory.
SERVICES: dict[str, str] = {
    "context-deriver": "services.context_deriver.run:start",
    "repairer": "services.repairer.run:start",
    "token-auditor": "services.token_auditor.run:start",
    "ui-replayer": "services.ui_replayer.run:start",
    "gateway": "services.gateway.run:start",
}


def factory(name: str) -> Factory:
    target = SERVICES[name]
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    found: Factory = getattr(module, attr)
    return found


def available() -> list[str]:
    """Services whose package is present in this build."""
    out = []
    for name, target in SERVICES.items():
        module_name = target.partition(":")[0]
        with contextlib.suppress(ImportError):
            if importlib.util.find_spec(module_name) is not None:
                out.append(name)
    return out


class Stack:
    """Services started together on one connection, with one health server."""

    def __init__(self, log_: SessionLog, health: HealthServer | None) -> None:
        self.log = log_
        self.health = health
        self.handles: dict[str, ServiceHandle] = {}

    @classmethod
    async def start(cls, names: list[str], settings: Settings, options: RunOptions | None = None) -> Stack:
        options = options or RunOptions()
        log_ = await SessionLog.connect(settings)
        health = HealthServer(settings.metrics_host, settings.metrics_port) if settings.metrics_port else None
        stack = cls(log_, health)
        try:
            for name in names:
                handle = await factory(name)(log_, options)
                stack.handles[name] = handle
                if health is not None:
                    health.register(name, handle.health)
            if health is not None:
                await health.start()
        except BaseException:
            await stack.stop()
            raise
        return stack

    async def stop(self) -> None:
        for name in reversed(list(self.handles)):
            with contextlib.suppress(Exception):
                await self.handles[name].stop()
        self.handles.clear()
        if self.health is not None:
            await self.health.stop()
        await self.log.close()


async def run_until_signalled(names: list[str], settings: Settings, options: RunOptions, on_ready: Any = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    stack = await Stack.start(names, settings, options)
    try:
        if on_ready is not None:
            on_ready(stack)
        await stop.wait()
    finally:
        await stack.stop()
