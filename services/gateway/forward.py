"""Forwarding a checked request to its provider and relaying the answer: the call's bookkeeping (metrics, the raw
tee, one log line per request), client disconnects while the provider is asked or answers, provider failures as
OpenAI-style errors (an SSE `error` event once a stream has started), and an `Observer` (record mode's logging)
told of each relayed byte and of the end.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sessionlog.errors import LogUnavailable, SessionLogError, UpstreamError, http_status
from sessionlog.openai_wire import done_line_at, ends_with_done
from sessionlog.record import H_RAW_OUTCOME, H_RAW_SESSION_SEQ, H_RAW_STATUS
from sessionlog.tasks import detach

from .derivation import Derivation
from .metrics import GatewayMetrics
from .tee import H_REQUEST_ID, RawTee
from .upstream import (
    Upstream,
    UpstreamIOError,
    UpstreamResponse,
    gateway_status_for,
    stream_error,
    upstream_error_message,
)

log = logging.getLogger("sessionlog.gateway")

H_RESPONSE_REQUEST_ID: Final = "x-sessionlog-request-id"
H_RESPONSE_SEQ: Final = "x-sessionlog-session-seq"
H_SHOULD_RETRY: Final = "x-should-retry"

T = TypeVar("T")


class Observer(Protocol):
    """Follows one forwarded exchange (record mode logs the response through it)."""

    async def relayed(self, data: bytes) -> None:
        """Bytes of a streamed answer, once the client has been sent them."""

    async def ended(
        self, outcome: str, status: int, *, body: bytes | None = None, message: str = "", code: str | None = None
    ) -> bool:
        """The exchange is over (called once): `forwarded` (with the whole body when not streamed),
        `client_disconnected` or `upstream_error` (`code`: the gateway's own finding, when the provider was not
        reached or broke off, rather than answering an error status). Whether its end is durably logged: an answer
        whose end is not reaches the client as an error, never as complete."""


class ClientGone(Exception):
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


def leading_path(message: str) -> str | None:
    found = _LEADING_PATH.match(message)
    return found.group() if found is not None else None


def no_retry(status: int) -> dict[str, str]:
    """A refusal (4xx) is final: the same request gets the same verdict. The official SDKs retry 409 (and 408, 429)
    twice unless the server says `x-should-retry: false`, which tripled every refusal and its bounded wait."""
    return {H_SHOULD_RETRY: "false"} if 400 <= status < 500 else {}


def provider_advice(headers: Mapping[str, str]) -> dict[str, str]:
    """The provider's response headers a client acts on, relayed as they came: when to retry (`retry-after`,
    `retry-after-ms`) and its rate limits (`x-ratelimit-*`), which the SDKs read and expose."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in _RETRY_HEADERS or k.lower().startswith(
        "x-ratelimit-")}  # fmt: skip


_RETRY_HEADERS: Final = frozenset({"retry-after", "retry-after-ms"})


def sse_error(err: SessionLogError, request_id: str) -> bytes:
    return b"data: " + msgspec.json.encode(error_body(err, request_id=request_id)) + b"\n\n"


@dataclass(slots=True)
class Call:
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


@dataclass(slots=True)
class _Flight:
    """A request sent upstream: its call, route and answer, what the tee gets of the request, when it was sent, and
    who follows it."""

    call: Call
    upstream: Upstream
    response: UpstreamResponse
    request_entry: tuple[str, bytes, Mapping[str, str]]
    sent: float
    observer: Observer | None


class Forwarder:
    """Sends checked requests upstream and relays the answers, for one gateway (its metrics and raw tee)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.tee: RawTee | None = None  # set when the gateway starts

    async def forward(
        self, request: Request, call: Call, upstream: Upstream, body: bytes, observer: Observer | None = None
    ) -> Response:
        sent = time.perf_counter()
        request_entry = ("request", body, call.tee_headers())
        try:
            response = await _unless_disconnected(request, upstream.open(body))
        except ClientGone:
            self.metrics.client_disconnects.inc()
            self._finish(call, "client_disconnected", [request_entry], upstream_s=time.perf_counter() - sent)
            if observer is not None:
                await observer.ended("client_disconnected", 499)
            return Response(status_code=499)
        except SessionLogError as err:
            self.metrics.upstream_errors.labels(err.code).inc()
            self._finish(call, "upstream_error", [request_entry], upstream_s=time.perf_counter() - sent, code=err.code)
            if observer is not None:
                await observer.ended("upstream_error", http_status(err), message=str(err), code=err.code)
            return JSONResponse(error_body(err, request_id=call.request_id), status_code=http_status(err))
        except BaseException:
            if observer is not None:
                detach(observer.ended("client_disconnected", 499))
            raise
        self.metrics.upstream_first_byte_seconds.observe(time.perf_counter() - sent)
        headers = {H_RESPONSE_REQUEST_ID: call.request_id, **provider_advice(response.headers)}
        if call.derivation is not None:
            headers[H_RESPONSE_SEQ] = str(call.derivation.seq)
        flight = _Flight(call, upstream, response, request_entry, sent, observer)
        if response.status_code != 200:
            return await self._upstream_failed(request, flight)
        if call.stream:
            return RelayResponse(
                self._relay(flight),
                media_type=response.headers.get("content-type", "text/event-stream"),
                headers={**headers, "cache-control": "no-cache"},
            )
        try:
            data = await _unless_disconnected(request, response.aread())
        except ClientGone:
            self.metrics.client_disconnects.inc()
            _close_later(response)
            self._finish(call, "client_disconnected", [request_entry], upstream_s=time.perf_counter() - sent)
            if observer is not None:
                await observer.ended("client_disconnected", 499)
            return Response(status_code=499)
        except UpstreamIOError as exc:
            failure = stream_error(exc, upstream.name, upstream.config.timeout_s)
            _close_later(response)
            self.metrics.upstream_errors.labels(failure.code).inc()
            self._finish(
                call, "upstream_error", [request_entry], upstream_s=time.perf_counter() - sent, code=failure.code
            )
            if observer is not None:
                await observer.ended("upstream_error", http_status(failure), message=str(failure), code=failure.code)
            return JSONResponse(error_body(failure, request_id=call.request_id), status_code=http_status(failure))
        await response.aclose()
        logged = True
        if observer is not None:  # logged before the client has the answer: the session is free when it does
            # shielded, as a stream's end is: a cancelled request (a shutdown) must not cut the logging short
            logged = await asyncio.shield(asyncio.ensure_future(observer.ended("forwarded", 200, body=data)))
        response_entry = ("response", data, self._response_headers(call, response.status_code, "complete"))
        self._finish(call, "forwarded", [request_entry, response_entry], upstream_s=time.perf_counter() - sent)
        if not logged:  # the client never has an answer the log does not hold
            unlogged = _unlogged(call.session_id)
            return JSONResponse(error_body(unlogged, request_id=call.request_id), status_code=http_status(unlogged),
                                headers={H_RESPONSE_REQUEST_ID: call.request_id})  # fmt: skip
        return Response(data, media_type=response.headers.get("content-type", "application/json"), headers=headers)

    async def _upstream_failed(self, request: Request, flight: _Flight) -> Response:
        call, response, observer = flight.call, flight.response, flight.observer
        try:
            data = await _unless_disconnected(request, response.aread())
        except (ClientGone, UpstreamIOError):
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
        self._finish(call, "upstream_error", [flight.request_entry, response_entry],
                     upstream_s=time.perf_counter() - flight.sent, code=err.code)  # fmt: skip
        body = error_body(err, request_id=call.request_id)
        body["error"]["upstream_status"] = status
        # The provider's own retry advice (a 429's `retry-after`) is the client's to follow, not the gateway's.
        advice = provider_advice(response.headers)
        if (should := response.headers.get(H_SHOULD_RETRY)) is not None:
            advice[H_SHOULD_RETRY] = should
        return JSONResponse(body, status_code=err.status, headers={H_RESPONSE_REQUEST_ID: call.request_id, **advice})

    async def _relay(self, flight: _Flight) -> AsyncIterator[bytes]:
        """Pass the provider's bytes through as they come, keeping a copy for the raw tee (and, in record mode,
        logging each chunk once the client has been sent it)."""
        call, upstream, response, observer = flight.call, flight.upstream, flight.response, flight.observer
        chunks: list[bytes] = []
        observed = 0  # how many of `chunks` the observer was given
        ending = False  # the observer is logging the end
        outcome = "forwarded"
        code: str | None = None
        message = ""
        gate = DoneGate()  # in record mode, the answer's last line waits until the answer is logged
        try:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                if observer is None:
                    yield chunk
                    continue
                if now := gate.feed(chunk):
                    yield now
                await observer.relayed(chunk)
                observed += 1
                if gate.last is not None:
                    break  # the answer is over (a provider may keep its body open a while after the line)
            if observer is not None:  # logged before the response ends: the session is free when the client is
                if gate.held:
                    yield gate.held  # the body ended inside a line: it was not the last line
                ending = True
                # shielded: a client that hangs up after the last line must not cut the logging of its end short
                if await asyncio.shield(asyncio.ensure_future(observer.ended("forwarded", 200))):
                    if gate.last is not None:
                        yield gate.last  # the answer is complete for the client once it is in the log
                else:
                    yield sse_error(_unlogged(call.session_id), call.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            # A client that hangs up once it has the stream's last line (the OpenAI Python SDK closes a stream as
            # soon as it reads `data: [DONE]`, and a provider may end its body a moment later) had the whole answer.
            if not ending and not ends_with_done(chunks):
                outcome = "client_disconnected"
                self.metrics.client_disconnects.inc()
            raise
        except UpstreamIOError as exc:
            err = stream_error(exc, upstream.name, upstream.config.timeout_s)
            outcome, code, message = "upstream_error", err.code, str(err)
            self.metrics.upstream_errors.labels(err.code).inc()
            yield sse_error(err, call.request_id)
            if observer is not None:  # as for an answer: the end is logged before the response ends
                ending = True
                await asyncio.shield(
                    asyncio.ensure_future(_end_observed(observer, chunks[observed:], outcome, message, code))
                )
        finally:
            if observer is not None and not ending:  # its own task: this one may be cancelled
                detach(_end_observed(observer, chunks[observed:], outcome, message, code))
            _close_later(response)
            tee_outcome = {"forwarded": "complete"}.get(outcome, outcome)
            response_entry = ("response", b"".join(chunks), self._response_headers(call, 200, tee_outcome))
            upstream_s = time.perf_counter() - flight.sent
            self._finish(call, outcome, [flight.request_entry, response_entry], upstream_s=upstream_s, code=code)

    def _response_headers(self, call: Call, status: int, outcome: str) -> dict[str, str]:
        return {**call.tee_headers(), H_RAW_STATUS: str(status), H_RAW_OUTCOME: outcome}

    def _finish(
        self,
        call: Call,
        outcome: str,
        entries: list[tuple[str, bytes, Mapping[str, str]]],
        *,
        upstream_s: float,
        code: str | None = None,
    ) -> None:
        self.metrics.upstream_seconds.observe(upstream_s)
        self.metrics.requests.labels(call.mode, outcome).inc()
        if self.tee is not None:
            self.tee.submit(call.session_id, entries)
        self.log_call(call, outcome, code=code, upstream_ms=round(upstream_s * 1000, 3))

    def log_call(self, call: Call, outcome: str, **fields: Any) -> None:
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


class RelayResponse(StreamingResponse):
    """A streamed answer relayed as it comes, stopped when the client disconnects.

    Starlette's `StreamingResponse` watches for the disconnect in an anyio task group, which costs more per request
    than the rest of the relay; here one plain task watches and cancels the relaying task (the relay's generator
    then ends the exchange as `client_disconnected`)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relaying = asyncio.current_task()
        assert relaying is not None
        gone = asyncio.ensure_future(_wait_disconnect_message(receive))
        gone.add_done_callback(lambda task: task.cancelled() or relaying.cancel())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # cancelled from elsewhere, not by the client's disconnect
            relaying.uncancel()
        finally:
            gone.cancel()


async def _wait_disconnect_message(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex


async def _end_observed(
    observer: Observer, unobserved: list[bytes], outcome: str, message: str, code: str | None
) -> None:
    """Give the observer what was relayed but not yet given to it, then end its exchange."""
    if outcome == "forwarded":
        for chunk in unobserved:
            await observer.relayed(chunk)
    await observer.ended(outcome, 200, message=message, code=code)


class DoneGate:
    """A streamed answer's bytes as record mode relays them: at once, but for its last line, `data: [DONE]`, which
    waits until the answer is logged (`last`, ending in a blank line). A piece's unfinished last line that could be
    the start of `data: [DONE]` is held until the next piece tells (`held`), so a done line split over two pieces
    is found too."""

    __slots__ = ("held", "last")

    def __init__(self) -> None:
        self.held = b""
        self.last: bytes | None = None

    def feed(self, piece: bytes) -> bytes:
        """The bytes of `piece` to relay now (with what was held before it)."""
        data = self.held + piece if self.held else piece
        self.held = b""
        cut = done_line_at(data)
        if cut >= 0:
            last = data[cut:]
            if not last.endswith((b"\n\n", b"\r\n\r\n")):
                last = last.rstrip(b"\r\n") + b"\n\n"
            self.last = last
            return data[:cut]
        line_start = data.rfind(b"\n") + 1
        tail = data[line_start:].rstrip(b"\r")
        if tail and any(form.startswith(tail) for form in _DONE_FORMS):
            self.held = data[line_start:]
            return data[:line_start]
        return data


_DONE_FORMS: Final = (b"data: [DONE]", b"data:[DONE]")


def _unlogged(session_id: str) -> LogUnavailable:
    return LogUnavailable(f"session {session_id}: the provider's answer could not be logged, so it is not given as "
                          "complete; ask again (the log keeps what was logged of it)")  # fmt: skip


def _close_later(response: UpstreamResponse) -> None:
    """Close an upstream response without awaiting here (this may run inside a cancelled task)."""
    task = asyncio.get_running_loop().create_task(response.aclose())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _wait_disconnect(request: Request) -> None:
    await _wait_disconnect_message(request.receive)


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable` in this task, cancelling it (and raising `ClientGone`) if the client disconnects first. One
    watching task cancels this one: cheaper than running the work in a task of its own and waiting on both."""
    task = asyncio.current_task()
    assert task is not None
    watching = True

    def disconnected(watcher: asyncio.Future[None]) -> bool:
        return watcher.done() and not watcher.cancelled() and watcher.exception() is None

    def on_watcher_done(watcher: asyncio.Future[None]) -> None:
        if watching and disconnected(watcher):
            task.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await awaitable
    except asyncio.CancelledError:
        # ours (the client left) unless another cancellation is pending too, which then goes on
        if disconnected(watcher) and task.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        watching = False
        watcher.cancel()
