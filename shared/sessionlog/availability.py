"""Which nats-py failures mean "the log is unavailable", and the one place they become `LOG_UNAVAILABLE`.

nats-py reports a server that is gone, a cluster without quorum or a stream without a leader in many shapes:
a timeout, no responders, `NoStreamResponseError`, a 503 API answer, a closed or reconnecting connection. The
public entry points of SessionLog, StreamReader and Leases that call NATS are wrapped in `translates_unavailable`
(or a block in `unavailable_as_typed`), so callers, and the CLI's one `error CODE` line, see one typed
`LogUnavailable` that names the operation. Everything else passes through unchanged: typed SessionLogErrors and
real answers of the server (wrong last sequence, not found, a bad request), which callers switch on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Final, ParamSpec, TypeVar

import nats.errors
import nats.js.errors

from .errors import LogUnavailable, SessionLogError, js_not_yet

P = ParamSpec("P")
R = TypeVar("R")

# Since Python 3.11 asyncio.TimeoutError is TimeoutError, so this also covers nats.errors.TimeoutError and its
# FlushTimeoutError, DrainTimeoutError and FetchTimeoutError. A 503 API answer is checked by code as well:
# nats-py raises a bare APIError(code=503) on some paths (KV, object store).
UNAVAILABLE_ERRORS: Final[tuple[type[Exception], ...]] = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoServersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


def is_unavailable(err: BaseException) -> bool:
    """Whether `err` says the log did not answer (as opposed to a refusal, or one of our typed errors)."""
    if isinstance(err, SessionLogError):
        return False
    if isinstance(err, UNAVAILABLE_ERRORS):
        return True
    return isinstance(err, nats.js.errors.APIError) and getattr(err, "code", None) == 503


def is_unanswered(err: BaseException) -> bool:
    """Whether nobody was there to answer (no responders): a replica between roles right after a node was lost
    (seen for about 1.8 s on a 3-node cluster), or a stream electing its leader. Worth asking again soon, unlike
    a timeout, which has already waited."""
    if isinstance(err, nats.errors.NoRespondersError | nats.js.errors.ServiceUnavailableError):
        return True
    return isinstance(err, nats.js.errors.APIError) and getattr(err, "code", None) == 503


async def retry_unanswered(call: Callable[[], Awaitable[R]], budget_s: float) -> R:
    """`call()`, made again while nobody answers it, until `budget_s` has passed; then its failure propagates."""
    return await _again_while(is_unanswered, call, budget_s)


async def retry_unavailable(call: Callable[[], Awaitable[R]], budget_s: float) -> R:
    """`call()`, made again while the log does not answer it (`is_unavailable`, or a JetStream "not yet":
    `js_not_yet`) until `budget_s` has passed; then its failure propagates, as does any other at once (a refusal, a
    connection closed or closing). For writes that are harmless to repeat: a message with a `Nats-Msg-Id`, a KV put
    of the same value."""
    return await _again_while(_repeatable, call, budget_s)


def _repeatable(err: BaseException) -> bool:
    if isinstance(err, nats.errors.ConnectionClosedError | nats.errors.ConnectionDrainingError):
        return False
    if is_unavailable(err):
        return True
    if isinstance(err, nats.js.errors.APIError):
        return js_not_yet({"code": err.code, "err_code": err.err_code})
    return False


async def _again_while(worth: Callable[[BaseException], bool], call: Callable[[], Awaitable[R]], budget_s: float) -> R:
    deadline = time.monotonic() + budget_s
    delay = 0.05
    while True:
        try:
            return await call()
        except Exception as err:
            if not worth(err) or time.monotonic() + delay >= deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


def log_unavailable(operation: str, err: BaseException) -> LogUnavailable:
    """The typed error for `operation` failing with the nats-py error `err`."""
    name = type(err).__name__
    cause = " ".join(str(err).split()) or name
    if name not in cause:
        cause = f"{name}: {cause}"
    return LogUnavailable(
        f"{operation}: the log did not answer ({cause}); the server may be unreachable or the cluster without quorum"
    )


@contextlib.contextmanager
def unavailable_as_typed(operation: str) -> Iterator[None]:
    """Raise `LogUnavailable` naming `operation` for an unavailability error raised inside the block."""
    try:
        yield
    except Exception as err:
        if not is_unavailable(err):
            raise
        raise log_unavailable(operation, err) from err


def translates_unavailable(
    operation: str,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Decorate an async function like `unavailable_as_typed`. `operation` is formatted with the call's arguments
    by name ("open session {session_id}", "read stream {self._stream}"), only when it fails."""

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return await fn(*args, **kwargs)
            except Exception as err:
                if not is_unavailable(err):
                    raise
                raise log_unavailable(_describe(operation, signature, args, kwargs), err) from err

        return wrapper

    return decorate


def _describe(operation: str, signature: inspect.Signature, args: Any, kwargs: Any) -> str:
    try:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return operation.format_map(bound.arguments)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError):
        return operation
