"""`sessionlog serve gateway`: the gateway as a service of the process stack (`services.stack`).

The stack owns the NATS connection and the process's health and metrics server; the gateway serves HTTP on
`gateway_host:gateway_port` in the same event loop and reports its metrics into the process registry.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from sessionlog.asgi import AsgiServer, serve_asgi
from sessionlog.log import SessionLog
from sessionlog.services import RunOptions

from .app import Gateway, build_app
from .config import GatewayConfig
from .metrics import GatewayMetrics

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
        self._server: AsgiServer | None = None

    async def start(self) -> None:
        self._server = await serve_asgi(
            self.app, self.config.host, self.config.port, name="the gateway", hint="set SESSIONLOG_GATEWAY_PORT"
        )

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def health(self) -> dict[str, Any]:
        running = self._server is not None and not self._server.task.done()
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
