"""What every service is built on: `ProjectionService` (a runner plus NATS micro endpoints), the handle a service
factory returns, and the options it is started with.

Each service is started by a factory `async (log, options) -> handle` where the handle has `stop()` and
`health() -> dict`. Starting them (`sessionlog serve`, `up`, the process stack) lives above the library, in
`services/stack.py`: the library never imports a service.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol

from nats.micro import add_service
from nats.micro.service import EndpointConfig, Service

from .contracts import Endpoint, ServiceSpec
from .log import SessionLog
from .micro import Handler, Immediate, spawning
from .runner import ProjectionRunner
from .sessioncache import S
from .tasks import cancel_and_wait


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
        service: ServiceSpec,
        handlers: Mapping[Endpoint[Any, Any], Handler],
        immediate: Mapping[Endpoint[Any, Any], Immediate] | None = None,
    ) -> None:
        """The micro service `service` with one endpoint per handler, each request decoded as its contract says."""
        self._service = await add_service(
            self.log.nc,
            name=service.name,
            version=importlib.metadata.version("sessionlog"),
            description=service.description,
        )
        subjects = self._service.add_group(name=service.group)
        for endpoint, handler in handlers.items():
            answer = spawning(endpoint, handler, self._tasks, (immediate or {}).get(endpoint))
            await subjects.add_endpoint(EndpointConfig(name=endpoint.name, handler=answer))

    def health(self) -> dict[str, Any]:
        return self.runner.health()

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
            self._service = None
        for task in list(self._tasks):
            await cancel_and_wait(task)
        await self.runner.stop()

    async def abort(self) -> None:
        """Stop as a killed process would (tests of failover): the runner aborts, nothing is checkpointed or
        released; requests in flight are left to the connection's end."""
        await self.runner.abort()


@dataclass(frozen=True)
class RunOptions:
    from_seq: int | None = None
    rebuild: bool = False


Factory = Callable[[SessionLog, RunOptions], Awaitable[ServiceHandle]]
