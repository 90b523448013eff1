"""`sessionlog serve gateway`: the gateway as a service of the process stack (`sessionlog.services`).

The stack owns the NATS connection and the process's health and metrics server; the gateway serves HTTP on
`gateway_host:gateway_port` in the same event loop and reports its metrics into the process registry.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from prometheus_client import REGISTRY

from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .app import Gateway, build_app
from .config import GatewayConfig
from .metrics import GatewayMetrics
from .serving import serve_app

_process_metrics: GatewayMetrics | None = None


def process_metrics() -> GatewayMetrics:
    """The gateway's metrics in the process registry (created once: a registry refuses duplicate names)."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = GatewayMetrics(REGISTRY)
    return _process_metrics


class GatewayService:
    def __init__(self, log: SessionLog, config: GatewayConfig) -> None:
        self.log = log
        self.config = config
        self.app = build_app(log.settings, config, log=log, metrics=process_metrics())
        self.gateway: Gateway = self.app.state.gateway
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(serve_app(self.app, self.config.host, self.config.port), name="gateway")
        await asyncio.sleep(0)
        while not self.gateway.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def health(self) -> dict[str, Any]:
        running = self._task is not None and not self._task.done()
        connected = self.log.nc.is_connected
        return {
            "live": running,
            "ready": running and connected,
            "url": f"http://{self.config.host}:{self.config.port}/v1",
            "upstream": self.config.upstream.base_url,
        }


async def start(log: SessionLog, options: RunOptions) -> GatewayService:
    service = GatewayService(log, GatewayConfig.from_settings(log.settings))
    await service.start()
    return service
