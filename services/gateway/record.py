"""Record mode: the gateway keeps the log for a client that only changed its base URL.

Base URL `http://HOST:PORT/record/{session_id}/v1`; under it `POST chat/completions` and `GET models`. The session
is created by its first request (and belongs to the tenant whose key made it) and continued by later ones. For each
request, before anything reaches the provider, durably:

1. the client's messages are matched against the log's derivation under `sessionlog.wireforms`' equivalence;
2. what extends it is logged: a `user` message as `user/message` (a turn opens when none is open), leading `tool`
   messages as `tool/result` paired with the open step's `tool/call`, then `step/end`, the request's own
   `step/start` and, when model, system message, tools or sampling fields changed, a `request/header`; then the
   rest of the new messages (an assistant message the client wrote itself is logged with source `client` and one
   `tool/call` per call, so that the tool messages after it pair);
3. a history edit (the messages do not extend the derivation) is either refused (`SESSIONLOG_GATEWAY_HISTORY_EDITS=
   refuse`: 409 `DERIVATION_DIVERGES`) or logged as a view replacement: the first logged message replaces every
   surface node from the first that differs to the last, its `sourceEventSeqs` naming each shadowed node. The
   replacement starts no later than the first difference and early enough to split no tool call from its result,
   and never with a tool message (a multi-node replace by a tool result is not SPEC's); messages it re-logs that
   the client kept are logged again from the log itself.

The provider then receives the derivation's wire form (`to_wire`), checked by `compare_request` like every request,
and the response is logged as it is relayed: `assistant/chunk` events (dsh's vocabulary, via
`wireforms.ResponseAssembler`), then `assistant/message` with its usage and one `tool/call` per call; a response
without tool calls ends the step and the turn (`completed`, or `max-tokens`). A client that disconnects mid-stream
ends the turn `aborted` (its chunks stay; no assistant/message, so its next request, which cannot hold the reply it
never received, still extends the log); a provider error ends it `error`; a gateway that dies leaves the turn open
under a lease that expires, and the repairer closes it (SPEC 7).

One request at a time per session: a second while the first is answered is 409 `SESSION_BUSY` (with
`x-should-retry: false`), except that a request arriving once the provider has finished waits for the last events
to be logged. The writer of a session, and with it the lease, is held between requests (the hot path appends to
the writer's in-memory session: no reload per request) and let go after `SESSIONLOG_GATEWAY_RECORD_IDLE_S` without
a request; another replica that receives a request for a session this one holds asks it to let go
(`sessionlog.gateway.release.<session>`), which it does when no request is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sessionlog.errors import (
    Conflict,
    LeaseHeld,
    LogUnavailable,
    SessionAlreadyExists,
    SessionBusy,
    SessionHeld,
    SessionLogError,
    SessionNotFound,
    http_status,
)
from sessionlog.ids import check_session_id
from sessionlog.log import SessionWriter
from sessionlog.session import DerivedMessages, FoldedHeader, Session
from sessionlog.tasks import detach
from sessionlog.wire import compare_request, parse_request, too_deep

from .derivation import Derivation
from .forward import Call, error_body, new_request_id, no_retry
from .record_events import DryRun, Exchange, write_plan
from .record_plan import Known, Plan, Planner
from .tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("sessionlog.gateway")

RELEASE_PREFIX: Final = "sessionlog.gateway.release."
_FINISH_WAIT_S: Final = 5.0
# How long a request for a busy session waits for the answer in flight to start ending: a client that gave up on an
# answer (its read timeout) and sends the request again at once can be read before its disconnect is.
_BUSY_GRACE_S: Final = 0.5
# Bytes an event adds around the message it carries (seq, time, type, turn and step, surface fields), at most.
_EVENT_ENVELOPE: Final = 1024


@dataclass(slots=True)
class _Held:
    """One session while this gateway holds its writer."""

    tenant: str
    writer: SessionWriter | None = None
    busy: bool = True
    # The answer in flight is ending (the provider finished, the client left, an error): only logging remains.
    ending: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    known: Known = field(default_factory=Known)  # what the planner keeps between requests
    dirty: bool = False  # events of a request are queued but not flushed: a failure now must not publish them
    last_used: float = field(default_factory=time.monotonic)
    # The durable log's turn was open when the request came (its client runs tools): a writer discarded then parks.
    turn_open: bool = False
    exchange: Exchange | None = None  # the response being relayed and logged


class Recorder:
    """Record mode for one gateway: held sessions, the request path and the response logging."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        settings = gateway.settings
        self.idle_s = settings.gateway_record_idle_s
        self.window_ms = settings.gateway_record_window_ms
        self.planner = Planner(history_edits=settings.gateway_history_edits, provider=gateway.record_provider)
        self._held: dict[str, _Held] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._release_sub: Any = None

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.planner.max_message_bytes = self.gateway.log.max_record_bytes - _EVENT_ENVELOPE
        nc = self.gateway.log.nc
        self._release_sub = await nc.subscribe(RELEASE_PREFIX + "*", cb=self._on_release)
        self._sweeper = asyncio.create_task(self._sweep(), name="record-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._release_sub is not None:
            with contextlib.suppress(Exception):
                await self._release_sub.unsubscribe()
        for session_id in list(self._held):
            await self._let_go(session_id)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_s, 5.0))
            now = time.monotonic()
            for session_id, held in list(self._held.items()):
                if not held.busy and now - held.last_used >= self.idle_s:
                    await self._let_go(session_id)

    async def _let_go(self, session_id: str) -> None:
        held = self._held.pop(session_id, None)
        if held is None or held.writer is None:
            return
        # A turn still open waits for the client's tool results, which may come in an hour or after this gateway
        # restarted: the lease is parked, so the repairer does not close the turn as if its writer had died.
        park = held.writer.failed is None and held.writer.session.open_turn is not None
        try:
            await held.writer.close(park=park)
        except Exception as err:  # the lease then expires on its own; nothing queued is reported written
            log.warning("record mode: closing the writer of %s: %s", session_id, err)

    async def _on_release(self, msg: Any) -> None:
        """Another replica asks for a session: let it go unless a request is in flight."""
        session_id = msg.subject[len(RELEASE_PREFIX) :]
        held = self._held.get(session_id)
        if held is None or held.writer is None:
            return  # not the holder (the asking replica hears its own question too): only the holder answers
        if held.busy:
            answer = b"busy"
        else:
            await self._let_go(session_id)
            answer = b"released"
        with contextlib.suppress(Exception):
            await msg.respond(answer)

    # ---------------------------------------------------------------------------------- endpoints

    async def models(self, request: Request) -> Response:
        request_id = new_request_id()
        try:
            self.gateway.tenants.tenant(request.headers)
            check_session_id(request.path_params["session_id"])
            data = await self.gateway.upstream_models()
        except SessionLogError as err:
            return JSONResponse(
                error_body(err, request_id=request_id),
                status_code=http_status(err),
                headers=no_retry(http_status(err)),
            )
        return Response(data, media_type="application/json")

    async def completions(self, request: Request) -> Response:
        gateway = self.gateway
        call = Call(request_id=new_request_id(), mode="record", session_id="")
        held: _Held | None = None
        try:
            tenant = gateway.tenants.tenant(request.headers)
            call.session_id = session_id = check_session_id(request.path_params["session_id"])
            held = await self._claim(session_id, tenant)
            body = await request.body()
            parsed = parse_request(body, lazy=True)
            writer = await self._writer(session_id, held, parsed)
            held.turn_open = writer.session.open_turn is not None  # all durable: nothing is queued between requests
            exchange = await self._log_request(call, held, writer, parsed)
        except (SessionLogError, RecursionError) as caught:
            err = too_deep() if isinstance(caught, RecursionError) else caught
            if held is not None:
                self._free(call.session_id, held, broken=isinstance(err, Conflict) or held.dirty)
            return gateway.refuse(call, err)
        except BaseException:
            if held is not None:
                self._free(call.session_id, held, broken=True)
            raise
        try:
            return await gateway.forward_recorded(request, call, exchange.fields, exchange.messages, exchange)
        except BaseException as exc:
            detach(exchange.ended("upstream_error", 500, message=f"{type(exc).__name__}: {exc}"))
            raise

    # ---------------------------------------------------------------------------------- holding

    async def _claim(self, session_id: str, tenant: str) -> _Held:
        """Mark the session busy for this request (synchronously, before any wait), or refuse."""
        held = self._held.get(session_id)
        # Before anything that would tell another tenant the session is in use; a held session's tenant is known
        # once its writer is open (checked against the log's header), not while a first request is on its way.
        if held is not None and held.writer is not None and held.tenant != tenant:
            raise SessionNotFound(f"session {session_id} not found")
        if held is not None and held.busy:
            if held.exchange is not None:
                held.exchange.read_relayed()  # its answer's last line may be relayed and not yet read
            if not held.ending.is_set():
                await _first_of(held.ending, held.idle, timeout=_BUSY_GRACE_S)
            if held.busy and held.ending.is_set():  # wait for its logging rather than refuse the next request
                try:
                    await asyncio.wait_for(held.idle.wait(), _FINISH_WAIT_S)
                except TimeoutError:
                    raise LogUnavailable(
                        f"session {session_id}: the answer before this request is still being logged after "
                        f"{_FINISH_WAIT_S:g}s (the log is slow or unavailable); retry"
                    ) from None
            held = self._held.get(session_id)
        if held is not None:
            if held.busy:
                raise SessionBusy(f"session {session_id} is answering another request; one request at a time")
            if held.tenant != tenant:
                raise SessionNotFound(f"session {session_id} not found")
            held.busy = True
            held.idle.clear()
            held.ending.clear()
            return held
        held = self._held[session_id] = _Held(tenant=tenant)
        return held

    def _free(self, session_id: str, held: _Held, *, broken: bool = False) -> None:
        held.busy = False
        held.exchange = None
        held.last_used = time.monotonic()
        held.idle.set()
        if broken or held.writer is None:
            if self._held.get(session_id) is held:
                del self._held[session_id]
            if held.writer is not None:
                writer = held.writer
                held.writer = None
                # What it queued is not written, and its lease is let go at once (parked if the turn was open).
                detach(writer.discard(park=held.turn_open))

    async def _writer(self, session_id: str, held: _Held, parsed: dict[str, Any]) -> SessionWriter:
        """The session's writer: the one held, or the session opened (or created) under its lease. A session is
        created only for a request whose plan against the empty session passes, written to a `DryRun` (every
        event's rules and size) and checked: a refused first request leaves nothing behind, not even an empty
        session."""
        writer = held.writer
        if writer is not None and writer.failed is None:
            return writer
        if writer is not None:  # fenced: someone else wrote; start again from the log
            held.writer = None
            held.known.memo = None
            detach(writer.abandon())
        log_ = self.gateway.log
        for attempt in range(3):
            header = await log_.header(session_id)
            try:
                if header is None:
                    trial, dry = Known(), DryRun(log_.max_record_bytes)
                    plan = self.planner.plan(trial, dry.session, parsed)
                    await write_plan(dry, plan)
                    _checked(dry.session, trial, plan)
                    held.writer = await log_.create(session_id, tenant=held.tenant)
                else:
                    if _tenant_of(header) != held.tenant:
                        raise SessionNotFound(f"session {session_id} not found")
                    held.writer = await log_.open(session_id, continue_open_turn=True)
                # What is not flushed is an answer's chunks: batched (the request and the end are flushed at once).
                held.writer.window_ms = self.window_ms
                return held.writer
            except SessionAlreadyExists:
                continue  # another replica created it in between: open it
            except LeaseHeld as held_by:
                answer = await self._ask_release(session_id) if attempt < 2 else b"busy"
                if answer == b"busy":
                    raise SessionBusy(
                        f"session {session_id} is held by another gateway replica that is answering it"
                    ) from None
                if answer != b"released":
                    ttl = held_by.ttl_s if held_by.ttl_s is not None else log_.settings.lease_ttl_s
                    raise SessionHeld(
                        f"session {session_id} is held by a writer that does not answer the gateway (a gateway "
                        f"that stopped without letting go, or an agent that writes the session itself); retry "
                        f"once its lease has expired: {held_by.message}",
                        retry_after_s=ttl,
                    ) from None
        raise SessionBusy(f"session {session_id} could not be taken")

    async def _ask_release(self, session_id: str) -> bytes | None:
        """The holding replica's answer (`released` or `busy`), or None when no replica answers: the holder is a
        gateway that is gone (its lease expires on its own) or not a gateway at all."""
        try:
            reply = await self.gateway.log.nc.request(RELEASE_PREFIX + session_id, b"", timeout=1.0)
        except Exception:
            return None
        return bytes(reply.data)

    # ---------------------------------------------------------------------------------- the request

    async def _log_request(self, call: Call, held: _Held, writer: SessionWriter, parsed: dict[str, Any]) -> Exchange:
        plan = self.planner.plan(held.known, writer.session, parsed)
        # From here on events are queued: if one is refused (a rule the plan did not foresee), or the check below
        # fails, the writer's queue is discarded before it is published, so the log keeps nothing of this request.
        held.dirty = True
        await write_plan(writer, plan)
        exchange = self._exchange(call, held, writer, plan)
        # Nothing is forwarded before the acknowledgement came.
        flushed = asyncio.ensure_future(writer.flush())
        try:
            await flushed
        except BaseException:
            flushed.cancel()  # a request cancelled while its record was in flight (the writer settles it)
            raise
        self.planner.remember(held.known, plan, writer.session)
        held.dirty = False
        return exchange

    def _exchange(self, call: Call, held: _Held, writer: SessionWriter, plan: Plan) -> Exchange:
        session = writer.session
        header, messages, expected, forwarded = _checked(session, held.known, plan)
        fields = plan.fields
        assert session.open_step is not None
        turn, step = session.open_turn or 0, session.open_step.number
        call.derivation = Derivation(
            session_id=call.session_id,
            seq=len(session) - 1,
            messages=messages,
            header=header,
            open_step=(turn, step),
            generation=session.generation,
            source="record",
        )
        call.stream = fields.get("stream") is True
        session_id = call.session_id

        def finishing() -> None:
            held.ending.set()

        def free(broken: bool) -> None:
            self._free(session_id, held, broken=broken)

        held.exchange = Exchange(session_id, writer, self.gateway.record_provider, finishing, free, forwarded,
                                 expected, turn, step)  # fmt: skip
        return held.exchange


def _checked(session: Session, known: Known, plan: Plan) -> tuple[FoldedHeader, DerivedMessages, bytes, dict[str, Any]]:
    """The one check every forwarded request passes, on the session its plan was written to: the client's fields
    against the logged header, the messages (matched by the plan under the wire forms' equivalence) as the
    derivation gives them. The folded header, the derived messages, their canonical bytes and the fields the
    provider receives; raises the divergence."""
    header = session.fold_request_header()
    assert header is not None and session.open_step is not None
    messages = session.derive_messages()
    cache = known.cache
    expected = cache.expected_messages(messages, header)
    fields = plan.fields
    divergence = compare_request({**fields, "messages": msgspec.Raw(expected)}, messages, header, cache=cache)
    if divergence is not None:
        raise divergence.error()
    transport: dict[str, Any] = {k: fields[k] for k in ("stream", "stream_options") if k in fields}
    return header, messages, expected, {**cache.expected_fields(header)[1], **transport}


async def _first_of(*events: asyncio.Event, timeout: float) -> None:
    """Return once any of `events` is set, or after `timeout` seconds."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _tenant_of(header: bytes) -> str:
    try:
        value = msgspec.json.decode(header)
    except msgspec.DecodeError:
        return DEFAULT_TENANT
    tenant = value.get("tenant") if isinstance(value, dict) else None
    return tenant if isinstance(tenant, str) and tenant else DEFAULT_TENANT


__all__ = ["RELEASE_PREFIX", "Recorder", "SessionBusy"]
