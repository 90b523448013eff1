"""Health and Prometheus metrics of a process: one small HTTP server (`/healthz`, `/readyz`, `/metrics`)
that every service of the process reports into."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any, Final

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import SessionLogError

APPLIED: Final = Counter("sessionlog_projection_applied_events_total", "Events applied by a projection", ["projection"])
QUARANTINED: Final = Counter(
    "sessionlog_projection_quarantined_records_total", "Poison records quarantined by a projection", ["projection"]
)
CONSUMER_RESTARTS: Final = Counter(
    "sessionlog_projection_consumer_restarts_total",
    "Times a partition's consumer failed and was started again",
    ["projection", "partition"],
)
LAG_EVENTS: Final = Gauge(
    "sessionlog_projection_lag_events", "Records of a partition not yet applied", ["projection", "partition"]
)
LAG_SECONDS: Final = Gauge(
    "sessionlog_projection_lag_seconds", "Age of the last applied record while behind", ["projection", "partition"]
)
REQUESTS: Final = Counter("sessionlog_service_requests_total", "Requests answered", ["service", "endpoint", "outcome"])
REQUEST_SECONDS: Final = Histogram(
    "sessionlog_service_request_seconds",
    "Time to answer a request",
    ["service", "endpoint"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

HealthCheck = Callable[[], dict[str, Any]]


class PortInUse(SessionLogError):
    """An HTTP port this process was told to serve on is taken."""

    code = "PORT_IN_USE"


class HealthServer:
    """Serves the health of every registered component and the process's Prometheus metrics.

    Port 0 picks a free port (tests); a process whose `metrics_port` setting is 0 does not start one.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._checks: dict[str, HealthCheck] = {}
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    def register(self, name: str, check: HealthCheck) -> None:
        self._checks[name] = check

    def report(self) -> dict[str, Any]:
        parts = {name: check() for name, check in self._checks.items()}
        return {
            "live": all(p.get("live", True) for p in parts.values()),
            "ready": all(p.get("ready", True) for p in parts.values()),
            "components": parts,
        }

    def app(self) -> Starlette:
        async def healthz(_: Request) -> Response:
            report = self.report()
            return JSONResponse(report, status_code=200 if report["live"] else 503)

        async def readyz(_: Request) -> Response:
            report = self.report()
            return JSONResponse(report, status_code=200 if report["ready"] else 503)

        async def metrics(_: Request) -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)])

    async def start(self) -> None:
        # Bind here, so a port in use is one clear error instead of uvicorn's exit.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise PortInUse(
                f"cannot serve health and metrics on {self.host}:{self.port}: {exc.strerror} "
                "(set SESSIONLOG_METRICS_PORT to another port, or 0 for none)"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="sessionlog-health")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5)
