"""`sessionlog up`: the whole system on one machine (the embedded nats-server unless SESSIONLOG_NATS_URL is
set), every service in one process, until Ctrl-C."""

from __future__ import annotations

import asyncio
from typing import Any

import typer
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from sessionlog.connection import adopt_orphaned_embedded, stop_embedded
from sessionlog.services import RunOptions
from sessionlog.settings import Settings

from ..stack import Stack, available, run_until_signalled


def urls(settings: Settings, stack: Stack | None = None) -> dict[str, str]:
    names = set(stack.handles) if stack is not None else set(available())
    out = {"nats": settings.nats_url or f"nats://127.0.0.1:{settings.embedded_port} (embedded)"}
    if "ui-replayer" in names:
        out["ui"] = f"http://{settings.ui_host}:{settings.ui_port}/"
    if "gateway" in names:
        out["gateway"] = f"http://{settings.gateway_host}:{settings.gateway_port}/v1"
    if settings.metrics_port:
        port = stack.health.port if stack is not None and stack.health is not None else settings.metrics_port
        out["metrics"] = f"http://{settings.metrics_host}:{port}/metrics"
        out["health"] = f"http://{settings.metrics_host}:{port}/readyz"
    return out


def panel(settings: Settings, stack: Stack) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for name, url in urls(settings, stack).items():
        table.add_row(name, url)
    table.add_row("services", ", ".join(stack.handles))
    return Panel(table, title="sessionlog is up", subtitle="Ctrl-C stops everything", expand=False)


def up() -> None:
    """Start the embedded nats-server (unless SESSIONLOG_NATS_URL is set), provision, run every service."""
    settings = Settings()
    console = Console(stderr=True)

    def ready(stack: Any) -> None:
        console.print(panel(settings, stack))

    if settings.nats_url is None and (orphan := adopt_orphaned_embedded(settings)) is not None:
        console.print(f"the embedded nats-server (pid {orphan.pid}) a killed sessionlog up left running is used, and "
                      "stopped with this one")  # fmt: skip
    try:
        asyncio.run(run_until_signalled(available(), settings, RunOptions(), ready))
    finally:
        stop_embedded()
    console.print("sessionlog stopped")


def demo() -> None:
    """Run one agent session through the whole system, offline, and check everything it shows (exit 0 = all
    checks passed)."""
    from ..demo import run_demo

    ok = run_demo()
    stop_embedded()
    raise typer.Exit(0 if ok else 1)


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(demo)
