"""The gateway's HTTP app: the invariant before every provider request, then the request forwarded and streamed back.

Endpoints:

- `POST /v1/chat/completions`: an OpenAI-compatible request; the caller names the session (`X-Session-Id`) and the
  last seq it flushed (`X-Session-Seq`, optional). The request must equal, in canonical JSON, the wire form of the
  dispatch-time durable derivation (`sessionlog.wire`); otherwise it is refused with HTTP 409 and nothing reaches
  the provider.
- `POST /v1/sessions/{id}/completions`: derive mode. The gateway builds the request from the log itself; the body
  holds at most transport fields (`stream`, `stream_options`). Anything else in it is laid over the derived request
  and goes through the same check, so a model-visible field there is refused exactly as in proxy mode.
- `POST /record/{id}/v1/chat/completions`, `GET /record/{id}/v1/models`: record mode (`record.py`): the gateway
  logs the session itself for a client that only changed its base URL.
- `GET /healthz`, `GET /metrics` (Prometheus), both without the API key.

A refusal or failure answers OpenAI-style: `{"error": {"message", "type", "code", "param", ...}}` where `code` is
the SPEC section 10 code (or the gateway's own `UPSTREAM_*`, `INVALID_REQUEST`, `UNAUTHORIZED`) and `param` the
JSON path of the first difference. A streaming reply that fails after it started ends with an SSE `error` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import nats.errors
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sessionlog.errors import (
    LogUnavailable,
    MethodNotAllowed,
    RouteNotFound,
    SessionHeld,
    SessionLogError,
    StructureInvalid,
    http_status,
)
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.settings import Settings
from sessionlog.wire import (
    Divergence,
    InvalidRequest,
    WireCache,
    compare_request,
    parse_request,
    to_wire,
    too_deep,
)

from .config import GatewayConfig
from .derivation import ContextDeriverClient, DerivationSource, StreamSource
from .forward import (
    H_RESPONSE_REQUEST_ID,
    Call,
    Forwarder,
    Observer,
    error_body,
    leading_path,
    new_request_id,
    no_retry,
)
from .metrics import GatewayMetrics
from .record import Recorder
from .tee import RawTee
from .tenants import Tenants
from .upstream import (
    Upstream,
    UpstreamClient,
    UpstreamConfig,
    upstream_transport,
)

log = logging.getLogger("sessionlog.gateway")

H_SESSION_ID: Final = "x-session-id"
H_SESSION_SEQ: Final = "x-session-seq"


class Gateway:
    """One gateway: the log connection, the derivation source, the upstream routes, caches and metrics."""

    def __init__(
        self,
        settings: Settings,
        config: GatewayConfig | None = None,
        *,
        log: SessionLog | None = None,
        source: DerivationSource | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.config = config or GatewayConfig.from_settings(settings)
        self.metrics = metrics or GatewayMetrics()
        self.forwarder = Forwarder(self.metrics)
        self._log = log
        self._owns_log = log is None
        self._source = source
        self._owns_source = source is None
        self._http: UpstreamClient | None = None
        self._upstreams: dict[str, Upstream] = {}
        self._default: Upstream | None = None
        self._tee: RawTee | None = None
        self._caches: LRU[str, WireCache] = LRU(self.config.max_sessions)
        self.tenants = Tenants.from_settings(settings, self.config.api_key)
        self.recorder = Recorder(self)
        self.started = False

    # ---------------------------------------------------------------------------------- lifecycle

    @property
    def source(self) -> DerivationSource:
        assert self._source is not None, "the gateway is not started"
        return self._source

    @property
    def tee(self) -> RawTee | None:
        return self._tee

    @property
    def log(self) -> SessionLog:
        assert self._log is not None, "the gateway is not started"
        return self._log

    @property
    def record_provider(self) -> str:
        """The provider name record mode logs (`config.provider`): the default route's."""
        return self.config.upstream.name

    async def start(self) -> None:
        if self._log is None:
            self._log = await SessionLog.connect(self.settings)
        log_ = self._log
        self._http = upstream_transport()
        self._default = Upstream(self.config.upstream, self._http)
        self._upstreams = {name: Upstream(cfg, self._http) for name, cfg in self.config.routes.items()}
        if self._source is None:
            stream = StreamSource(log_, wait_s=self.config.derive_wait_s, max_sessions=self.config.max_sessions)
            if self.config.derivation == "stream":
                self._source = stream
            else:
                self._source = ContextDeriverClient(
                    log_.nc, stream, timeout_s=self.config.deriver_timeout_s, max_sessions=self.config.max_sessions
                )
        if self.config.raw_tee:
            self._tee = RawTee(
                log_.store,
                stream=self.config.raw_stream,
                max_payload=log_.nc.max_payload,
                metrics=self.metrics,
                retry_s=log_.settings.publish_retry_s,
            )
            self.forwarder.tee = self._tee
        await self.recorder.start()
        self.started = True

    async def stop(self) -> None:
        self.started = False
        await self.recorder.stop()
        if self._source is not None and self._owns_source:
            await self._source.close()
        if self._tee is not None:
            await self._tee.drain()
        if self._http is not None:
            await self._http.aclose()
        if self._log is not None and self._owns_log:
            await self._log.close()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    # ---------------------------------------------------------------------------------- endpoints

    async def health(self, request: Request) -> Response:
        connected = self._log is not None and self._log.nc.is_connected
        body = {"status": "ok" if connected else "unavailable", "nats": connected}
        return JSONResponse(body, status_code=200 if connected else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "proxy", request.headers.get(H_SESSION_ID))

    async def session_completions(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        named = request.headers.get(H_SESSION_ID)
        call = Call(request_id=new_request_id(), mode="derive", session_id=session_id)
        if named is not None and named != session_id:
            err = InvalidRequest(f"X-Session-Id {named!r} names another session than the path ({session_id!r})")
            return self._refuse(call, err)
        return await self._handle(request, "derive", session_id, call)

    # ---------------------------------------------------------------------------------- the invariant

    async def _handle(self, request: Request, mode: str, session_id: str | None, call: Call | None = None) -> Response:
        call = call or Call(request_id=new_request_id(), mode=mode)
        try:
            self._authorize(request)
            if not session_id:
                raise InvalidRequest("the X-Session-Id header is required: it names the session the request is for")
            call.session_id = check_session_id(session_id)
            min_seq = _min_seq(request.headers.get(H_SESSION_SEQ))
            # The log's tail is read while the body arrives and is parsed: the round trip overlaps the CPU work.
            parsed: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            deriving = asyncio.ensure_future(self.source.derive(call.session_id, min_seq))
            try:
                body = await request.body()
                if mode == "derive":
                    with gc_paused():
                        extra = parse_request(body) if body.strip() else {}
                else:
                    with gc_paused():
                        parsed = parse_request(body, lazy=True)  # messages stay bytes: the cache reads them
                derivation = await deriving
            finally:
                if not deriving.done():
                    deriving.cancel()
            call.derivation = derivation
            self.metrics.derivations.labels(derivation.source).inc()
            header = derivation.header
            if derivation.open_step is None:
                raise StructureInvalid(
                    f"session {call.session_id} has no open step at seq {derivation.seq}: a provider request belongs "
                    "to an open step (write step/start, and flush, before the request)",
                    seq=derivation.seq,
                )
            if header is None:
                raise StructureInvalid(
                    f"session {call.session_id} has no request/header at seq {derivation.seq}: model, system prompt, "
                    "tools and sampling must be logged before the first request",
                    seq=derivation.seq,
                )
            if mode == "derive":
                parsed = {**to_wire(derivation.messages, header), **extra}
            with gc_paused():
                divergence = compare_request(parsed, derivation.messages, header, cache=self._cache(call.session_id))
        except SessionLogError as err:
            return self._refuse(call, err)
        except RecursionError:  # `messages` decoded lazily, or compared, nested past what can recurse
            return self._refuse(call, too_deep())
        except (nats.errors.Error, OSError) as exc:
            return self._refuse(call, LogUnavailable(f"the log cannot be read: {type(exc).__name__}: {exc}"))
        if divergence is not None:
            return self._refuse(call, divergence.error(), divergence)
        call.invariant_s = time.perf_counter() - call.started
        self.metrics.invariant_seconds.observe(call.invariant_s)
        upstream = self._route(header.header.config.provider)
        call.route = upstream.name
        call.stream = parsed.get("stream") is True
        # Forward what was checked, never the caller's bytes: a key given twice (which the check reads last-wins and
        # a provider's parser may read first-wins) must not carry anything past the invariant, model map or not.
        checked = self._cache(call.session_id).expected_messages(derivation.messages, header)
        forwarded = upstream.forward_body(parsed, checked)
        return await self.forwarder.forward(request, call, upstream, forwarded)

    def _authorize(self, request: Request) -> None:
        self.tenants.tenant(request.headers)

    def _cache(self, session_id: str) -> WireCache:
        cache = self._caches.use(session_id)
        if cache is None:
            cache = WireCache()
            self._caches.put(session_id, cache)
        return cache

    def _route(self, provider: str) -> Upstream:
        upstream = self._upstreams.get(provider) or self._default
        assert upstream is not None, "the gateway is not started"
        return upstream

    def _refuse(self, call: Call, err: SessionLogError, divergence: Divergence | None = None) -> Response:
        path = divergence.path if divergence is not None else leading_path(err.message)
        self.metrics.requests.labels(call.mode, "refused").inc()
        self.metrics.refusals.labels(err.code).inc()
        self.forwarder.log_call(call, "refused", code=err.code, path=path, status=http_status(err))
        status = http_status(err)
        headers = {H_RESPONSE_REQUEST_ID: call.request_id, **no_retry(status)}
        if isinstance(err, SessionHeld) and err.retry_after_s is not None:  # the SDKs wait that long to retry
            headers["retry-after"] = str(math.ceil(err.retry_after_s))
        return JSONResponse(error_body(err, request_id=call.request_id, path=path), status_code=status,
                            headers=headers)  # fmt: skip

    refuse = _refuse

    async def forward_recorded(
        self, request: Request, call: Call, fields: Mapping[str, Any], messages: bytes, observer: Observer
    ) -> Response:
        """Forward a request record mode has logged: the header's fields and the derivation's canonical messages."""
        derivation = call.derivation
        assert derivation is not None and derivation.header is not None
        upstream = self._route(derivation.header.header.config.provider)
        call.route = upstream.name
        forwarded = upstream.forward_body(fields, messages)
        call.invariant_s = time.perf_counter() - call.started
        self.metrics.invariant_seconds.observe(call.invariant_s)
        return await self.forwarder.forward(request, call, upstream, forwarded, observer)

    async def upstream_models(self) -> bytes:
        """The default provider's model list (`GET {base}/models`), as it answers it."""
        assert self._default is not None, "the gateway is not started"
        return await self._default.models()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a large request body decodes into tens of thousands of young objects,
    which would trigger full collections over every live session's objects (tens of ms of pause at 10,000
    messages). The request's objects hold no cycles and die by reference counting, so nothing is owed after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _min_seq(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        seq = int(value)
    except ValueError:
        seq = -2
    if seq < -1:
        raise InvalidRequest(f"X-Session-Seq must be the last flushed seq (an integer, -1 for none), got {value!r}")
    return None if seq == -1 else seq


async def _route_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (plain text) in the gateway's JSON error shape, so an SDK reads a code and message."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    err: SessionLogError
    if exc.status_code == 405:
        err = MethodNotAllowed(f"{where}: method not allowed on this gateway endpoint")
    elif exc.status_code == 404:
        served = ("POST /v1/chat/completions, POST /v1/sessions/{session_id}/completions, and record mode's POST "
                  "/record/{session_id}/v1/chat/completions and GET /record/{session_id}/v1/models")  # fmt: skip
        err = RouteNotFound(f"{where}: no such gateway endpoint (it serves {served})")
    else:
        err = SessionLogError(f"{where}: {exc.detail}")
    body = error_body(err, request_id=new_request_id())
    body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = {**(exc.headers or {}), **no_retry(exc.status_code)}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def build_app(
    settings: Settings,
    config: GatewayConfig | None = None,
    *,
    log: SessionLog | None = None,
    source: DerivationSource | None = None,
    routes: Mapping[str, UpstreamConfig] | None = None,
    metrics: GatewayMetrics | None = None,
) -> Starlette:
    """The gateway as an ASGI app; it connects to the log when it starts (unless given `log`).

    `app.state.gateway` is the `Gateway` (metrics, tee, source) for tests and embedding.
    """
    config = config or GatewayConfig.from_settings(settings)
    if routes is not None:
        config = config.with_(routes={**config.routes, **routes})
    gateway = Gateway(settings, config, log=log, source=source, metrics=metrics)
    app = Starlette(
        exception_handlers={HTTPException: _route_error},
        routes=[
            Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route("/chat/completions", gateway.chat_completions, methods=["POST"]),
            Route("/v1/sessions/{session_id}/completions", gateway.session_completions, methods=["POST"]),
            Route("/record/{session_id}/v1/chat/completions", gateway.recorder.completions, methods=["POST"]),
            Route("/record/{session_id}/v1/models", gateway.recorder.models, methods=["GET"]),
            Route("/healthz", gateway.health, methods=["GET"]),
            Route("/metrics", gateway.prometheus, methods=["GET"]),
        ],
        lifespan=gateway.lifespan,
    )
    app.state.gateway = gateway
    return app
