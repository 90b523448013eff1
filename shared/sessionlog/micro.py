"""NATS micro services, the small shared part: requests decoded and replies encoded as `contracts` declares them,
SPEC codes in the micro error headers, a task per request (a handler that waits never blocks the next request),
and the client side (`ask`, typed; `call`, plain JSON) that turns an error reply back into the typed error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.micro.request import Request

from .contracts import Endpoint, Rep, Req
from .errors import InvalidRequest, LogUnavailable, SessionLogError, error_from_code
from .metrics import REQUEST_SECONDS, REQUESTS

log = logging.getLogger("sessionlog.micro")

ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
ERROR_HEADER: Final = "Nats-Service-Error"

Handler = Callable[[Any], Awaitable[Any]]
Immediate = Callable[[Any], bool]


class UnreadableReply(LogUnavailable):
    """A reply that does not match its endpoint's declared contract (a peer of another version, or a bug)."""


def spawning(
    endpoint: Endpoint[Any, Any], handler: Handler, tasks: set[asyncio.Task[None]], immediate: Immediate | None = None
) -> Any:
    """A micro handler that decodes each request as `endpoint` declares it and answers it in its own task with
    `handler(request) -> reply` (a Struct of the endpoint's reply type, or its encoded bytes).

    `immediate(request)` may say that a request has nothing to wait for (its answer is in memory): it is then
    answered at once, without a task, which halves what a burst of such requests costs. It must never say so of a
    request that waits, since the endpoint takes its next request only after an immediate one is answered. A
    request that does not decode is refused at once.
    """
    service, name = endpoint.service.name, endpoint.name

    async def answer(req: Request, body: Any, start: float) -> None:
        outcome = "ok"
        try:
            if isinstance(body, SessionLogError):
                raise body
            reply = await handler(body)
            await req.respond(reply if isinstance(reply, bytes) else msgspec.json.encode(reply))
        except SessionLogError as err:
            outcome = err.code
            await req.respond_error(err.code, err.message, data=msgspec.json.encode(err.to_dict()))
        except Exception as err:  # a bug: answer it, keep serving
            outcome = "INTERNAL"
            log.exception("%s.%s failed", service, name)
            await req.respond_error("INTERNAL", f"{type(err).__name__}: {err}")
        finally:
            REQUESTS.labels(service, name, outcome).inc()
            REQUEST_SECONDS.labels(service, name).observe(time.perf_counter() - start)

    async def handle(req: Request) -> None:
        start = time.perf_counter()
        try:
            body: Any = endpoint.decode_request(req.data)
        except InvalidRequest as err:
            body = err
        if isinstance(body, SessionLogError) or (immediate is not None and immediate(body)):
            await answer(req, body, start)
            return
        task = asyncio.create_task(answer(req, body, start))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return handle


def refusal(headers: dict[str, str] | None, data: bytes) -> SessionLogError | None:
    """The typed error an error reply carries (its code in the micro error headers, its seq in the body); None for
    a reply that is not an error."""
    headers = headers or {}
    code = headers.get(ERROR_CODE_HEADER)
    if not code:
        return None
    seq = None
    with contextlib.suppress(ValueError, AttributeError):
        seq = json.loads(data).get("seq") if data else None
    return error_from_code(code, headers.get(ERROR_HEADER, ""), seq=seq if type(seq) is int else None)


async def ask(
    nc: Client, endpoint: Endpoint[Req, Rep], request: Req, *, timeout: float, subject: str | None = None
) -> Rep:
    """Request an endpoint (at `subject` when given, else its own) with its declared request; its declared reply, or
    the typed error an error reply names. A reply that does not match the contract is `UnreadableReply`."""
    subject = subject or endpoint.subject
    data = await _request(nc, subject, msgspec.json.encode(request), timeout)
    try:
        return endpoint.decode_reply(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise UnreadableReply(f"{subject} answered a reply that does not match its contract: {exc}") from None


async def call(nc: Client, subject: str, body: dict[str, Any], *, timeout: float) -> Any:
    """Request a micro endpoint with a plain JSON body; its reply as plain data, or the typed error it names."""
    return json.loads(await _request(nc, subject, json.dumps(body).encode(), timeout))


async def _request(nc: Client, subject: str, payload: bytes, timeout: float) -> bytes:
    """The reply's body; no responder or no answer in time is `LOG_UNAVAILABLE`, an error reply its typed error."""
    try:
        reply = await nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise LogUnavailable(f"no service answers {subject}") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise LogUnavailable(f"{subject} did not answer within {timeout}s") from None
    error = refusal(reply.headers, reply.data)
    if error is not None:
        raise error
    return reply.data
