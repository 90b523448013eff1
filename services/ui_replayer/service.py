"""The ui-replayer service: its projection (per session the validated log, the transcript and the audit), the
views it answers from them, and its lifecycle (the runner, the fleet index, the deployment's health and the HTTP
server of `routes.py`, whose live tails are `live.py`'s)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from starlette.applications import Starlette

from sessionlog.asgi import AsgiServer, serve_asgi
from sessionlog.audit import SessionAuditor
from sessionlog.errors import InvalidBoundary, SessionLogError, SessionNotFound
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.reader import read_raw_exchanges
from sessionlog.record import Record
from sessionlog.runner import Projection, ProjectionRunner, SessionLogState
from sessionlog.services import ProjectionService
from sessionlog.transcript import Transcript, TranscriptBuilder, Update, build_transcript

from . import views
from .fleet import DeploymentHealth, FleetIndex, SessionRow, lease_holders
from .live import Listener, LiveTails
from .routes import UIRoutes

log = logging.getLogger("sessionlog.ui_replayer")

MAX_HEADERS: Final = 10_000
FLEET_CATCH_UP_S: Final = 10.0  # a start waits this long for the fleet index to read what the log holds


class UIState(SessionLogState):
    """One session's validated log, its transcript and its audit (requests, ledger, findings); `updates` holds what
    the last records changed for the live tail, `replaces` the seqs of its compactions.

    `watched` is the projection's live tails by session: a record of a session no page tails builds no updates
    (the builder is quiet), which is most records of a fleet and every record of a rebuild."""

    def __init__(
        self,
        session_id: str,
        model_aliases: dict[str, str] | None = None,
        watched: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(session_id)
        self.builder = TranscriptBuilder(session_id)
        self.auditor = SessionAuditor(session_id, model_aliases=model_aliases)
        self.updates: list[Update] = []
        self.watched = watched

    @property
    def replaces(self) -> list[int]:
        return self.builder.replaces

    def apply(self, record: Record) -> None:
        # The session validates each event (a refused one raises, and the cache drops this state) as the auditor
        # takes it; the transcript takes the record's events after them, as it never reads the session.
        builder = self.builder
        if self.watched is not None:
            builder.live = self.session_id in self.watched
        updates = builder.extend(self.auditor.feed(record.events, self.session))
        if updates:
            self.updates.extend(updates)

    def requests(self) -> list[views.Request]:
        return views.requests_of(self.auditor)

    def transcript(self, header: bytes, at: int | None = None) -> Transcript:
        """The transcript now, or of the prefix ending at seq `at` (inclusive): a replay from any offset."""
        if at is None:
            return self.builder.snapshot(header)
        if at >= len(self.session):
            raise InvalidBoundary(f"at {at} is past the end of session {self.session_id} ({len(self.session)} events)")
        return build_transcript(self.session.prefix(at), header, session_id=self.session_id)


class UIReplayer(Projection[UIState]):
    name: ClassVar[str] = "ui-replayer"

    def __init__(self, model_aliases: dict[str, str] | None = None) -> None:
        self.listeners: dict[str, set[Listener]] = {}
        # The service's cache of session headers; kept here so that a purge (`on_forget`) drops the header too,
        # or the erased session would still be found (and its header served) after its records are gone.
        self.headers: LRU[str, bytes] = LRU(MAX_HEADERS)
        self.model_aliases = model_aliases or {}

    def new_state(self, session_id: str) -> UIState:
        return UIState(session_id, self.model_aliases, self.listeners)

    def on_forget(self, session_id: str) -> None:
        self.headers.pop(session_id)

    def on_applied(self, state: UIState, record: Record) -> None:
        updates, state.updates = state.updates, []
        listeners = self.listeners.get(state.session_id)
        if not listeners or not updates:
            return
        for listener in listeners:
            listener.offer(updates)


class UIReplayerService(ProjectionService[UIState]):
    """The projection runner, the fleet index and the deployment's health, the views of a session, and the HTTP app
    (`routes.UIRoutes`) with its live tails (`live.LiveTails`)."""

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
        self.live = LiveTails(self)
        self.app = self.build_app()

    def build_app(self) -> Starlette:
        return UIRoutes(self).app()

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
        health["live_tails"] = self.live.count()
        return health

    async def stop(self) -> None:
        self.live.close()  # live tails end, so the server can close their connections
        if self._server is not None:
            await self._server.stop(timeout_s=10)
        await self.fleet.stop()
        await self.deployment.stop()
        await super().stop()

    # ---------------------------------------------------------------------------------- sessions
    # Where the UI gets a session: its header (cached) and its state (the runtime's `session_at`: from memory when
    # this replica owns the session, else read from the stream). Every view comes through these two; the live tail
    # of a session another replica owns reads a copy of its own, which it then follows (`live.py`).

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

    async def state(self, session_id: str) -> UIState:
        """The session's state: from memory when this replica owns the session, else read from the stream."""
        state = await self.runner.session_at(session_id)
        return state if state is not None else self.projection.new_state(session_id)

    async def transcript(self, session_id: str, *, at: int | None = None) -> Transcript:
        """The transcript now, or of the prefix ending at seq `at` (inclusive): a replay from any offset."""
        header = await self.header(session_id)
        return (await self.state(session_id)).transcript(header, at)

    # ---------------------------------------------------------------------------------- views

    async def context_view(
        self, session_id: str, at: int | None, *, start: int | None = 0, limit: int | None = None
    ) -> tuple[UIState, dict[str, Any]]:
        await self.header(session_id)
        state = await self.state(session_id)
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
        state = await self.state(session_id)
        for exchange in await self._raw_exchanges(session_id):
            state.auditor.add_raw(exchange)  # dedup by request id: the raw checks join the log's own
        prices = self.model_prices
        body = views.audit_view(
            state.auditor, state.requests(), views.compactions_of(state.session, state.replaces), prices
        )
        return state, body

    async def raw_view(self, session_id: str, *, limit: int | None) -> tuple[UIState, list[dict[str, Any]]]:
        await self.header(session_id)
        state = await self.state(session_id)
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

    async def enriched(self, rows: list[SessionRow]) -> list[dict[str, Any]]:
        """The overview's rows with what the index does not hold: writer lease holder, and (for sessions this
        replica holds) title, tokens, findings and a quarantined record's reason."""
        holders = await lease_holders(self.log, [r.id for r in rows])
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

    async def fleet_page(self, query: str, state: str, page: int) -> dict[str, Any]:
        """One page of the overview: rows matching `query` (id, title, parent, cwd) and `state`, newest first."""
        found = self.fleet.page(query=query, state=state, page=page, extra=self._title, flagged=self._flagged)
        return {
            "rows": await self.enriched(found.rows),
            "total": found.total,
            "page": found.page,
            "pages": found.pages,
            "sessions": len(self.fleet.rows),
            "query": query,
            "state": state,
        }
