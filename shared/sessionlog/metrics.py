"""Health and Prometheus metrics of a process: one small HTTP server (`/healthz`, `/readyz`, `/metrics`)
that every service of the process reports into."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .asgi import AsgiServer, serve_asgi

APPLIED: Final = Counter("sessionlog_projection_applied_events_total", "Events applied by a projection", ["projection"])
QUARANTINED: Final = Counter(
    "sessionlog_projection_quarantined_records_total", "Poison records quarantined by a projection", ["projection"]
)
CONSUMER_RESTARTS: Final = Counter(
    "sessionlog_projection_consumer_restarts_total",
    "Times a partition's consumer failed and was started again",
    ["projection", "partition"],
)
KV_WRITE_FAILURES: Final = Counter(
    "sessionlog_projection_kv_write_failures_total",
    "Checkpoint and quarantine writes that failed (logged; a later checkpoint covers a failed one)",
    ["projection", "kind"],
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


class HealthServer:
    """Serves the health of every registered component and the process's Prometheus metrics.

    Port 0 picks a free port (tests); a process whose `metrics_port` setting is 0 does not start one.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._checks: dict[str, HealthCheck] = {}
        self._server: AsgiServer | None = None

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
        self._server = await serve_asgi(
            self.app(),
            self.host,
            self.port,
            name="health and metrics",
            hint="set SESSIONLOG_METRICS_PORT to another port, or 0 for none",
            lifespan="off",
        )
        self.port = self._server.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(timeout_s=5)
            self._server = None
