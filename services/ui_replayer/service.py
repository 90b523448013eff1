"""The ui-replayer projection and its HTTP app (Starlette on uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sessionlog.errors import InvalidBoundary, SessionLogError, SessionNotFound
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.metrics import PortInUse
from sessionlog.record import Record
from sessionlog.runner import Projection, ProjectionRunner, SessionState
from sessionlog.services import ProjectionService
from sessionlog.session import Session
from sessionlog.transcript import (
    EntryUpdate,
    Transcript,
    TranscriptBuilder,
    Update,
    build_transcript,
    coalesce,
)

from .page import (
    APP_CSS,
    APP_JS,
    SECURITY_HEADERS,
    render_error_page,
    render_session_list,
    render_transcript_page,
)

log = logging.getLogger("sessionlog.ui_replayer")

KEEPALIVE_S: Final = 15.0
LISTENER_QUEUE: Final = 1024  # record batches a slow page may fall behind by before it is resynchronised
MAX_HEADERS: Final = 10_000

_encoder: Final = msgspec.json.Encoder()


class UIState(SessionState):
    """One session's validated log and its transcript; `updates` holds what the last records changed."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session = Session()
        self.builder = TranscriptBuilder(session_id)
        self.updates: list[Update] = []

    def apply(self, record: Record) -> None:
        session = self.session
        add = self.builder.add
        updates = self.updates
        for raw in record.events:
            updates.extend(add(session.append(raw)))


@dataclass(eq=False)
class _Listener:
    """One open live tail: the updates not yet sent, and the seq it has seen everything before."""

    seen: int
    queue: asyncio.Queue[list[Update]] = field(default_factory=lambda: asyncio.Queue(LISTENER_QUEUE))
    behind: bool = False  # its queue overflowed: it gets a fresh snapshot


class UIReplayer(Projection[UIState]):
    name: ClassVar[str] = "ui-replayer"

    def __init__(self) -> None:
        self.listeners: dict[str, set[_Listener]] = {}
        # The service's cache of session headers; kept here so that a purge (`on_forget`) drops the header too,
        # or the erased session would still be found (and its header served) after its records are gone.
        self.headers: OrderedDict[str, bytes] = OrderedDict()

    def new_state(self, session_id: str) -> UIState:
        return UIState(session_id)

    def on_forget(self, session_id: str) -> None:
        self.headers.pop(session_id, None)

    def on_applied(self, state: UIState, record: Record) -> None:
        updates, state.updates = state.updates, []
        listeners = self.listeners.get(state.session_id)
        if not listeners or not updates:
            return
        for listener in listeners:
            if listener.behind:
                continue
            try:
                listener.queue.put_nowait(updates)
            except asyncio.QueueFull:
                listener.behind = True
                with contextlib.suppress(asyncio.QueueFull):
                    listener.queue.put_nowait([])  # wake it up


def _sse(event: str, data: bytes, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\n".encode() + b"data: " + data + b"\n\n"


def _update_bytes(update: Update) -> bytes:
    if isinstance(update, EntryUpdate):
        return _sse("entry", _encoder.encode(update.entry), update.seq + 1)
    return _sse("delta", _encoder.encode(update), update.seq + 1)


async def _next(records: AsyncIterator[Record]) -> Record:
    return await anext(records)


def _int_param(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise InvalidBoundary(f"query parameter {name} must be a non-negative integer, got {value!r}")
    return int(value)


class UIReplayerService(ProjectionService[UIState]):
    """The projection runner plus the HTTP app: session list, transcript page, live tail (SSE) and JSON."""

    def __init__(
        self, log_: SessionLog, *, host: str | None = None, port: int | None = None, **runner_options: Any
    ) -> None:
        self.projection = UIReplayer()
        super().__init__(log_, ProjectionRunner(log_, self.projection, **runner_options))
        self.host = host if host is not None else self.settings.ui_host
        self.port = port if port is not None else self.settings.ui_port
        self._headers = self.projection.headers
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.app = self.build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---------------------------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        await super()._start()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it every
        # response (headers and body are two writes) waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise PortInUse(
                f"cannot serve the ui-replayer on {self.host}:{self.port}: {exc.strerror} "
                "(set SESSIONLOG_UI_PORT to another port)"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="ui-replayer-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        log.info("ui-replayer on %s", self.url)

    def health(self) -> dict[str, Any]:
        health = super().health()
        health["url"] = self.url
        health["live_tails"] = sum(len(v) for v in self.projection.listeners.values())
        return health

    async def stop(self) -> None:
        self._closing.set()  # live tails end, so the server can close their connections
        for listeners in self.projection.listeners.values():
            for listener in listeners:
                with contextlib.suppress(asyncio.QueueFull):
                    listener.queue.put_nowait([])
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 10)
        await super().stop()

    # ---------------------------------------------------------------------------------- sessions

    async def header(self, session_id: str) -> bytes:
        """The session header (cached: a header never changes once the session is visible)."""
        check_session_id(session_id)
        header = self._headers.get(session_id)
        if header is None:
            header = await self.log.header(session_id)
            if header is None:
                raise SessionNotFound(f"session {session_id} not found")
            self._headers[session_id] = header
            while len(self._headers) > MAX_HEADERS:
                self._headers.popitem(last=False)
        else:
            self._headers.move_to_end(session_id)
        return header

    async def _session_state(self, session_id: str) -> tuple[Session, TranscriptBuilder, int]:
        """The session, its transcript builder and the stream seq they reflect; from memory when this replica owns
        the session, else read from the stream."""
        if self.runner.owns(session_id):
            state = await self.runner.state(session_id)
            if state is not None:
                return state.session, state.builder, state.last_stream_seq
            return Session(), TranscriptBuilder(session_id), 0
        records = await self.log.reader.records(session_id)
        session = Session()
        builder = TranscriptBuilder(session_id)
        for record in records:
            for raw in record.events:
                builder.add(session.append(raw))
        return session, builder, records[-1].stream_seq if records else 0

    async def transcript(self, session_id: str, *, at: int | None = None) -> Transcript:
        """The transcript now, or of the prefix ending at seq `at` (inclusive): a replay from any offset."""
        header = await self.header(session_id)
        session, builder, _ = await self._session_state(session_id)
        if at is None:
            return builder.snapshot(header)
        if at >= len(session):
            raise InvalidBoundary(f"at {at} is past the end of session {session_id} ({len(session)} events)")
        return build_transcript(session.prefix(at), header, session_id=session_id)

    # ---------------------------------------------------------------------------------- HTTP

    def build_app(self) -> Starlette:
        routes = [
            Route("/", self._list),
            Route("/sessions/{session_id}", self._page),
            Route("/sessions/{session_id}/events", self._events),
            Route("/api/sessions", self._api_list),
            Route("/api/sessions/{session_id}/transcript", self._api_transcript),
            Route("/static/app.js", self._js),
            Route("/static/app.css", self._css),
            Route("/healthz", self._healthz),
        ]
        return Starlette(routes=routes, exception_handlers={SessionLogError: self._error})

    async def _error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SessionLogError)
        status = 404 if isinstance(exc, SessionNotFound) else 400 if exc.code.startswith("INVALID") else 503
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.to_dict()}, status_code=status)
        return HTMLResponse(render_error_page(status, str(exc)), status_code=status, headers=SECURITY_HEADERS)

    async def _titles(self) -> dict[str, str]:
        return {sid: s.builder.title for sid, s in self.runner.states.items() if s.builder.title}

    async def _matching(self, query: str) -> tuple[list[Any], dict[str, str]]:
        infos = await self.log.sessions()  # newest first
        titles = await self._titles()
        needle = query.strip().lower()
        if needle:
            infos = [
                i
                for i in infos
                if needle in i.id.lower()
                or needle in (i.parent or "").lower()
                or needle in titles.get(i.id, "").lower()
            ]
        return infos, titles

    async def _list(self, request: Request) -> Response:
        query = request.query_params.get("q", "")
        infos, titles = await self._matching(query)
        return HTMLResponse(render_session_list(infos, titles=titles, query=query), headers=SECURITY_HEADERS)

    async def _api_list(self, request: Request) -> Response:
        infos, titles = await self._matching(request.query_params.get("q", ""))
        body = [{**dataclasses.asdict(i), "title": titles.get(i.id)} for i in infos]
        return Response(_encoder.encode(body), media_type="application/json")

    async def _page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = _int_param(request, "at")
        transcript = await self.transcript(session_id, at=at)
        html = render_transcript_page(transcript, live=at is None, at=at)
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    async def _api_transcript(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = _int_param(request, "at")
        from_seq = _int_param(request, "from_seq") or 0
        transcript = await self.transcript(session_id, at=at)
        if from_seq:
            transcript = msgspec.structs.replace(transcript, entries=transcript.since(from_seq))
        return Response(_encoder.encode(transcript), media_type="application/json")

    async def _js(self, request: Request) -> Response:
        return Response(APP_JS, media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)

    async def _css(self, request: Request) -> Response:
        return Response(APP_CSS, media_type="text/css; charset=utf-8", headers=SECURITY_HEADERS)

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse(self.health())

    # ---------------------------------------------------------------------------------- live tail

    async def _events(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        await self.header(session_id)
        from_seq = _int_param(request, "from_seq") or 0
        last_id = request.headers.get("last-event-id", "")
        if last_id.isdigit():
            from_seq = int(last_id)  # a reconnect: it has seen everything before this seq
        stream = self._tail(session_id, from_seq)
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **SECURITY_HEADERS}
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def _tail(self, session_id: str, from_seq: int) -> AsyncIterator[bytes]:
        """Entries after `from_seq`, then every update as its record is applied, until the client leaves."""
        if not self.runner.owns(session_id):
            async for chunk in self._tail_stream(session_id, from_seq):
                yield chunk
            return
        listener = _Listener(seen=from_seq)
        yield b": live tail\n\n"
        state = await self.runner.state(session_id)
        # No await between the snapshot and registering: no record can slip between them.
        listeners = self.projection.listeners.setdefault(session_id, set())
        listeners.add(listener)
        try:
            if state is not None:
                for chunk in self._snapshot(state.builder, listener):
                    yield chunk
            while not self._closing.is_set():
                try:
                    batch = await asyncio.wait_for(listener.queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                if listener.behind:
                    listener.behind = False
                    while not listener.queue.empty():
                        listener.queue.get_nowait()
                    current = self.runner.states.get(session_id) or await self.runner.state(session_id)
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
                self.projection.listeners.pop(session_id, None)

    def _snapshot(self, builder: TranscriptBuilder, listener: _Listener) -> list[bytes]:
        entries = builder.snapshot().since(listener.seen)
        listener.seen = max(listener.seen, builder.next_seq)
        out = [_sse("entry", _encoder.encode(e)) for e in entries]
        out.append(_sse("sync", _encoder.encode({"next_seq": listener.seen}), listener.seen))
        return out

    @staticmethod
    def _fresh(batch: list[Update], listener: _Listener) -> bytes:
        """The updates of a batch the listener has not seen (a reloaded session replays from seq 0)."""
        fresh = [u for u in batch if u.seq >= listener.seen]
        if not fresh:
            return b""
        listener.seen = max(listener.seen, fresh[-1].seq + 1)
        return b"".join(_update_bytes(u) for u in coalesce(fresh))

    async def _tail_stream(self, session_id: str, from_seq: int) -> AsyncIterator[bytes]:
        """The live tail of a session another replica owns: read it and follow it on the stream."""
        yield b": live tail (stream)\n\n"
        session, builder, last_stream_seq = await self._session_state(session_id)
        listener = _Listener(seen=from_seq)
        for chunk in self._snapshot(builder, listener):
            yield chunk
        records = self.log.reader.subscribe(session_id=session_id, from_stream_seq=last_stream_seq + 1)
        pending: asyncio.Task[Record] | None = None
        try:
            while not self._closing.is_set():
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
