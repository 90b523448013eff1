"""What a test opens on a live log and must close at its end, and how it waits for the log to get somewhere.

`Opened` keeps the connections, writers, runners and services a test opened and stops them all when it ends,
each step bounded, whether or not the server still runs (a test may have killed or frozen it): a teardown never
hangs the module's loop. A module's own stack (`Harness`, `Stack`, `Logs`) subclasses it with what that module
starts (a runner, a deriver, a repairer). `serving` runs one service for a module-scoped fixture.

`ServiceProcess` runs a `sessionlog` command (a service, the scripted provider) as a subprocess of its own.
`eventually` polls until something holds, `outlived_its_ttl` until a writer's lease lived on through its refreshes,
`freeze` stops a server's process, `assert_contiguous` checks a session's records; the event builders live in
`sessiongen`, the servers, the module's `log` and `bounded` (one teardown step that cannot hang) in `natsfixtures`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

import pytest
from natsfixtures import CLOSE_S, WAIT_S, bounded, log_settings, new_session_id, reconnect_stopped

from sessionlog.embedded import free_port
from sessionlog.events import Event
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.record import Record
from sessionlog.runner import ProjectionRunner
from sessionlog.settings import Settings

LEASE_TTL_S = 1.0  # JetStream's per-message TTL counts whole seconds: 1 s is the shortest lease there is


class Service(Protocol):
    """A service as tests start and stop it (every service package's `...Service`)."""

    @property
    def runner(self) -> ProjectionRunner[Any]: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=Service)
R = TypeVar("R", bound=ProjectionRunner[Any])


class Opened:
    """The connections, writers, runners and services one test opened; `aclose()` (or leaving `async with`)
    stops services, then runners, abandons writers and closes connections, each bounded.

    Connections go to `url` unless a call names another, with `defaults` for settings a call does not override."""

    def __init__(self, url: str | None = None, **defaults: Any) -> None:
        self.url = url
        self.defaults = defaults
        self._logs: list[SessionLog] = []
        self._writers: list[SessionWriter] = []
        self._runners: list[ProjectionRunner[Any]] = []
        self._services: list[Service] = []

    def settings(self, url: str | None = None, **overrides: Any) -> Settings:
        target = url or self.url
        assert target is not None, "no server: name one, or open the stack with a url"
        return log_settings(target, **{**self.defaults, **overrides})

    async def connect(self, url: str | None = None, **overrides: Any) -> SessionLog:
        log = await SessionLog.connect(self.settings(url, **overrides))
        self._logs.append(log)
        return log

    async def create(self, log: SessionLog, session_id: str | None = None, **kwargs: Any) -> SessionWriter:
        return self.keep(await log.create(session_id or new_session_id(), **kwargs))

    def keep(self, writer: SessionWriter) -> SessionWriter:
        self._writers.append(writer)
        return writer

    def keep_runner(self, runner: R) -> R:
        self._runners.append(runner)
        return runner

    def keep_service(self, service: S) -> S:
        self._services.append(service)
        return service

    async def aclose(self) -> None:
        for service in self._services:
            await bounded(service.stop())
        for runner in self._runners:
            await bounded(runner.stop())
        for writer in self._writers:
            await bounded(writer.abandon())  # idempotent; a lease left behind expires on its own
        for log in self._logs:
            await bounded(log.close(), CLOSE_S)
            if not log.nc.is_closed:
                await bounded(log.nc.close(), CLOSE_S)
            await reconnect_stopped(log.nc)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@contextlib.asynccontextmanager
async def serving(service: S, timeout: float = WAIT_S) -> AsyncIterator[S]:
    """`service` started and caught up with the stream; stopped (bounded) when the block ends."""
    await service.start()
    try:
        await service.runner.wait_ready(timeout)
        yield service
    finally:
        await bounded(service.stop())


async def eventually(condition: Callable[[], Awaitable[bool]], what: str, timeout: float = WAIT_S) -> None:
    """Poll an async condition until it holds, or fail saying what never happened."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.02)


async def outlived_its_ttl(writer: SessionWriter) -> None:
    """Until the writer's lease was refreshed more than a TTL after the refresh before the call: the write confirmed
    then has expired on the server, and the lease holds only through the refreshes since."""
    keeper = writer.lease
    since = keeper.confirmed_at

    async def refreshed() -> bool:
        return keeper.confirmed_at > since + keeper.lease.ttl_s

    await eventually(refreshed, f"the lease of {writer.session_id} refreshed past its {keeper.lease.ttl_s:g}s TTL")


async def freeze(pid: int) -> None:
    """SIGSTOP a server and wait until the kernel reports every one of its threads stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while True:
        states = [
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in Path(f"/proc/{pid}/task").iterdir()
        ]
        if all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"nats-server {pid} not stopped after SIGSTOP: thread states {states}")
        await asyncio.sleep(0.005)


def assert_contiguous(records: list[Record]) -> None:
    """Each event exactly once: records start at seq 0 and continue each other with no gap or repeat."""
    expected = 0
    for record in records:
        assert record.first_seq == expected, f"record at stream seq {record.stream_seq} starts at {record.first_seq}"
        expected = record.next_seq


def raws(events: list[Event]) -> list[bytes]:
    return [e.raw for e in events]


class ServiceProcess:
    """`python -m sessionlog serve NAME` (or another `sessionlog` command) in a subprocess of its own, with its own
    environment (none of the caller's `SESSIONLOG_` variables), health port and output file in `workdir`.

    `command` replaces `serve NAME` (for example `["scripted-provider", "--script", path, "--port", "8479"]`);
    `wait_ready(url=...)` polls that URL instead of the process's `/readyz` (a server without the metrics port)."""

    def __init__(self, name: str, url: str, workdir: Path, *, command: list[str] | None = None, **env: str) -> None:
        self.name = name
        self.url = url
        self.workdir = workdir
        self.command = command if command is not None else ["serve", name]
        self.metrics_port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
        self.env.update(
            SESSIONLOG_NATS_URL=url,
            SESSIONLOG_METRICS_PORT=str(self.metrics_port),
            SESSIONLOG_LEASE_TTL_S=str(int(LEASE_TTL_S)),
            **env,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *args: str) -> None:
        self.starts += 1
        out = open(self.workdir / f"{self.name}-{self.starts}.log", "wb")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sessionlog", *self.command, *args],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()

    def output(self) -> str:
        return (self.workdir / f"{self.name}-{self.starts}.log").read_text(errors="replace")[-3000:]

    def health(self, path: str = "/readyz", url: str | None = None) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(url or f"http://127.0.0.1:{self.metrics_port}{path}", timeout=1) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, None
        except (OSError, ValueError):
            return 0, None

    async def wait_ready(self, timeout: float = 20.0, *, url: str | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited:\n{self.output()}"
            status, body = await asyncio.to_thread(self.health, url=url)
            if status == 200:
                return dict(body)
            await asyncio.sleep(0.1)
        pytest.fail(f"{self.name} not ready within {timeout}s:\n{self.output()}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        assert self.proc.returncode == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
