"""Connecting to NATS the way the settings say: given URLs with credentials and TLS, or the embedded server.

`connect(settings)` is the one place a sessionlog process opens its NATS connection. With `nats_url` unset it
starts the embedded nats-server on `embedded_port` with its store under `data_dir` (or reuses one that already
listens there, started by another sessionlog process), and stops what it started when the interpreter exits.
Every connection is refused, and closed, when the server is older than 2.11.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from sessionlog import natsheaders
from sessionlog.embedded import LOOPBACK, EmbeddedServer, check_version, port_open
from sessionlog.errors import LogUnavailable, ServerStartFailed
from sessionlog.settings import Settings

logger = logging.getLogger(__name__)

# Tries per server of the first connect (nats-py counts retries: 1 means two tries, reconnect_time_wait apart).
_INITIAL_CONNECT_ATTEMPTS = 1

_EMBEDDED: dict[tuple[int, Path], EmbeddedServer | OrphanedServer] = {}
_EMBEDDED_LOCK = threading.Lock()


# Per connection made by `connect`: who else hears its asynchronous errors (`on_error`).
_LISTENERS: weakref.WeakKeyDictionary[Client, list[Callable[[Exception], None]]] = weakref.WeakKeyDictionary()


def on_error(nc: Client, listener: Callable[[Exception], None]) -> bool:
    """Have `listener` called (synchronously, before the connection's own handling) with every asynchronous error
    the server reports on `nc`, a permissions violation for instance: the error arrives in order with the
    connection's other traffic, so a reply that comes after it finds the listener called. False when `nc` was not
    made by `connect` (nothing would call the listener)."""
    listeners = _LISTENERS.get(nc)
    if listeners is None:
        return False
    listeners.append(listener)
    return True


def embedded_store_dir(settings: Settings) -> Path:
    return settings.data_dir / "nats"


def owner_file(settings: Settings) -> Path:
    """Which process started the embedded server of `settings.data_dir` (its pid, the server's pid, the port)."""
    return settings.data_dir / "nats-server.owner.json"


class OrphanedServer:
    """An embedded nats-server whose owner died without stopping it (kill -9), taken on by `adopt_orphaned_embedded`:
    stopped like one this process started."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.started = _start_time(pid)  # a pid is reused once its process has gone: this tells them apart

    @property
    def running(self) -> bool:
        return self._ours()

    def _ours(self) -> bool:
        """Whether the process at its pid is still the server taken on (alive, and started when it did)."""
        return self.started is not None and _alive(self.pid) and _start_time(self.pid) == self.started

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a clean JetStream shutdown), then SIGKILL if it has not exited within `timeout`; nothing once
        the process at its pid is another one."""
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not self._ours():
                return
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._ours():
                time.sleep(0.05)


def _start_time(pid: int) -> str | None:
    """When the process at `pid` started (clock ticks since boot, from /proc), or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has exited
    except OSError:
        return True  # no /proc to tell


def adopt_orphaned_embedded(settings: Settings) -> OrphanedServer | None:
    """Take on the embedded server of this data folder when the process that started it is gone (`sessionlog up`
    killed with -9 leaves it running, and the next one used it and never stopped it): it is stopped with this
    process's embedded servers (`stop_embedded`) from now on. The server, or None when there is no such orphan (no
    owner file, its owner alive, or the process at that pid not this folder's nats-server)."""
    try:
        record = json.loads(owner_file(settings).read_text())
        pid, owner, port = int(record["pid"]), int(record["owner"]), int(record["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if port != settings.embedded_port or owner == os.getpid() or _alive(owner):
        return None
    try:  # gone, or the pid reused by now: it must be a nats-server of this very store folder
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if str(embedded_store_dir(settings)).encode() not in argv:
        return None
    key = (settings.embedded_port, settings.data_dir.resolve())
    orphan = OrphanedServer(pid)
    if not orphan.running:
        return None
    with _EMBEDDED_LOCK:
        _EMBEDDED[key] = orphan
    _write_owner(settings, pid)
    logger.warning("adopted the embedded nats-server (pid %d) that a killed process %d left running", pid, owner)
    return orphan


def _write_owner(settings: Settings, pid: int) -> None:
    record = {"pid": pid, "owner": os.getpid(), "port": settings.embedded_port}
    owner_file(settings).write_text(json.dumps(record) + "\n")


def ensure_embedded(settings: Settings) -> str:
    """Start the embedded server unless one listens on `embedded_port` already; return its URL. Blocking."""
    key = (settings.embedded_port, settings.data_dir.resolve())
    url = f"nats://{LOOPBACK}:{settings.embedded_port}"
    with _EMBEDDED_LOCK:
        server = _EMBEDDED.get(key)
        if server is not None and server.running:
            return url
        if port_open(LOOPBACK, settings.embedded_port):
            return url  # another sessionlog process runs it; the version check on connect still applies
        server = EmbeddedServer(
            embedded_store_dir(settings),
            port=settings.embedded_port,
            binary=settings.embedded_binary,
            server_name="sessionlog-embedded",
            log_path=settings.data_dir / "nats-server.log",
        )
        try:
            server.start()
        except ServerStartFailed:
            if port_open(LOOPBACK, settings.embedded_port):
                return url  # lost a start race with another process: use the winner's server
            raise
        _EMBEDDED[key] = server
        if server.pid is not None:
            _write_owner(settings, server.pid)
        return url


def stop_embedded() -> None:
    """Stop every embedded server this process started (they stop at interpreter exit anyway)."""
    with _EMBEDDED_LOCK:
        servers = list(_EMBEDDED.values())
        _EMBEDDED.clear()
    for server in servers:
        server.stop()


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """An SSL context from the TLS settings, or None when none is set (a `tls://` URL then uses the defaults)."""
    if settings.nats_tls_ca is None and settings.nats_tls_cert is None:
        return None
    context = ssl.create_default_context(
        purpose=ssl.Purpose.SERVER_AUTH, cafile=str(settings.nats_tls_ca) if settings.nats_tls_ca else None
    )
    if settings.nats_tls_cert is not None and settings.nats_tls_key is not None:
        context.load_cert_chain(str(settings.nats_tls_cert), str(settings.nats_tls_key))
    return context


def connect_options(settings: Settings) -> dict[str, Any]:
    """The nats-py `connect()` keyword arguments for credentials, TLS and timeouts (servers excluded)."""
    options: dict[str, Any] = {"connect_timeout": settings.request_timeout_s}
    if settings.nats_creds is not None:
        options["user_credentials"] = str(settings.nats_creds)
    if settings.nats_user is not None:
        options["user"] = settings.nats_user
        if settings.nats_password is not None:
            options["password"] = settings.nats_password.get_secret_value()
    if settings.nats_token is not None:
        options["token"] = settings.nats_token.get_secret_value()
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    return options


async def connect(settings: Settings | None = None, *, name: str = "sessionlog", **overrides: Any) -> Client:
    """Open a NATS connection as the settings say, and refuse (ServerTooOld) a server older than 2.11.

    A server that cannot be reached is LogUnavailable within a few seconds (nats-py alone would retry its
    initial connect for two minutes); once connected, the client reconnects for as long as it lives unless
    `max_reconnect_attempts` says otherwise. `overrides` go to nats-py's `connect()` as they are.
    """
    settings = settings if settings is not None else Settings()
    servers = settings.nats_servers()
    if not servers:
        servers = [await asyncio.to_thread(ensure_embedded, settings)]
    reconnect_attempts = overrides.pop("max_reconnect_attempts", -1)
    user_error_cb = overrides.pop("error_cb", None)
    last_error: list[BaseException] = []
    nc_connected = False
    made: list[Client] = []

    async def error_cb(err: Exception) -> None:
        last_error[:] = [err]
        for listener in _LISTENERS.get(made[0], ()) if made else ():
            listener(err)
        if user_error_cb is not None:
            await user_error_cb(err)
        else:
            # A failed first connect is reported once, in its LogUnavailable (the CLI's one error line).
            level = logging.WARNING if nc_connected else logging.DEBUG
            logger.log(level, "nats: %s", err or type(err).__name__)

    options = {
        **connect_options(settings),
        "name": name,
        "error_cb": error_cb,
        "max_reconnect_attempts": _INITIAL_CONNECT_ATTEMPTS,
        **overrides,
    }
    try:
        nc = await nats.connect(servers=servers, **options)
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        cause = last_error[0] if last_error else exc
        raise LogUnavailable(
            f"cannot connect to NATS at {', '.join(servers)}: {cause or type(cause).__name__}"
        ) from cause
    nc_connected = True
    natsheaders.install(nc)
    _LISTENERS[nc] = []
    made.append(nc)
    # nats-py reads this option on every reconnect, so the bounded first attempt does not bound later ones.
    nc.options["max_reconnect_attempts"] = reconnect_attempts
    try:
        where = nc.connected_url.netloc if nc.connected_url is not None else ",".join(servers)
        check_version(str(nc._server_info.get("version", "")), what=f"nats-server at {where}")
    except BaseException:
        await nc.close()
        raise
    return nc
