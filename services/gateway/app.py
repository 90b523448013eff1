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
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import httpx
import msgspec
import nats.errors
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sessionlog.errors import (
    LogUnavailable,
    MethodNotAllowed,
    RouteNotFound,
    SessionLogError,
    StructureInvalid,
    UpstreamError,
    http_status,
)
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.record import H_RAW_OUTCOME, H_RAW_SESSION_SEQ, H_RAW_STATUS
from sessionlog.settings import Settings
from sessionlog.tasks import detach
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
from .derivation import ContextDeriverClient, Derivation, DerivationSource, StreamSource
from .metrics import GatewayMetrics
from .record import Recorder
from .tee import H_REQUEST_ID, RawTee
from .tenants import Tenants
from .upstream import (
    Upstream,
    UpstreamConfig,
    gateway_status_for,
    stream_error,
    upstream_error_message,
    upstream_transport,
)

log = logging.getLogger("sessionlog.gateway")

H_SESSION_ID: Final = "x-session-id"
H_SESSION_SEQ: Final = "x-session-seq"
H_RESPONSE_REQUEST_ID: Final = "x-sessionlog-request-id"
H_RESPONSE_SEQ: Final = "x-sessionlog-session-seq"
H_SHOULD_RETRY: Final = "x-should-retry"

T = TypeVar("T")


class Observer(Protocol):
    """Follows one forwarded exchange (record mode logs the response through it)."""

    async def relayed(self, data: bytes) -> None:
        """Bytes of a streamed answer, once the client has been sent them."""

    async def ended(self, outcome: str, status: int, *, body: bytes | None = None, message: str = "") -> None:
        """The exchange is over (called once): `forwarded` (with the whole body when not streamed),
        `client_disconnected` or `upstream_error`."""


class _ClientGone(Exception):
    """The client disconnected while the gateway waited for the provider."""


def error_body(err: SessionLogError, *, request_id: str, path: str | None = None) -> dict[str, Any]:
    status = http_status(err)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if err.code.startswith("UPSTREAM_"):
        kind = "upstream_error"
    error: dict[str, Any] = {
        "message": str(err),
        "type": kind,
        "code": err.code,
        "param": path,
        "request_id": request_id,
    }
    if path is not None:
        error["path"] = path
    if err.seq is not None:
        error["seq"] = err.seq
    return {"error": error}


# A refusal about one part of the request names it first (`$.messages[1]: ...`): that is its OpenAI `param`.
_LEADING_PATH: Final = re.compile(r"\$(?:\.[A-Za-z_]\w*|\[\d+\])*(?=[:\s]|$)")


def _leading_path(message: str) -> str | None:
    found = _LEADING_PATH.match(message)
    return found.group() if found is not None else None


def _no_retry(status: int) -> dict[str, str]:
    """A refusal (4xx) is final: the same request gets the same verdict. The official SDKs retry 409 (and 408, 429)
    twice unless the server says `x-should-retry: false`, which tripled every refusal and its bounded wait."""
    return {H_SHOULD_RETRY: "false"} if 400 <= status < 500 else {}


def _sse_error(err: SessionLogError, request_id: str) -> bytes:
    return b"data: " + msgspec.json.encode(error_body(err, request_id=request_id)) + b"\n\n"


@dataclass(slots=True)
class _Call:
    """One request on its way through the gateway."""

    request_id: str
    mode: str
    session_id: str = ""
    derivation: Derivation | None = None
    route: str = ""
    stream: bool = False
    started: float = field(default_factory=time.perf_counter)
    invariant_s: float = 0.0

    def tee_headers(self) -> dict[str, str]:
        headers = {H_REQUEST_ID: self.request_id, "Sessionlog-Route": self.route}
        if self.derivation is not None:
            headers[H_RAW_SESSION_SEQ] = str(self.derivation.seq)
        return headers


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
        self._log = log
        self._owns_log = log is None
        self._source = source
        self._http: httpx.AsyncHTTPTransport | None = None
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
                log_.js, stream=self.config.raw_stream, max_payload=log_.nc.max_payload, metrics=self.metrics
            )
        await self.recorder.start()
        self.started = True

    async def stop(self) -> None:
        self.started = False
        await self.recorder.stop()
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
        call = _Call(request_id=_request_id(), mode="derive", session_id=session_id)
        if named is not None and named != session_id:
            err = InvalidRequest(f"X-Session-Id {named!r} names another session than the path ({session_id!r})")
            return self._refuse(call, err)
        return await self._handle(request, "derive", session_id, call)

    # ---------------------------------------------------------------------------------- the invariant

    async def _handle(self, request: Request, mode: str, session_id: str | None, call: _Call | None = None) -> Response:
        call = call or _Call(request_id=_request_id(), mode=mode)
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
        return await self._forward(request, call, upstream, forwarded)

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

    def _refuse(self, call: _Call, err: SessionLogError, divergence: Divergence | None = None) -> Response:
        path = divergence.path if divergence is not None else _leading_path(err.message)
        self.metrics.requests.labels(call.mode, "refused").inc()
        self.metrics.refusals.labels(err.code).inc()
        self._log_call(call, "refused", code=err.code, path=path, status=http_status(err))
        status = http_status(err)
        return JSONResponse(
            error_body(err, request_id=call.request_id, path=path),
            status_code=status,
            headers={H_RESPONSE_REQUEST_ID: call.request_id, **_no_retry(status)},
        )

    refuse = _refuse

    async def forward_recorded(
        self, request: Request, call: _Call, fields: Mapping[str, Any], messages: bytes, observer: Observer
    ) -> Response:
        """Forward a request record mode has logged: the header's fields and the derivation's canonical messages."""
        derivation = call.derivation
        assert derivation is not None and derivation.header is not None
        upstream = self._route(derivation.header.header.config.provider)
        call.route = upstream.name
        forwarded = upstream.forward_body(fields, messages)
        call.invariant_s = time.perf_counter() - call.started
        self.metrics.invariant_seconds.observe(call.invariant_s)
        return await self._forward(request, call, upstream, forwarded, observer)

    async def upstream_models(self) -> bytes:
        """The default provider's model list (`GET {base}/models`), as it answers it."""
        assert self._http is not None and self._default is not None, "the gateway is not started"
        config = self._default.config
        url = httpx.URL(config.base_url.rstrip("/") + "/models")
        headers = {"accept": "application/json", "accept-encoding": "identity"}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        try:
            response = await self._http.handle_async_request(
                httpx.Request("GET", url, headers=headers, extensions={"timeout": timeout.as_dict()})
            )
            data = await response.aread()
            await response.aclose()
        except httpx.HTTPError as exc:
            raise stream_error(exc, self._default.name, config.timeout_s) from None
        if response.status_code != 200:
            raise UpstreamError(
                upstream_error_message(response.status_code, data),
                status=gateway_status_for(response.status_code),
                upstream_status=response.status_code,
            )
        return data

    # ---------------------------------------------------------------------------------- forwarding

    async def _forward(
        self, request: Request, call: _Call, upstream: Upstream, body: bytes, observer: Observer | None = None
    ) -> Response:
        sent = time.perf_counter()
        request_entry = ("request", body, call.tee_headers())
        try:
            response = await _unless_disconnected(request, upstream.open(body))
        except _ClientGone:
            self.metrics.client_disconnects.inc()
            self._finish(call, "client_disconnected", [request_entry], upstream_s=time.perf_counter() - sent)
            if observer is not None:
                await observer.ended("client_disconnected", 499)
            return Response(status_code=499)
        except SessionLogError as err:
            self.metrics.upstream_errors.labels(err.code).inc()
            self._finish(call, "upstream_error", [request_entry], upstream_s=time.perf_counter() - sent, code=err.code)
            if observer is not None:
                await observer.ended("upstream_error", http_status(err), message=str(err))
            return JSONResponse(error_body(err, request_id=call.request_id), status_code=http_status(err))
        except BaseException:
            if observer is not None:
                detach(observer.ended("client_disconnected", 499))
            raise
        self.metrics.upstream_first_byte_seconds.observe(time.perf_counter() - sent)
        headers = {H_RESPONSE_REQUEST_ID: call.request_id}
        if call.derivation is not None:
            headers[H_RESPONSE_SEQ] = str(call.derivation.seq)
        if response.status_code != 200:
            return await self._upstream_failed(request, call, upstream, response, request_entry, sent, observer)
        if call.stream:
            return StreamingResponse(
                self._relay(call, upstream, response, request_entry, sent, observer),
                media_type=response.headers.get("content-type", "text/event-stream"),
                headers={**headers, "cache-control": "no-cache"},
            )
        try:
            data = await _unless_disconnected(request, response.aread())
        except _ClientGone:
            self.metrics.client_disconnects.inc()
            _close_later(response)
            self._finish(call, "client_disconnected", [request_entry], upstream_s=time.perf_counter() - sent)
            if observer is not None:
                await observer.ended("client_disconnected", 499)
            return Response(status_code=499)
        except httpx.HTTPError as exc:
            failure = stream_error(exc, upstream.name, upstream.config.timeout_s)
            _close_later(response)
            self.metrics.upstream_errors.labels(failure.code).inc()
            self._finish(
                call, "upstream_error", [request_entry], upstream_s=time.perf_counter() - sent, code=failure.code
            )
            if observer is not None:
                await observer.ended("upstream_error", http_status(failure), message=str(failure))
            return JSONResponse(error_body(failure, request_id=call.request_id), status_code=http_status(failure))
        await response.aclose()
        if observer is not None:  # logged before the client has the answer: the session is free when it does
            await observer.ended("forwarded", 200, body=data)
        response_entry = ("response", data, self._response_headers(call, response.status_code, "complete"))
        self._finish(call, "forwarded", [request_entry, response_entry], upstream_s=time.perf_counter() - sent)
        return Response(data, media_type=response.headers.get("content-type", "application/json"), headers=headers)

    async def _upstream_failed(
        self,
        request: Request,
        call: _Call,
        upstream: Upstream,
        response: httpx.Response,
        request_entry: tuple[str, bytes, Mapping[str, str]],
        sent: float,
        observer: Observer | None = None,
    ) -> Response:
        try:
            data = await _unless_disconnected(request, response.aread())
        except (_ClientGone, httpx.HTTPError):
            data = b""
        finally:
            _close_later(response)
        status = response.status_code
        err = UpstreamError(
            upstream_error_message(status, data), status=gateway_status_for(status), upstream_status=status
        )
        if observer is not None:
            await observer.ended("upstream_error", status, message=str(err))
        self.metrics.upstream_errors.labels(err.code).inc()
        response_entry = ("response", data, self._response_headers(call, status, "upstream_error"))
        self._finish(
            call,
            "upstream_error",
            [request_entry, response_entry],
            upstream_s=time.perf_counter() - sent,
            code=err.code,
        )
        body = error_body(err, request_id=call.request_id)
        body["error"]["upstream_status"] = status
        # The provider's own retry advice (a 429's `retry-after`) is the client's to follow, not the gateway's.
        advice = {k: v for k in ("retry-after", H_SHOULD_RETRY) if (v := response.headers.get(k)) is not None}
        return JSONResponse(body, status_code=err.status, headers={H_RESPONSE_REQUEST_ID: call.request_id, **advice})

    async def _relay(
        self,
        call: _Call,
        upstream: Upstream,
        response: httpx.Response,
        request_entry: tuple[str, bytes, Mapping[str, str]],
        sent: float,
        observer: Observer | None = None,
    ) -> AsyncIterator[bytes]:
        """Pass the provider's bytes through as they come, keeping a copy for the raw tee (and, in record mode,
        logging each chunk once the client has been sent it)."""
        chunks: list[bytes] = []
        outcome = "forwarded"
        code: str | None = None
        message = ""
        try:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                yield chunk
                if observer is not None:
                    await observer.relayed(chunk)
            if observer is not None:  # logged before the response ends: the session is free when the client is
                # shielded: a client that hangs up after the last line must not cut the logging of its end short
                await asyncio.shield(asyncio.ensure_future(observer.ended("forwarded", 200)))
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_disconnected"
            self.metrics.client_disconnects.inc()
            raise
        except httpx.HTTPError as exc:
            err = stream_error(exc, upstream.name, upstream.config.timeout_s)
            outcome, code, message = "upstream_error", err.code, str(err)
            self.metrics.upstream_errors.labels(err.code).inc()
            yield _sse_error(err, call.request_id)
        finally:
            if observer is not None and outcome != "forwarded":  # its own task: this one may be cancelled
                detach(observer.ended(outcome, 200, message=message))
            _close_later(response)
            tee_outcome = {"forwarded": "complete"}.get(outcome, outcome)
            response_entry = ("response", b"".join(chunks), self._response_headers(call, 200, tee_outcome))
            self._finish(
                call, outcome, [request_entry, response_entry], upstream_s=time.perf_counter() - sent, code=code
            )

    def _response_headers(self, call: _Call, status: int, outcome: str) -> dict[str, str]:
        return {**call.tee_headers(), H_RAW_STATUS: str(status), H_RAW_OUTCOME: outcome}

    def _finish(
        self,
        call: _Call,
        outcome: str,
        entries: list[tuple[str, bytes, Mapping[str, str]]],
        *,
        upstream_s: float,
        code: str | None = None,
    ) -> None:
        self.metrics.upstream_seconds.observe(upstream_s)
        self.metrics.requests.labels(call.mode, outcome).inc()
        if self._tee is not None:
            self._tee.submit(call.session_id, entries)
        self._log_call(call, outcome, code=code, upstream_ms=round(upstream_s * 1000, 3))

    def _log_call(self, call: _Call, outcome: str, **fields: Any) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        record: dict[str, Any] = {
            "event": "gateway_request",
            "request_id": call.request_id,
            "session": call.session_id,
            "mode": call.mode,
            "outcome": outcome,
            "route": call.route or None,
            "stream": call.stream,
            "seq": call.derivation.seq if call.derivation is not None else None,
            "invariant_ms": round(call.invariant_s * 1000, 3),
            **fields,
        }
        log.info(msgspec.json.encode({k: v for k, v in record.items() if v is not None}).decode())


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


def _request_id() -> str:
    return "req-" + uuid.uuid4().hex


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


def _close_later(response: httpx.Response) -> None:
    """Close an upstream response without awaiting here (this may run inside a cancelled task)."""
    task = asyncio.get_running_loop().create_task(response.aclose())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and raising `_ClientGone`) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    raise _ClientGone


async def _route_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (plain text) in the gateway's JSON error shape, so an SDK reads a code and message."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    err: SessionLogError
    if exc.status_code == 405:
        err = MethodNotAllowed(f"{where}: method not allowed on this gateway endpoint")
    elif exc.status_code == 404:
        err = RouteNotFound(f"{where}: no such gateway endpoint (it serves POST /v1/chat/completions and "
                            "POST /v1/sessions/{id}/completions)")  # fmt: skip
    else:
        err = SessionLogError(f"{where}: {exc.detail}")
    body = error_body(err, request_id=_request_id())
    body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = {**(exc.headers or {}), **_no_retry(exc.status_code)}
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
