"""Running services in one process: `sessionlog serve NAME`, `sessionlog serve all` and `sessionlog up`.

A layer above both the library and the services: `SERVICES` names each service's factory (`services.NAME.run:start`,
imported only when that service starts) and `Stack` runs some of them on one connection with one health server.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import signal
from typing import Any

from sessionlog.log import SessionLog
from sessionlog.metrics import HealthServer
from sessionlog.process import tune_gc
from sessionlog.services import Factory, RunOptions, ServiceHandle
from sessionlog.settings import Settings

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
        health = HealthServer(settings.metrics_host, settings.metrics_port) if settings.metrics_port else None
        if health is not None:
            # Answering from the first moment, before the log is reached: each service live and not ready until it
            # has started (a liveness probe does not kill a process that is starting or waiting for its server); a
            # port in use fails before anything else is done.
            for name in names:
                health.register(name, _starting)
            await health.start()
        try:
            log_ = await SessionLog.connect(settings)
        except BaseException:
            if health is not None:
                await health.stop()
            raise
        stack = cls(log_, health)
        async with contextlib.AsyncExitStack() as on_failure:
            on_failure.push_async_callback(stack.stop)  # a service that does not start stops those before it
            for name in names:
                handle = await factory(name)(log_, options)
                stack.handles[name] = handle
                if health is not None:
                    health.register(name, handle.health)
            on_failure.pop_all()
        return stack

    async def stop(self) -> None:
        for name in reversed(list(self.handles)):
            with contextlib.suppress(Exception):
                await self.handles[name].stop()
        self.handles.clear()
        if self.health is not None:
            await self.health.stop()
        await self.log.close()


def _starting() -> dict[str, Any]:
    """A service's health until it has started."""
    return {"live": True, "ready": False, "state": "starting"}


async def run_until_signalled(names: list[str], settings: Settings, options: RunOptions, on_ready: Any = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    stack = await Stack.start(names, settings, options)
    tune_gc()  # a long-running process: what was started now lives as long as it does
    try:
        if on_ready is not None:
            on_ready(stack)
        await stop.wait()
    finally:
        await stack.stop()
