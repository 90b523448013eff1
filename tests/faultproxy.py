"""A small TCP proxy between NATS clients and a server that a test controls (fault 5 of issue 15).

`FaultProxy(host, port)` listens on a free loopback port and forwards every connection to the server. The test can:
`drop()` every connection (a FIN each way), `reset()` them (RST: SO_LINGER 0), `stall()` and `resume()` the traffic
(bytes are held, not lost, as on a congested link), and `cut_next_publish(mode)`: the next client frame that
publishes onto the event stream (`HPUB sessionlog.in.`) is cut, with `"mid"` half of it forwarded and the
connection reset (the server never gets the whole record), or with `"ack-lost"` all of it forwarded and the
connection reset before the server's answer reaches the client (the record landed; the client cannot know).
`throttle(bytes_per_s)` makes the link towards the server slow (a busy server: every publish gets through and is
answered, later and later as more queue up); `throttle(None)` lifts it. `publishes` counts the publish frames
that reached the server, repeats included.

PYTEST_DONT_REWRITE: no assertions here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Literal

CutMode = Literal["mid", "ack-lost"]
PUBLISH_MARK = b"HPUB sessionlog.in."


class _Link:
    """One client connection and its server connection."""

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.mute_down = False  # the server's answers are swallowed (ack-lost)
        self.tasks: list[asyncio.Task[None]] = []

    def close(self, *, rst: bool) -> None:
        for side in (self.client, self.server):
            if rst:
                sock = side.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                side.transport.abort()
            else:
                side.close()
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.links: set[_Link] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._cut: CutMode | None = None
        self.cuts_done = 0
        self.rate: float | None = None  # bytes per second towards the server (None: as fast as it goes)
        self.publishes = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._open.set()
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.close(rst=False)
        self.links.clear()

    # ---------------------------------------------------------------------------------------------- faults

    def drop(self) -> int:
        return self._close_all(rst=False)

    def reset(self) -> int:
        return self._close_all(rst=True)

    def stall(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def throttle(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s

    def cut_next_publish(self, mode: CutMode) -> None:
        self._cut = mode

    @property
    def cut_pending(self) -> bool:
        return self._cut is not None

    def _close_all(self, *, rst: bool) -> int:
        links = list(self.links)
        for link in links:
            link.close(rst=rst)
        self.links.clear()
        return len(links)

    # ---------------------------------------------------------------------------------------------- forwarding

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self.connections += 1
        link = _Link(client_w, server_w)
        self.links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, client_r, server_w, upstream=True)),
            asyncio.create_task(self._pump(link, server_r, client_w, upstream=False)),
        ]

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        tail = b""
        try:
            while True:
                rate = self.rate if upstream else None
                # Under a throttle, small reads paced at the rate: the bytes queue in the proxy and the kernel.
                data = await reader.read(65536 if rate is None else max(1, int(rate / 50)))
                if not data:
                    break
                await self._open.wait()
                if upstream:  # a mark split across two reads is counted once, in the second
                    seen = tail + data
                    self.publishes += seen.count(PUBLISH_MARK)
                    tail = seen[-(len(PUBLISH_MARK) - 1) :]
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
                if upstream and self._cut is not None and PUBLISH_MARK in data:
                    mode, self._cut = self._cut, None
                    self.cuts_done += 1
                    if mode == "mid":
                        at = data.index(PUBLISH_MARK)
                        writer.write(data[: at + (len(data) - at) // 2])
                        await writer.drain()
                    else:
                        link.mute_down = True
                        writer.write(data)
                        await writer.drain()
                        await asyncio.sleep(0.2)  # the server stores and answers; the answer is swallowed
                    self.links.discard(link)
                    link.close(rst=True)
                    return
                if not upstream and link.mute_down:
                    continue
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if link in self.links:
                self.links.discard(link)
                link.close(rst=False)
