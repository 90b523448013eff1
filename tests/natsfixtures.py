"""pytest fixtures and helpers for tests against real nats-server processes.

Load it with `pytest_plugins = ["natsfixtures"]` (in the root conftest.py, or in a test module); importing the
fixtures by name also works but trips ruff's F811 on every test parameter. Async tests that use the
module-scoped `nc` / `js` must run on the module's event loop: mark them
`pytest.mark.asyncio(loop_scope="module")` (a connection cannot move between loops), or set
`asyncio_default_test_loop_scope = "module"` in pyproject.

`nats_server` is one embedded server per test module, on a free port in a temporary folder, killed at the end;
`provisioned` is the log layout provisioned there once, `url` its address and `log` one connection to it. With
`SESSIONLOG_TEST_NATS_URL` set, tests use that server instead and start nothing. With
`SESSIONLOG_TEST_NATS=testcontainers` (and a Docker engine), each module's server is the official NATS image
(`SESSIONLOG_TEST_NATS_IMAGE`, default `nats:2.11`) started by testcontainers. The event stream's subjects are fixed
(`sessionlog.in.*`) and stream subjects may not overlap within an account, so one server holds one log: a test that
needs its own layout (other settings, a mismatch) takes `fresh_server` / `fresh_js`, a server of its own (starting
one takes ~50 ms).
Tests sharing a server use session ids of their own (`new_session_id()`).

PYTEST_DONT_REWRITE: this module holds no assertions, and test modules import its helpers before pytest
loads it as a plugin (`pytest_plugins = ["natsfixtures"]`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from sessionlog.embedded import Cluster, EmbeddedServer
from sessionlog.log import SessionLog
from sessionlog.provision import provision
from sessionlog.settings import Settings
from sessionlog.tasks import cancel_and_wait

TEST_URL_ENV = "SESSIONLOG_TEST_NATS_URL"
TEST_BACKEND_ENV = "SESSIONLOG_TEST_NATS"  # "embedded" (default) or "testcontainers"
TEST_IMAGE_ENV = "SESSIONLOG_TEST_NATS_IMAGE"
DEFAULT_IMAGE = "nats:2.11"
WAIT_S = 10.0  # the bound of every wait for something to happen on the server
CLOSE_S = 5.0  # the bound of draining one connection at teardown


@dataclass(frozen=True)
class ExternalServer:
    """A server the environment provides (SESSIONLOG_TEST_NATS_URL); tests cannot kill or restart it."""

    url: str


class BackendUnavailable(RuntimeError):
    """The test server backend the environment asks for cannot start here."""


def docker_available() -> bool:
    """Whether a Docker engine answers (testcontainers needs one; the CI machines here have none)."""
    try:
        import docker  # type: ignore[import-untyped]
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=3)
        client.ping()
    except Exception:
        return False
    return True


@contextmanager
def container_server(image: str | None = None) -> Iterator[ExternalServer]:
    """The official NATS image with JetStream, started by testcontainers; removed when the block ends."""
    if not docker_available():
        raise BackendUnavailable(
            f"{TEST_BACKEND_ENV}=testcontainers needs the testcontainers package and a running Docker engine, and "
            "none answers here; unset it to use the embedded nats-server"
        )
    from testcontainers.community.nats import NatsContainer  # type: ignore[import-untyped]

    with NatsContainer(image or os.environ.get(TEST_IMAGE_ENV, DEFAULT_IMAGE), jetstream=True) as container:
        yield ExternalServer(container.nats_uri())


def start_server(data_dir: Path, **options: Any) -> EmbeddedServer:
    """An embedded server on free loopback ports in `data_dir`, started and JetStream-ready."""
    return EmbeddedServer(data_dir, **options).start()


def start_cluster(base_dir: Path, *, size: int = 3, name: str | None = None) -> Cluster:
    """A routed loopback cluster, every node healthy (a meta leader is elected). Stop it when done."""
    return Cluster(base_dir, size=size, name=name or f"t{uuid.uuid4().hex[:6]}").start()


def log_settings(url: str, **overrides: Any) -> Settings:
    """Settings for the log at `url`, reading no environment or `.env` (a developer's own must not leak in)."""
    return Settings(_env_file=None, nats_url=url, **overrides)


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer | ExternalServer]:
    url = os.environ.get(TEST_URL_ENV)
    if url:
        yield ExternalServer(url)
        return
    backend = os.environ.get(TEST_BACKEND_ENV, "embedded")
    if backend == "testcontainers":
        with container_server() as container:
            yield container
        return
    if backend != "embedded":
        raise BackendUnavailable(f"{TEST_BACKEND_ENV} must be 'embedded' or 'testcontainers', got {backend!r}")
    server = start_server(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        server.kill()  # test data is throwaway: no clean shutdown needed


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        for server in cluster.servers:
            server.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nc(nats_server: EmbeddedServer | ExternalServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url, connect_timeout=5, max_reconnect_attempts=5)
    try:
        yield client
    finally:
        await client.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def js(nc: Client) -> JetStreamContext:
    return nc.jetstream(timeout=5.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def provisioned(nats_server: EmbeddedServer | ExternalServer, js: JetStreamContext) -> Settings:
    """Settings of the log on the module's server, provisioned (streams, buckets, object store)."""
    settings = log_settings(nats_server.url)
    await provision(js, settings)
    return settings


@pytest.fixture
def url(nats_server: EmbeddedServer | ExternalServer, provisioned: Settings) -> str:
    """The url of the module's provisioned log."""
    return nats_server.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def log(provisioned: Settings) -> AsyncIterator[SessionLog]:
    """One connection to the module's provisioned log, drained at the module's end (bounded: the server may be
    gone by then)."""
    connection = await SessionLog.connect(provisioned)
    try:
        yield connection
    finally:
        await bounded(connection.close(), CLOSE_S)


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A server of the test's own, killed when the test ends."""
    server = start_server(tmp_path / "nats")
    try:
        yield server
    finally:
        server.kill()


@pytest_asyncio.fixture(loop_scope="module")
async def fresh_js(fresh_server: EmbeddedServer) -> AsyncIterator[JetStreamContext]:
    client = await nats.connect(fresh_server.url, connect_timeout=5, max_reconnect_attempts=5)
    try:
        yield client.jetstream(timeout=5.0)
    finally:
        await client.close()


async def bounded(step: Awaitable[Any], timeout: float = WAIT_S) -> None:
    """One teardown step, given `timeout` and then cancelled until it ends; what it raises is logged, not raised
    (`asyncio.wait_for` is not enough: on Python 3.11 it can swallow its own cancel and wait on forever)."""
    task = asyncio.ensure_future(step)
    await asyncio.wait({task}, timeout=timeout)
    await cancel_and_wait(task)


async def reconnect_stopped(nc: Client) -> None:
    """nats-py's reconnect task can swallow the cancel of `close()` (asyncio.wait_for on Python 3.11) and then
    retry a dead server forever, which would hang the module loop's shutdown: cancel it until it is gone."""
    task = getattr(nc, "_reconnection_task", None)
    for _ in range(100):
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.sleep(0.02)


def new_session_id(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
