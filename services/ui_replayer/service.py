"""The ui-replayer projection and its HTTP app (Starlette on uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sessionlog.asgi import AsgiServer, serve_asgi
from sessionlog.audit import SessionAuditor
from sessionlog.errors import InvalidBoundary, SessionLogError, SessionNotFound, http_status
from sessionlog.events import Event
from sessionlog.ids import check_session_id
from sessionlog.jsonl import SessionHeader, decode_header
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.reader import read_raw_exchanges
from sessionlog.record import Record
from sessionlog.runner import Projection, ProjectionRunner, SessionLogState
from sessionlog.services import ProjectionService
from sessionlog.transcript import (
    EntryUpdate,
    Transcript,
    TranscriptBuilder,
    Update,
    build_transcript,
    coalesce,
)

from . import views
from .fleet import DeploymentHealth, FleetIndex, SessionRow, lease_holders
from .page import (
    APP_CSS,
    APP_JS,
    SECURITY_HEADERS,
    SessionContext,
    render_audit_page,
    render_context_page,
    render_error_page,
    render_fleet_page,
    render_raw_page,
    render_transcript_page,
)

log = logging.getLogger("sessionlog.ui_replayer")

KEEPALIVE_S: Final = 15.0
LISTENER_QUEUE: Final = 1024  # record batches a slow page may fall behind by before it is resynchronised
MAX_HEADERS: Final = 10_000
FLEET_CATCH_UP_S: Final = 10.0  # a start waits this long for the fleet index to read what the log holds
CONTEXT_PAGE: Final = 250  # messages of the model's view on one page (the newest, unless `from` says otherwise)

_encoder: Final = msgspec.json.Encoder()


class UIState(SessionLogState):
    """One session's validated log, its transcript and its audit (requests, ledger, findings); `updates` holds what
    the last records changed for the live tail, `replaces` the seqs of its compactions."""

    def __init__(self, session_id: str, model_aliases: dict[str, str] | None = None) -> None:
        super().__init__(session_id)
        self.builder = TranscriptBuilder(session_id)
        self.auditor = SessionAuditor(session_id, model_aliases=model_aliases)
        self.updates: list[Update] = []
        self.replaces: list[int] = []

    def took(self, event: Event) -> None:
        self.updates.extend(self.builder.add(event))
        self.auditor.add(event, self.session)
        if event.is_replace:
            self.replaces.append(event.seq)

    def requests(self) -> list[views.Request]:
        return views.requests_of(self.auditor)


@dataclass(eq=False)
class _Listener:
    """One open live tail: the updates not yet sent, and the seq it has seen everything before."""

    seen: int
    queue: asyncio.Queue[list[Update]] = field(default_factory=lambda: asyncio.Queue(LISTENER_QUEUE))
    behind: bool = False  # its queue overflowed: it gets a fresh snapshot


class UIReplayer(Projection[UIState]):
    name: ClassVar[str] = "ui-replayer"

    def __init__(self, model_aliases: dict[str, str] | None = None) -> None:
        self.listeners: dict[str, set[_Listener]] = {}
        # The service's cache of session headers; kept here so that a purge (`on_forget`) drops the header too,
        # or the erased session would still be found (and its header served) after its records are gone.
        self.headers: LRU[str, bytes] = LRU(MAX_HEADERS)
        self.model_aliases = model_aliases or {}

    def new_state(self, session_id: str) -> UIState:
        return UIState(session_id, self.model_aliases)

    def on_forget(self, session_id: str) -> None:
        self.headers.pop(session_id)

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
        self,
        log_: SessionLog,
        *,
        host: str | None = None,
        port: int | None = None,
        model_prices: dict[str, dict[str, float]] | None = None,
        **runner_options: Any,
    ) -> None:
        self.projection = UIReplayer(dict(log_.settings.provider_model_map))
        super().__init__(log_, ProjectionRunner(log_, self.projection, **runner_options))
        self.model_prices = model_prices if model_prices is not None else self.settings.model_prices
        self.fleet = FleetIndex(log_)
        self.deployment = DeploymentHealth(log_)
        self.host = host if host is not None else self.settings.ui_host
        self.port = port if port is not None else self.settings.ui_port
        self._headers = self.projection.headers
        self._server: AsgiServer | None = None
        self._closing = asyncio.Event()
        self.app = self.build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---------------------------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        await super()._start()
        await self.fleet.start()
        await self.deployment.start()
        if not await self.fleet.caught_up(FLEET_CATCH_UP_S):
            log.warning("ui-replayer: the fleet index is still reading the log; the overview fills in as it does")
        self._server = await serve_asgi(
            self.app,
            self.host,
            self.port,
            name="the ui-replayer",
            hint="set SESSIONLOG_UI_PORT to another port",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.port = self._server.port
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
            await self._server.stop(timeout_s=10)
        await self.fleet.stop()
        await self.deployment.stop()
        for queue in list(self.fleet.listeners):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait([])
        await super().stop()

    # ---------------------------------------------------------------------------------- sessions

    async def header(self, session_id: str) -> bytes:
        """The session header (cached: a header never changes once the session is visible)."""
        check_session_id(session_id)
        header = self._headers.use(session_id)
        if header is None:
            header = await self.log.header(session_id)
            if header is None:
                raise SessionNotFound(f"session {session_id} not found")
            self._headers.put(session_id, header)
        return header

    async def _state(self, session_id: str) -> UIState:
        """The session's state: from memory when this replica owns the session, else read from the stream."""
        state = await self.runner.session_at(session_id)
        return state if state is not None else self.projection.new_state(session_id)

    async def transcript(self, session_id: str, *, at: int | None = None) -> Transcript:
        """The transcript now, or of the prefix ending at seq `at` (inclusive): a replay from any offset."""
        header = await self.header(session_id)
        return self._transcript_of(await self._state(session_id), header, at)

    @staticmethod
    def _transcript_of(state: UIState, header: bytes, at: int | None) -> Transcript:
        session_id = state.session_id
        if at is None:
            return state.builder.snapshot(header)
        if at >= len(state.session):
            raise InvalidBoundary(f"at {at} is past the end of session {session_id} ({len(state.session)} events)")
        return build_transcript(state.session.prefix(at), header, session_id=session_id)

    # ---------------------------------------------------------------------------------- views

    async def _context(self, session_id: str, tab: str, state: UIState, at: int | None = None) -> SessionContext:
        header = decode_header(await self.header(session_id))
        row = self.fleet.rows.get(session_id)
        holders = await lease_holders(self.log, [session_id])
        return SessionContext(
            session_id=session_id,
            title=state.builder.title,
            header=header,
            events=len(state.session),
            open_turn=state.session.open_turn,
            lease_holder=holders[session_id],
            last_activity=row.last_activity if row is not None else None,
            children=[r.id for r in self.fleet.children(session_id)],
            ancestors=self._ancestors(header),
            requests=state.requests(),
            compactions=views.compactions_of(state.session, state.replaces),
            tab=tab,
            at=at,
            header_seqs=state.session.request_header_seqs,
        )

    def _ancestors(self, header: SessionHeader) -> list[str]:
        """Parent, grandparent, ... as far as the index knows them (oldest first)."""
        out: list[str] = []
        parent = header.parent_session if isinstance(header.parent_session, str) else None
        while parent is not None and parent not in out and len(out) < 20:
            out.append(parent)
            row = self.fleet.rows.get(parent)
            parent = row.parent if row is not None else None
        return out[::-1]

    def _at(self, request: Request, state: UIState, requests: list[views.Request]) -> int:
        at = _int_param(request, "at")
        if at is None:  # the latest request, else the end of the log
            return requests[-1].at if requests else max(0, len(state.session) - 1)
        if at >= len(state.session):
            raise InvalidBoundary(f"at {at} is past the end of the session ({len(state.session)} events)")
        return at

    async def context_view(
        self, session_id: str, at: int | None, *, start: int | None = 0, limit: int | None = None
    ) -> tuple[UIState, dict[str, Any]]:
        await self.header(session_id)
        state = await self._state(session_id)
        requests = state.requests()
        if at is None:
            at = requests[-1].at if requests else max(0, len(state.session) - 1)
        if at >= len(state.session):
            raise InvalidBoundary(f"at {at} is past the end of session {session_id} ({len(state.session)} events)")
        if not len(state.session):
            return state, {"at": 0, "total": 0, "start": 0, "messages": [], "compactions": [], "previous": None}
        view = views.context_view(state.session, at, requests, start=start, limit=limit)
        return state, view

    async def _raw_exchanges(self, session_id: str) -> list[Any]:
        try:
            return await read_raw_exchanges(
                self.log.nc, self.settings.raw_stream, session_id, timeout=self.settings.request_timeout_s
            )
        except SessionLogError as err:  # no raw stream (no gateway deployed), or not readable: nothing to show
            log.info("ui-replayer: raw exchanges of %s not read: %s", session_id, err)
            return []

    async def audit_view(self, session_id: str) -> tuple[UIState, dict[str, Any]]:
        await self.header(session_id)
        state = await self._state(session_id)
        for exchange in await self._raw_exchanges(session_id):
            state.auditor.add_raw(exchange)  # dedup by request id: the raw checks join the log's own
        prices = self.model_prices
        body = views.audit_view(
            state.auditor, state.requests(), views.compactions_of(state.session, state.replaces), prices
        )
        return state, body

    async def raw_view(self, session_id: str, *, limit: int | None) -> tuple[UIState, list[dict[str, Any]]]:
        await self.header(session_id)
        state = await self._state(session_id)
        exchanges = await self._raw_exchanges(session_id)
        for exchange in exchanges:
            state.auditor.add_raw(exchange)
        return state, views.raw_view(state.session, exchanges, state.auditor.findings, limit=limit)

    # ---------------------------------------------------------------------------------- fleet

    def _title(self, session_id: str) -> str:
        state = self.runner.states.get(session_id)
        return (state.builder.title or "") if state is not None else ""

    def _flagged(self, session_id: str) -> bool:
        state = self.runner.states.get(session_id)
        return state is not None and bool(state.auditor.findings)

    def _enrich(self, rows: list[SessionRow], holders: dict[str, str | None]) -> list[dict[str, Any]]:
        out = []
        for row in rows:
            item = row.to_dict()
            state = self.runner.states.get(row.id)
            item["title"] = state.builder.title if state is not None else None
            item["lease_holder"] = holders.get(row.id)
            poisoned = self.runner.poisoned.get(row.id)
            if item["error"] is None and poisoned is not None:  # a record only decoding showed to be bad
                item["error"] = poisoned.reason
            if state is not None:
                total = state.auditor.ledger().total
                item["tokens"] = total.input_tokens + total.output_tokens
                item["findings"] = len(state.auditor.findings)
            else:  # not held by this replica: the session page has them
                item["tokens"] = None
                item["findings"] = None
            out.append(item)
        return out

    async def fleet_page(self, request: Request) -> dict[str, Any]:
        query = request.query_params.get("q", "")
        state = request.query_params.get("state", "")
        page = _int_param(request, "page") or 1
        found = self.fleet.page(query=query, state=state, page=page, extra=self._title, flagged=self._flagged)
        holders = await lease_holders(self.log, [r.id for r in found.rows])
        return {
            "rows": self._enrich(found.rows, holders),
            "total": found.total,
            "page": found.page,
            "pages": found.pages,
            "sessions": len(self.fleet.rows),
            "query": query,
            "state": state,
        }

    # ---------------------------------------------------------------------------------- HTTP

    def build_app(self) -> Starlette:
        routes = [
            Route("/", self._list),
            Route("/events", self._fleet_events),
            Route("/sessions/{session_id}", self._page),
            Route("/sessions/{session_id}/events", self._events),
            Route("/sessions/{session_id}/context", self._context_page),
            Route("/sessions/{session_id}/audit", self._audit_page),
            Route("/sessions/{session_id}/raw", self._raw_page),
            Route("/api/sessions", self._api_list),
            Route("/api/fleet", self._api_fleet),
            Route("/api/health", self._api_health),
            Route("/api/sessions/{session_id}/transcript", self._api_transcript),
            Route("/api/sessions/{session_id}/context", self._api_context),
            Route("/api/sessions/{session_id}/audit", self._api_audit),
            Route("/api/sessions/{session_id}/raw", self._api_raw),
            Route("/api/sessions/{session_id}/requests", self._api_requests),
            Route("/api/sessions/{session_id}/lineage", self._api_lineage),
            Route("/static/app.js", self._js),
            Route("/static/app.css", self._css),
            Route("/healthz", self._healthz),
        ]
        return Starlette(routes=routes, exception_handlers={SessionLogError: self._error})

    async def _error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SessionLogError)
        status = http_status(exc)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": exc.to_dict()}, status_code=status)
        return HTMLResponse(render_error_page(status, str(exc)), status_code=status, headers=SECURITY_HEADERS)

    @staticmethod
    def _json(body: Any) -> Response:
        return Response(_encoder.encode(body), media_type="application/json", headers=SECURITY_HEADERS)

    async def _list(self, request: Request) -> Response:
        fleet = await self.fleet_page(request)
        health = await self.deployment.read()
        return HTMLResponse(render_fleet_page(fleet, health), headers=SECURITY_HEADERS)

    async def _api_list(self, request: Request) -> Response:
        return self._json((await self.fleet_page(request))["rows"])

    async def _api_fleet(self, request: Request) -> Response:
        return self._json(await self.fleet_page(request))

    async def _api_health(self, request: Request) -> Response:
        return self._json(await self.deployment.read())

    async def _page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = _int_param(request, "at")
        before = _int_param(request, "before")
        header = await self.header(session_id)
        state = await self._state(session_id)
        transcript = self._transcript_of(state, header, at)
        context = await self._context(session_id, "transcript", state, at)
        html = render_transcript_page(transcript, context, live=at is None and before is None, before=before)
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    async def _api_transcript(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = _int_param(request, "at")
        from_seq = _int_param(request, "from_seq") or 0
        transcript = await self.transcript(session_id, at=at)
        if from_seq:
            transcript = msgspec.structs.replace(transcript, entries=transcript.since(from_seq))
        return Response(_encoder.encode(transcript), media_type="application/json", headers=SECURITY_HEADERS)

    async def _context_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, view = await self.context_view(
            session_id, _int_param(request, "at"), start=_int_param(request, "from"), limit=CONTEXT_PAGE
        )
        context = await self._context(session_id, "context", state, view["at"])
        return HTMLResponse(render_context_page(view, context), headers=SECURITY_HEADERS)

    async def _api_context(self, request: Request) -> Response:
        _, view = await self.context_view(
            request.path_params["session_id"],
            _int_param(request, "at"),
            start=_int_param(request, "from") or 0,
            limit=_int_param(request, "limit"),
        )
        return self._json(view)

    async def _audit_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, body = await self.audit_view(session_id)
        context = await self._context(session_id, "audit", state)
        return HTMLResponse(render_audit_page(body, context), headers=SECURITY_HEADERS)

    async def _api_audit(self, request: Request) -> Response:
        _, body = await self.audit_view(request.path_params["session_id"])
        return self._json(body)

    async def _raw_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, body = await self.raw_view(session_id, limit=views.RAW_TEXT_LIMIT)
        context = await self._context(session_id, "raw", state)
        return HTMLResponse(render_raw_page(body, context), headers=SECURITY_HEADERS)

    async def _api_raw(self, request: Request) -> Response:
        _, body = await self.raw_view(request.path_params["session_id"], limit=None)
        return self._json(body)

    async def _api_requests(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        await self.header(session_id)
        state = await self._state(session_id)
        return self._json(
            {
                "requests": [views._request_dict(r) for r in state.requests()],
                "compactions": views.compactions_of(state.session, state.replaces),
                "events": len(state.session),
            }
        )

    async def _api_lineage(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        header = decode_header(await self.header(session_id))
        return self._json(
            {
                "session": session_id,
                "parent": header.parent_session if isinstance(header.parent_session, str) else None,
                "seed_length": header.seed_length if isinstance(header.seed_length, int) else None,
                "ancestors": self._ancestors(header),
                "children": [r.id for r in self.fleet.children(session_id)],
            }
        )

    async def _fleet_events(self, request: Request) -> Response:
        """Rows of the overview that changed, as SSE `rows` events (JSON list), while the page is open."""
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **SECURITY_HEADERS}
        return StreamingResponse(self._fleet_tail(), media_type="text/event-stream", headers=headers)

    async def _fleet_tail(self) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[list[str]] = asyncio.Queue(64)
        self.fleet.listeners.add(queue)
        try:
            yield _sse("sync", _encoder.encode({"sessions": len(self.fleet.rows)}))
            while not self._closing.is_set():
                try:
                    changed = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                rows = [self.fleet.rows[i] for i in changed if i in self.fleet.rows][:200]
                if not rows:
                    continue
                holders = await lease_holders(self.log, [r.id for r in rows])
                yield _sse("rows", _encoder.encode(self._enrich(rows, holders)))
        finally:
            self.fleet.listeners.discard(queue)

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
        state = await self.runner.session_at(session_id)
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
                    current = await self.runner.session_at(session_id)
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
        state = await self.runner.sessions.read(session_id)  # its own: followed here, never shared
        state.updates = []
        session, builder, last_stream_seq = state.session, state.builder, state.last_stream_seq
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
