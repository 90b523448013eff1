"""NATS micro services, the small shared part: JSON bodies, SPEC codes in the micro error headers, a task per
request (a handler that waits never blocks the next request), and the client side that turns an error reply
back into the typed error."""

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

from .errors import InvalidRequest, LogUnavailable, SessionLogError, error_from_code
from .metrics import REQUEST_SECONDS, REQUESTS

log = logging.getLogger("sessionlog.micro")

ERROR_CODE_HEADER: Final = "Nats-Service-Error-Code"
ERROR_HEADER: Final = "Nats-Service-Error"

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
Immediate = Callable[[bytes], bool]


def spawning(
    service: str, endpoint: str, handler: Handler, tasks: set[asyncio.Task[None]], immediate: Immediate | None = None
) -> Any:
    """A micro handler that answers each request in its own task with `handler(body) -> reply object`.

    `immediate(request data)` may say that a request has nothing to wait for (its answer is in memory): it is then
    answered at once, without a task, which halves what a burst of such requests costs. It must never say so of a
    request that waits, since the endpoint takes its next request only after an immediate one is answered.
    """

    async def answer(req: Request) -> None:
        start = time.perf_counter()
        outcome = "ok"
        try:
            try:
                body = json.loads(req.data or b"{}")
            except ValueError as exc:
                raise InvalidRequest(f"{endpoint}: request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise InvalidRequest(f"{endpoint}: request body must be a JSON object")
            reply = await handler(body)
            await req.respond(reply if isinstance(reply, bytes) else msgspec.json.encode(reply))
        except SessionLogError as err:
            outcome = err.code
            await req.respond_error(err.code, err.message, data=msgspec.json.encode(err.to_dict()))
        except Exception as err:  # a bug: answer it, keep serving
            outcome = "INTERNAL"
            log.exception("%s.%s failed", service, endpoint)
            await req.respond_error("INTERNAL", f"{type(err).__name__}: {err}")
        finally:
            REQUESTS.labels(service, endpoint, outcome).inc()
            REQUEST_SECONDS.labels(service, endpoint).observe(time.perf_counter() - start)

    async def handle(req: Request) -> None:
        if immediate is not None and immediate(req.data):
            await answer(req)
            return
        task = asyncio.create_task(answer(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return handle


async def call(nc: Client, subject: str, body: dict[str, Any], *, timeout: float) -> Any:
    """Request a micro endpoint; an error reply raises the typed error it names."""
    try:
        reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    except nats.errors.NoRespondersError:
        raise LogUnavailable(f"no service answers {subject}") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise LogUnavailable(f"{subject} did not answer within {timeout}s") from None
    headers = reply.headers or {}
    code = headers.get(ERROR_CODE_HEADER)
    if code:
        seq = None
        with contextlib.suppress(ValueError):
            seq = json.loads(reply.data).get("seq") if reply.data else None
        raise error_from_code(code, headers.get(ERROR_HEADER, ""), seq=seq)
    return json.loads(reply.data)
