"""The ui-replayer's live updates as server-sent events: a session's transcript as its records are applied (or, for a
session another replica owns, as they arrive on the stream), and the fleet overview's rows as they change.

A session's events are `entry`, `delta` and `sync`, each with the seq seen so far as its `id`, so a reconnect
(`Last-Event-ID`) resumes exactly; a tail that falls `LISTENER_QUEUE` batches behind gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sessionlog.record import Record
from sessionlog.transcript import EntryUpdate, TranscriptBuilder, Update, coalesce

from .pages import SECURITY_HEADERS
from .routes import int_param

if TYPE_CHECKING:
    from .service import UIReplayerService

KEEPALIVE_S: Final = 15.0
LISTENER_QUEUE: Final = 1024  # record batches a slow page may fall behind by before it is resynchronised
FLEET_QUEUE: Final = 64  # changed-row batches of one open overview
FLEET_ROWS: Final = 200  # rows one `rows` event carries at most

_encoder: Final = msgspec.json.Encoder()
_STREAM_HEADERS: Final = {"cache-control": "no-cache", "x-accel-buffering": "no", **SECURITY_HEADERS}


@dataclass(eq=False)
class Listener:
    """One open live tail: the updates not yet sent, and the seq it has seen everything before."""

    seen: int
    queue: asyncio.Queue[list[Update]] = field(default_factory=lambda: asyncio.Queue(LISTENER_QUEUE))
    behind: bool = False  # its queue overflowed: it gets a fresh snapshot

    def offer(self, updates: list[Update]) -> None:
        """Queue what a record changed; a full queue marks the tail behind and wakes it."""
        if self.behind:
            return
        try:
            self.queue.put_nowait(updates)
        except asyncio.QueueFull:
            self.behind = True
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait([])  # wake it up


def sse(event: str, data: bytes, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\n".encode() + b"data: " + data + b"\n\n"


def _update_bytes(update: Update) -> bytes:
    if isinstance(update, EntryUpdate):
        return sse("entry", _encoder.encode(update.entry), update.seq + 1)
    return sse("delta", _encoder.encode(update), update.seq + 1)


def _wake(queues: Iterable[asyncio.Queue[Any]]) -> None:
    for queue in queues:
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait([])


async def _next(records: AsyncIterator[Record]) -> Record:
    return await anext(records)


class LiveTails:
    """The live tails a UI serves: `session_events` and `fleet_events` answer an SSE request; `close` ends them all
    (so the server can close their connections)."""

    def __init__(self, ui: UIReplayerService) -> None:
        self.ui = ui
        self.closing = asyncio.Event()

    def count(self) -> int:
        return sum(len(v) for v in self.ui.projection.listeners.values())

    def close(self) -> None:
        self.closing.set()
        for listeners in self.ui.projection.listeners.values():
            _wake(listener.queue for listener in listeners)
        _wake(self.ui.fleet.listeners)

    # ---------------------------------------------------------------------------------- the fleet

    async def fleet_events(self, request: Request) -> Response:
        """Rows of the overview that changed, as SSE `rows` events (JSON list), while the page is open."""
        return StreamingResponse(self._fleet_tail(), media_type="text/event-stream", headers=_STREAM_HEADERS)

    async def _fleet_tail(self) -> AsyncIterator[bytes]:
        fleet = self.ui.fleet
        queue: asyncio.Queue[list[str]] = asyncio.Queue(FLEET_QUEUE)
        fleet.listeners.add(queue)
        try:
            yield sse("sync", _encoder.encode({"sessions": len(fleet.rows)}))
            while not self.closing.is_set():
                try:
                    changed = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                rows = [fleet.rows[i] for i in changed if i in fleet.rows][:FLEET_ROWS]
                if rows:
                    yield sse("rows", _encoder.encode(await self.ui.enriched(rows)))
        finally:
            fleet.listeners.discard(queue)

    # ---------------------------------------------------------------------------------- a session

    async def session_events(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        await self.ui.header(session_id)
        from_seq = int_param(request, "from_seq") or 0
        last_id = request.headers.get("last-event-id", "")
        if last_id.isdigit():
            from_seq = int(last_id)  # a reconnect: it has seen everything before this seq
        stream = self._tail(session_id, from_seq)
        return StreamingResponse(stream, media_type="text/event-stream", headers=_STREAM_HEADERS)

    async def _tail(self, session_id: str, from_seq: int) -> AsyncIterator[bytes]:
        """Entries after `from_seq`, then every update as its record is applied, until the client leaves."""
        runner = self.ui.runner
        if not runner.owns(session_id):
            async for chunk in self._tail_stream(session_id, from_seq):
                yield chunk
            return
        listener = Listener(seen=from_seq)
        yield b": live tail\n\n"
        state = await runner.session_at(session_id)
        # No await between the snapshot and registering: no record can slip between them.
        listeners = self.ui.projection.listeners.setdefault(session_id, set())
        listeners.add(listener)
        try:
            if state is not None:
                for chunk in self._snapshot(state.builder, listener):
                    yield chunk
            while not self.closing.is_set():
                try:
                    batch = await asyncio.wait_for(listener.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                if listener.behind:
                    listener.behind = False
                    while not listener.queue.empty():
                        listener.queue.get_nowait()
                    current = await runner.session_at(session_id)
                    if current is not None:
                        for chunk in self._snapshot(current.builder, listener):
                            yield chunk
                    continue
                out = self._fresh(batch, listener)
                if out:
                    yield out
        finally:
            listeners.discard(listener)
            if not listeners:
                self.ui.projection.listeners.pop(session_id, None)

    @staticmethod
    def _snapshot(builder: TranscriptBuilder, listener: Listener) -> list[bytes]:
        entries = builder.snapshot().since(listener.seen)
        listener.seen = max(listener.seen, builder.next_seq)
        out = [sse("entry", _encoder.encode(e)) for e in entries]
        out.append(sse("sync", _encoder.encode({"next_seq": listener.seen}), listener.seen))
        return out

    @staticmethod
    def _fresh(batch: list[Update], listener: Listener) -> bytes:
        """The updates of a batch the listener has not seen (a reloaded session replays from seq 0)."""
        fresh = [u for u in batch if u.seq >= listener.seen]
        if not fresh:
            return b""
        listener.seen = max(listener.seen, fresh[-1].seq + 1)
        return b"".join(_update_bytes(u) for u in coalesce(fresh))

    async def _tail_stream(self, session_id: str, from_seq: int) -> AsyncIterator[bytes]:
        """The live tail of a session another replica owns: read it and follow it on the stream."""
        yield b": live tail (stream)\n\n"
        state = await self.ui.runner.sessions.read(session_id)  # its own: followed here, never shared
        state.updates = []
        session, builder, last_stream_seq = state.session, state.builder, state.last_stream_seq
        builder.live = True  # read quietly (no page tailed it here); followed with its updates from now on
        listener = Listener(seen=from_seq)
        for chunk in self._snapshot(builder, listener):
            yield chunk
        records = self.ui.log.reader.subscribe(session_id=session_id, from_stream_seq=last_stream_seq + 1)
        pending: asyncio.Task[Record] | None = None
        try:
            while not self.closing.is_set():
                if pending is None:
                    pending = asyncio.ensure_future(_next(records))
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not done:
                    yield b": ping\n\n"
                    continue
                record = pending.result()
                pending = None
                if record.first_seq != len(session):
                    continue  # already read
                updates: list[Update] = []
                for raw in record.events:
                    updates.extend(builder.add(session.append(raw)))
                out = self._fresh(updates, listener)
                if out:
                    yield out
        finally:
            if pending is not None:
                pending.cancel()
            with contextlib.suppress(Exception):
                await records.aclose()  # type: ignore[attr-defined]
