"""The ui-replayer's HTTP app: every route (pages, their JSON, the live tails, health), the answer to a refusal (its
status from `errors.CODES`: JSON under `/api/`, an error page elsewhere) and the static script and stylesheet
(package data in `static/`, read once through `importlib.resources`)."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any, Final

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from sessionlog.errors import InvalidBoundary, SessionLogError, http_status
from sessionlog.jsonl import SessionHeader, decode_header

from . import views
from .fleet import lease_holders
from .pages import (
    SECURITY_HEADERS,
    SessionContext,
    render_audit_page,
    render_context_page,
    render_error_page,
    render_fleet_page,
    render_raw_page,
    render_transcript_page,
)

if TYPE_CHECKING:
    from .service import UIReplayerService, UIState

CONTEXT_PAGE: Final = 250  # messages of the model's view on one page (the newest, unless `from` says otherwise)
MAX_ANCESTORS: Final = 20

_STATIC: Final = resources.files(__package__) / "static"
APP_CSS: Final = (_STATIC / "app.css").read_text(encoding="utf-8")
APP_JS: Final = (_STATIC / "app.js").read_text(encoding="utf-8")  # builds entries with textContent only

_encoder: Final = msgspec.json.Encoder()


def int_param(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if not value.isdigit():
        raise InvalidBoundary(f"query parameter {name} must be a non-negative integer, got {value!r}")
    return int(value)


def _json(body: Any) -> Response:
    return Response(_encoder.encode(body), media_type="application/json", headers=SECURITY_HEADERS)


def _html(page: str) -> Response:
    return HTMLResponse(page, headers=SECURITY_HEADERS)


class UIRoutes:
    """The handlers of one ui-replayer; each asks the service for a view and renders it as a page or as JSON."""

    def __init__(self, ui: UIReplayerService) -> None:
        self.ui = ui

    def app(self) -> Starlette:
        live = self.ui.live
        routes = [
            Route("/", self._list),
            Route("/events", live.fleet_events),
            Route("/sessions/{session_id}", self._page),
            Route("/sessions/{session_id}/events", live.session_events),
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

    # ---------------------------------------------------------------------------------- the fleet

    async def _fleet(self, request: Request) -> dict[str, Any]:
        query = request.query_params.get("q", "")
        state = request.query_params.get("state", "")
        return await self.ui.fleet_page(query, state, int_param(request, "page") or 1)

    async def _list(self, request: Request) -> Response:
        fleet = await self._fleet(request)
        health = await self.ui.deployment.read()
        return _html(render_fleet_page(fleet, health))

    async def _api_list(self, request: Request) -> Response:
        return _json((await self._fleet(request))["rows"])

    async def _api_fleet(self, request: Request) -> Response:
        return _json(await self._fleet(request))

    async def _api_health(self, request: Request) -> Response:
        return _json(await self.ui.deployment.read())

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse(self.ui.health())

    # ---------------------------------------------------------------------------------- a session's tabs

    async def _context(self, session_id: str, tab: str, state: UIState, at: int | None = None) -> SessionContext:
        """What every tab shows around its view."""
        header = decode_header(await self.ui.header(session_id))
        fleet = self.ui.fleet
        row = fleet.rows.get(session_id)
        holders = await lease_holders(self.ui.log, [session_id])
        return SessionContext(
            session_id=session_id,
            title=state.builder.title,
            header=header,
            events=len(state.session),
            open_turn=state.session.open_turn,
            lease_holder=holders[session_id],
            last_activity=row.last_activity if row is not None else None,
            children=[r.id for r in fleet.children(session_id)],
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
        while parent is not None and parent not in out and len(out) < MAX_ANCESTORS:
            out.append(parent)
            row = self.ui.fleet.rows.get(parent)
            parent = row.parent if row is not None else None
        return out[::-1]

    async def _page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = int_param(request, "at")
        before = int_param(request, "before")
        header = await self.ui.header(session_id)
        state = await self.ui.state(session_id)
        transcript = state.transcript(header, at)
        context = await self._context(session_id, "transcript", state, at)
        return _html(render_transcript_page(transcript, context, live=at is None and before is None, before=before))

    async def _api_transcript(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        at = int_param(request, "at")
        from_seq = int_param(request, "from_seq") or 0
        transcript = await self.ui.transcript(session_id, at=at)
        if from_seq:
            transcript = msgspec.structs.replace(transcript, entries=transcript.since(from_seq))
        return _json(transcript)

    async def _context_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, view = await self.ui.context_view(
            session_id, int_param(request, "at"), start=int_param(request, "from"), limit=CONTEXT_PAGE
        )
        context = await self._context(session_id, "context", state, view["at"])
        return _html(render_context_page(view, context))

    async def _api_context(self, request: Request) -> Response:
        _, view = await self.ui.context_view(
            request.path_params["session_id"],
            int_param(request, "at"),
            start=int_param(request, "from") or 0,
            limit=int_param(request, "limit"),
        )
        return _json(view)

    async def _audit_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, body = await self.ui.audit_view(session_id)
        context = await self._context(session_id, "audit", state)
        return _html(render_audit_page(body, context))

    async def _api_audit(self, request: Request) -> Response:
        _, body = await self.ui.audit_view(request.path_params["session_id"])
        return _json(body)

    async def _raw_page(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        state, body = await self.ui.raw_view(session_id, limit=views.RAW_TEXT_LIMIT)
        context = await self._context(session_id, "raw", state)
        return _html(render_raw_page(body, context))

    async def _api_raw(self, request: Request) -> Response:
        _, body = await self.ui.raw_view(request.path_params["session_id"], limit=None)
        return _json(body)

    async def _api_requests(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        await self.ui.header(session_id)
        state = await self.ui.state(session_id)
        return _json(views.requests_view(state.session, state.requests(), state.replaces))

    async def _api_lineage(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        header = decode_header(await self.ui.header(session_id))
        return _json(
            {
                "session": session_id,
                "parent": header.parent_session if isinstance(header.parent_session, str) else None,
                "seed_length": header.seed_length if isinstance(header.seed_length, int) else None,
                "ancestors": self._ancestors(header),
                "children": [r.id for r in self.ui.fleet.children(session_id)],
            }
        )

    # ---------------------------------------------------------------------------------- static

    async def _js(self, request: Request) -> Response:
        return Response(APP_JS, media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)

    async def _css(self, request: Request) -> Response:
        return Response(APP_CSS, media_type="text/css; charset=utf-8", headers=SECURITY_HEADERS)
