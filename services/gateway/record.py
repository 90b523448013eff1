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
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sessionlog.errors import (
    Conflict,
    DerivationDiverges,
    InvalidRequest,
    LeaseHeld,
    SessionAlreadyExists,
    SessionBusy,
    SessionLogError,
    SessionNotFound,
    http_status,
)
from sessionlog.events import ToolCallBlock, ToolResultBlock
from sessionlog.ids import check_session_id
from sessionlog.log import SessionWriter
from sessionlog.session import DerivedMessage, Session
from sessionlog.surface import ReplaceOp
from sessionlog.tasks import detach
from sessionlog.wire import PHRASE, WireCache, compare_request, parse_request, too_deep
from sessionlog.wireforms import (
    ResponseAssembler,
    SseLines,
    canonical,
    content_text,
    logged_message,
    normal_message,
    request_header,
    without_reasoning,
)

from .derivation import Derivation
from .tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("sessionlog.gateway")

RELEASE_PREFIX: Final = "sessionlog.gateway.release."
_FINISH_WAIT_S: Final = 5.0
_msg_decoder: Final = msgspec.json.Decoder(list[Any])


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass(slots=True)
class _Held:
    """One session while this gateway holds its writer."""

    tenant: str
    writer: SessionWriter | None = None
    busy: bool = True
    finishing: asyncio.Event | None = None  # set when the provider has finished and only logging remains
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    cache: WireCache = field(default_factory=WireCache)
    # The last request's messages bytes, where its closing bracket is, its message count and system message, and
    # the generation its messages were all logged in: the next request that starts with those bytes (an agent's
    # next request repeats its context) is matched from there, so a request costs O(new messages).
    memo: tuple[bytes, int, int, dict[str, Any] | None, int] | None = None
    header: tuple[bytes, bytes] | None = None  # the folded header's bytes and their canonical form
    dirty: bool = False  # events of a request are queued but not flushed: a failure now must not publish them
    last_used: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Client:
    """A request's messages: the system message, and the conversation (only its tail decoded on a memo hit)."""

    system: dict[str, Any] | None
    known: int  # conversation messages known to equal the derivation's first `known`
    tail: list[dict[str, Any]]  # the rest, in canonical wire form
    raw: bytes

    @property
    def count(self) -> int:
        return self.known + len(self.tail)


@dataclass(slots=True)
class _New:
    """One message to log: its role on the wire, its logged Message, an assistant message's tool calls and a tool
    message's call id."""

    role: str
    message: dict[str, Any]
    calls: list[dict[str, str]]  # an assistant message's tool calls, logged as tool/call after it
    call_id: str = ""  # a tool message's call


class Recorder:
    """Record mode for one gateway: held sessions, the request path and the response logging."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        settings = gateway.settings
        self.history_edits = settings.gateway_history_edits
        self.idle_s = settings.gateway_record_idle_s
        self._held: dict[str, _Held] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._release_sub: Any = None

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
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
        try:
            await held.writer.close()
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
        from .app import _no_retry, _request_id, error_body

        request_id = _request_id()
        try:
            self.gateway.tenants.tenant(request.headers)
            check_session_id(request.path_params["session_id"])
            data = await self.gateway.upstream_models()
        except SessionLogError as err:
            return JSONResponse(
                error_body(err, request_id=request_id),
                status_code=http_status(err),
                headers=_no_retry(http_status(err)),
            )
        return Response(data, media_type="application/json")

    async def completions(self, request: Request) -> Response:
        from .app import _Call, _request_id

        gateway = self.gateway
        call = _Call(request_id=_request_id(), mode="record", session_id="")
        held: _Held | None = None
        try:
            tenant = gateway.tenants.tenant(request.headers)
            call.session_id = session_id = check_session_id(request.path_params["session_id"])
            held = await self._claim(session_id, tenant)
            body = await request.body()
            parsed = parse_request(body, lazy=True)
            writer = await self._writer(session_id, held)
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
        if held is not None and held.busy and held.finishing is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.idle.wait(), _FINISH_WAIT_S)
            held = self._held.get(session_id)
        if held is not None:
            if held.busy:
                raise SessionBusy(f"session {session_id} is answering another request; one request at a time")
            if held.tenant != tenant:
                raise SessionNotFound(f"session {session_id} not found")
            held.busy = True
            held.idle.clear()
            return held
        held = self._held[session_id] = _Held(tenant=tenant)
        return held

    def _free(self, session_id: str, held: _Held, *, broken: bool = False) -> None:
        held.busy = False
        held.finishing = None
        held.last_used = time.monotonic()
        held.idle.set()
        if broken or held.writer is None:
            if self._held.get(session_id) is held:
                del self._held[session_id]
            if held.writer is not None:
                writer = held.writer
                held.writer = None
                detach(writer.abandon())

    async def _writer(self, session_id: str, held: _Held) -> SessionWriter:
        """The session's writer: the one held, or the session opened (or created) under its lease."""
        writer = held.writer
        if writer is not None and writer.failed is None:
            return writer
        if writer is not None:  # fenced: someone else wrote; start again from the log
            held.writer = None
            held.memo = None
            detach(writer.abandon())
        log_ = self.gateway.log
        for attempt in range(3):
            header = await log_.header(session_id)
            try:
                if header is None:
                    held.writer = await log_.create(session_id, tenant=held.tenant)
                else:
                    if _tenant_of(header) != held.tenant:
                        raise SessionNotFound(f"session {session_id} not found")
                    held.writer = await log_.open(session_id, continue_open_turn=True)
                return held.writer
            except SessionAlreadyExists:
                continue  # another replica created it in between: open it
            except LeaseHeld:
                if attempt == 2 or not await self._ask_release(session_id):
                    raise SessionBusy(
                        f"session {session_id} is held by another gateway replica that is answering it"
                    ) from None
        raise SessionBusy(f"session {session_id} could not be taken")

    async def _ask_release(self, session_id: str) -> bool:
        try:
            reply = await self.gateway.log.nc.request(RELEASE_PREFIX + session_id, b"", timeout=1.0)
        except Exception:
            return False  # nobody answers: the holder is gone, and its lease expires on its own
        return bool(reply.data == b"released")

    # ---------------------------------------------------------------------------------- the request

    def _client(self, held: _Held, session: Session, raw: bytes) -> _Client:
        memo = held.memo
        if memo is not None and memo[4] == session.generation:
            before, close, count, system, _ = memo
            if raw == before:
                return _Client(system, count, [], raw)
            if raw.startswith(memoryview(before)[:close]):
                rest = raw[close:].lstrip()
                if rest.startswith(b","):
                    tail = _msg_decoder.decode(b"[" + rest[1:])
                    return _Client(system, count, [_loggable(m, f"$.messages[{count + i + (system is not None)}]")
                                                   for i, m in enumerate(tail)], raw)  # fmt: skip
        try:
            messages = _msg_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"$.messages must be an array of messages: {exc}") from None
        system = None
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            system = normal_message(messages[0], "$.messages[0]")
            messages = messages[1:]
        offset = 1 if system is not None else 0
        return _Client(system, 0, [_loggable(m, f"$.messages[{i + offset}]") for i, m in enumerate(messages)], raw)

    async def _log_request(self, call: Any, held: _Held, writer: SessionWriter, parsed: dict[str, Any]) -> _Exchange:
        session = writer.session
        raw = parsed.get("messages")
        if not isinstance(raw, msgspec.Raw):
            raise InvalidRequest("a chat-completions request needs a `messages` array")
        client = self._client(held, session, bytes(raw))
        if client.count == 0:
            raise InvalidRequest("$.messages: a request needs at least one message besides the system message")
        derived = session.derive_messages()
        p = client.known
        while p < len(derived) and p < client.count and self._matches(held.cache, client.tail[p - client.known],
                                                                           derived[p]):  # fmt: skip
            p += 1
        system = content_text(client.system.get("content"), "$.messages[0]") if client.system is not None else None
        fields = {k: v for k, v in parsed.items() if k != "messages"}
        header = request_header(fields, provider=self.gateway.record_provider, system=system)
        folded = session.fold_request_header()
        if folded is not None and (held.header is None or held.header[0] != folded.raw):
            held.header = (folded.raw, canonical(folded.to_builtins()))
        header_changed = folded is None or held.header is None or canonical(header) != held.header[1]
        keeps_tail = False
        if p < len(derived):
            if self.history_edits == "refuse":
                offset = 1 if client.system is not None else 0
                raise DerivationDiverges(
                    f"request {PHRASE} at $.messages[{p + offset}] (the derived message at seq {derived[p].seq}): "
                    "the client's messages do not extend the log (a compaction, truncation or edit), and this "
                    "gateway refuses history edits (SESSIONLOG_GATEWAY_HISTORY_EDITS=refuse)",
                    seq=derived[p].seq,
                )
            summary = self._summary_edit(held.cache, derived, client, p)
            start, new = summary if summary is not None else self._edit(session, derived, client, p)
            keeps_tail = summary is not None
        else:
            start, new = (
                None,
                [self._to_log(m, client.known + i) for i, m in enumerate(client.tail[p - client.known :])],
            )
        await self._write(
            held, writer, new, start, header if header_changed else None, folded is None, keeps_tail=keeps_tail
        )
        await writer.flush()
        held.dirty = False
        session = writer.session
        held.memo = (client.raw, len(client.raw.rstrip()) - 1, client.count, client.system, session.generation)
        return self._exchange(call, held, writer, fields)

    @staticmethod
    def _matches(cache: WireCache, message: dict[str, Any], derived: DerivedMessage) -> bool:
        fragment = cache.fragment(derived)
        mine = canonical(message)
        if mine == fragment:
            return True
        if message.get("role") != "assistant" or "reasoning_content" in message:
            return False
        # A client need not echo reasoning: the logged message with it is the one the client holds without it.
        return mine == canonical(without_reasoning(msgspec.json.decode(fragment)))

    def _to_log(self, wire: dict[str, Any], index: int) -> _New:
        where = f"$.messages[{index}]"
        role = wire["role"]
        prefix = {"user": "user", "tool": "result", "assistant": "client"}.get(role, "msg")
        message = logged_message(wire, _new_id(prefix), where)
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in wire.get("tool_calls") or ()]  # fmt: skip
        return _New(role, message, calls, wire.get("tool_call_id", ""))

    @staticmethod
    def _relog(derived: DerivedMessage) -> _New:
        """A message the client kept, logged again (in a replacement's range) from the logged bytes. An assistant
        message's source becomes `client` (with `relogOf`, the seq it repeats): the client supplied it in this
        request, and the audit must not take it for a new answer of the model."""
        message = msgspec.json.decode(derived.raw)
        message["id"] = _new_id("relog")
        blocks = derived.message.content
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        if results:
            return _New("tool", message, [], results[0].tool_call_id)
        if derived.message.role == "assistant":
            message["source"] = {"kind": "client", "relogOf": derived.seq}
        calls = [{"id": b.id, "name": b.name, "arguments": b.arguments} for b in blocks if isinstance(b, ToolCallBlock)]
        return _New(derived.message.role, message, calls)

    def _summary_edit(
        self, cache: WireCache, derived: Any, client: _Client, p: int
    ) -> tuple[tuple[int, int, list[int]], list[_New]] | None:
        """The usual compaction: the client put one message (a summary) where derived messages `p..j-1` were and
        kept `j..` as they are, then maybe added new ones. That is one replacement of exactly those nodes, and the
        kept messages stay on the surface as the same events (never logged twice). None when the request is not of
        that shape, or when the range would split a tool call from its result (the general edit handles those)."""
        count, n = client.count, len(derived)
        summary = client.tail[p - client.known] if p < count else None
        if summary is None or summary.get("role") not in ("user", "assistant") or summary.get("tool_calls"):
            return None

        def kept_from(j: int) -> bool:
            kept = n - j
            return p + 1 + kept <= count and all(
                self._matches(cache, client.tail[p + 1 + i - client.known], derived[j + i]) for i in range(kept)
            )

        end = next((j for j in range(p + 1, n) if kept_from(j)), None)
        if end is None:
            return None
        inside = range(p, end)
        calls = {b.id for i in inside for b in derived[i].message.content if isinstance(b, ToolCallBlock)}
        results = {b.tool_call_id for i in inside for b in derived[i].message.content if isinstance(b, ToolResultBlock)}
        answered_after = {
            b.tool_call_id for i in range(end, n) for b in derived[i].message.content if isinstance(b, ToolResultBlock)
        }
        added_results = {str(m.get("tool_call_id")) for m in client.tail[p + 1 + n - end - client.known :]}
        if calls != results or calls & (answered_after | added_results):
            return None  # a pair would be split (or a call answered outside the range): not this simple shape
        shadowed = [derived[i].seq for i in inside]
        new = [self._to_log(summary, p)]
        new += [self._to_log(m, p + 1 + n - end + i)
                for i, m in enumerate(client.tail[p + 1 + n - end - client.known :])]  # fmt: skip
        return (derived[p].seq, derived[end - 1].seq, shadowed), new

    def _edit(
        self, session: Session, derived: Any, client: _Client, p: int
    ) -> tuple[tuple[int, int, list[int]], list[_New]]:
        """The replacement for a history edit that first differs at conversation message `p`: the node range it
        shadows, its provenance, and the messages to log from there."""
        count = client.count
        calls_at: dict[str, int] = {}  # call id -> index of the derived assistant message that announced it
        result_call: list[int] = []  # per derived message: index of its call's message (-1: not a tool result)
        for i, message in enumerate(derived):
            found = -1
            for block in message.message.content:
                if isinstance(block, ToolCallBlock):
                    calls_at[block.id] = i
                elif isinstance(block, ToolResultBlock):
                    found = calls_at.get(block.tool_call_id, -1)
            result_call.append(found)
        s = min(p, count - 1)

        def role(i: int) -> str:
            if i >= client.known:
                return str(client.tail[i - client.known]["role"])
            return "tool" if result_call[i] >= 0 or _is_result(derived[i]) else derived[i].message.role

        while s >= 0:
            split = min((result_call[j] for j in range(s, len(derived)) if 0 <= result_call[j] < s), default=s)
            if split < s:
                s = split
            elif role(s) == "tool":
                s -= 1
            else:
                break
        if s < 0:
            raise DerivationDiverges(
                f"request {PHRASE} at $.messages: the history edit cannot be logged as a view replacement (it would "
                "start with a tool result whose call is not in the request)",
                seq=derived[p].seq if p < len(derived) else None,
            )
        nodes = session.surface.nodes
        start, end = derived[s].seq, nodes[-1]
        plan = session.surface.plan_replace(len(session), ReplaceOp(start=start, end=end))
        # Messages before the first difference are logged again from the log's own bytes (reasoning included).
        new = [self._relog(derived[i]) if i < p else self._to_log(client.tail[i - client.known], i)
               for i in range(s, count)]  # fmt: skip
        return (start, end, sorted(plan.shadowed)), new

    async def _write(
        self,
        held: _Held,
        writer: SessionWriter,
        new: list[_New],
        replace: tuple[int, int, list[int]] | None,
        header: dict[str, Any] | None,
        initial: bool,
        *,
        keeps_tail: bool = False,
    ) -> None:
        """Log the request: plan every pairing first, so a refusal leaves the log unchanged, then append.

        With `keeps_tail` (a summary edit), `new[0]` replaces a range in the middle and the nodes after it stay, so
        tool results answering the open step's calls are logged in that step first, like an extension's."""
        session = writer.session
        step = session.open_step
        first = 1 if keeps_tail else 0
        lead = first
        if (replace is None or keeps_tail) and step is not None:
            answered = set(step.results)
            while lead < len(new) and new[lead].role == "tool" and new[lead].call_id in step.calls:
                if new[lead].call_id in answered:
                    break
                answered.add(new[lead].call_id)
                lead += 1
        leading = new[first:lead]
        rest = new[:first] + new[lead:]
        announced: set[str] = set()
        for item in rest:
            if item.role == "assistant":
                announced.update(c["id"] for c in item.calls)
            elif item.role == "tool" and item.call_id not in announced:
                raise DerivationDiverges(
                    f"request {PHRASE} at $.messages: a tool message answers call {item.call_id!r}, which no "
                    "assistant message of the open step or of this request made"
                )
        # From here on events are queued: if one is refused (a rule this plan did not foresee), the writer is
        # abandoned before its queue is published, so the log keeps nothing of this request.
        held.dirty = True
        turn = session.open_turn
        if turn is None:
            turn = session.last_turn + 1
            await writer.emit("turn/start", {"turn": turn})
        for item in leading:
            await self._tool_result(
                writer, turn, step.number if step else 0, item, session.tool_call_event(item.call_id)
            )
        if session.open_step is not None:
            await writer.emit("step/end", {"turn": turn, "step": session.open_step.number})
        number = session.last_step + 1 if session.open_turn == turn and session.last_step else 1
        await writer.emit("step/start", {"turn": turn, "step": number})
        if header is not None:
            await writer.emit("request/header", {"header": header, "reason": "initial" if initial else "change"})
        calls: dict[str, int] = {}
        for i, item in enumerate(rest):
            surface: dict[str, Any] = {"surface_op": "append"}
            if i == 0 and replace is not None:
                start, end, shadowed = replace
                surface = {"surface_op": {"op": "replace", "start": start, "end": end}, "source_event_seqs": shadowed}
            if item.role == "user":
                await writer.emit("user/message", item.message, **surface)
            elif item.role == "assistant":
                if surface["surface_op"] == "append":
                    surface["source_event_seqs"] = []
                data = {"turn": turn, "step": number, "message": item.message}
                await writer.emit("assistant/message", data, **surface)
                for c in item.calls:
                    call_data = {"turn": turn, "step": number, "callId": c["id"], "name": c["name"],
                                 "arguments": c["arguments"]}  # fmt: skip
                    event = await writer.emit("tool/call", call_data)
                    calls[c["id"]] = event.seq
            else:
                await self._tool_result(writer, turn, number, item, calls.get(item.call_id))

    @staticmethod
    async def _tool_result(writer: SessionWriter, turn: int, step: int, item: _New, call_seq: int | None) -> None:
        data = {"turn": turn, "step": step, "message": item.message}
        seqs = [call_seq] if call_seq is not None else UNSET
        await writer.emit("tool/result", data, surface_op="append", source_event_seqs=seqs)

    def _exchange(self, call: Any, held: _Held, writer: SessionWriter, fields: dict[str, Any]) -> _Exchange:
        session = writer.session
        header = session.fold_request_header()
        assert header is not None and session.open_step is not None
        messages = session.derive_messages()
        cache = held.cache
        expected = cache.expected_messages(messages, header)
        # The one check every forwarded request passes: the client's fields against the logged header, the
        # messages (matched above under the wire forms' equivalence) as the derivation gives them.
        divergence = compare_request({**fields, "messages": msgspec.Raw(expected)}, messages, header, cache=cache)
        if divergence is not None:
            raise divergence.error()
        transport: dict[str, Any] = {k: fields[k] for k in ("stream", "stream_options") if k in fields}
        forwarded = {**cache.expected_fields(header)[1], **transport}
        call.derivation = Derivation(
            session_id=call.session_id,
            seq=len(session) - 1,
            messages=messages,
            header=header,
            open_step=(session.open_turn or 0, session.open_step.number),
            generation=session.generation,
            source="record",
        )
        call.stream = fields.get("stream") is True
        return _Exchange(
            self, call.session_id, held, writer, forwarded, expected, session.open_turn or 0, session.open_step.number
        )


def _loggable(message: Any, where: str) -> dict[str, Any]:
    """A conversation message's canonical wire form, refused here (named by its index in the request) when it has
    no logged form: a second system message, a field no Message carries."""
    wire = normal_message(message, where)
    logged_message(wire, "", where)
    return wire


def _is_result(derived: DerivedMessage) -> bool:
    return any(isinstance(b, ToolResultBlock) for b in derived.message.content)


def _tenant_of(header: bytes) -> str:
    try:
        value = msgspec.json.decode(header)
    except msgspec.DecodeError:
        return DEFAULT_TENANT
    tenant = value.get("tenant") if isinstance(value, dict) else None
    return tenant if isinstance(tenant, str) and tenant else DEFAULT_TENANT


class _Exchange:
    """One recorded request's response, logged as it is relayed (the gateway's forwarding calls these)."""

    def __init__(
        self,
        recorder: Recorder,
        session_id: str,
        held: _Held,
        writer: SessionWriter,
        fields: dict[str, Any],
        messages: bytes,
        turn: int,
        step: int,
    ) -> None:
        self.recorder = recorder
        self.session_id = session_id
        self.held = held
        self.writer = writer
        self.fields = fields  # what the provider receives: the header's fields, the transport fields
        self.messages = messages  # and the derivation's canonical messages
        self.turn = turn
        self.step = step
        self.sse = SseLines()
        self.assembler = ResponseAssembler()
        self.chunk_seqs: list[int] = []
        self.ended_once = False

    async def _chunk(self, chunk: dict[str, Any]) -> None:
        event = await self.writer.emit("assistant/chunk", {"turn": self.turn, "step": self.step, "chunk": chunk})
        self.chunk_seqs.append(event.seq)

    async def relayed(self, data: bytes) -> None:
        """Bytes of a streamed answer that the client has been sent."""
        for obj in self.sse.feed(data):
            for chunk in self.assembler.chunk(obj):
                await self._chunk(chunk)
        if self.sse.done:
            self.finishing()

    def finishing(self) -> None:
        if self.held.finishing is None:
            self.held.finishing = asyncio.Event()

    async def ended(self, outcome: str, status: int, *, body: bytes | None = None, message: str = "") -> None:
        """The exchange is over: log how it ended, and free the session."""
        if self.ended_once:
            return
        self.ended_once = True
        self.finishing()
        broken = False
        try:
            await self._log_end(outcome, status, body, message)
            await self.writer.flush()  # the answer is durable before the session takes the next request
        except SessionLogError as err:
            log.warning("record mode: logging the end of a response in %s failed: %s", self.session_id, err)
            broken = True
        finally:
            self.recorder._free(self.session_id, self.held, broken=broken)

    async def _log_end(self, outcome: str, status: int, body: bytes | None, message: str) -> None:
        emit = self.writer.emit
        turn, step = self.turn, self.step
        if outcome == "forwarded" and status == 200:
            if body is not None:
                try:
                    self.assembler.completion(msgspec.json.decode(body))
                except msgspec.DecodeError:
                    await self._close(
                        "error", {"message": "the provider's answer is not JSON", "code": "UPSTREAM_ERROR"}
                    )
                    return
            else:
                for chunk in self.assembler.end():
                    await self._chunk(chunk)
            assembler = self.assembler
            source = {"kind": "model", "provider": self.recorder.gateway.record_provider,
                      "model": self.writer.session.fold_request_header().header.config.model}  # type: ignore[union-attr]  # fmt: skip
            data: dict[str, Any] = {"turn": turn, "step": step,
                                    "message": {"id": _new_id("msg"), "role": "assistant", "source": source,
                                                "content": assembler.content()}}  # fmt: skip
            if assembler.usage is not None:
                data["usage"] = assembler.usage
            await emit("assistant/message", data, surface_op="append", source_event_seqs=list(self.chunk_seqs))
            for c in assembler.calls():
                await emit("tool/call", {"turn": turn, "step": step, "callId": c["id"], "name": c["name"],
                                         "arguments": c["arguments"]})  # fmt: skip
            if not assembler.calls():
                reason = "max-tokens" if assembler.finish == "max-tokens" else "completed"
                await self._close(reason)
            return
        if outcome == "client_disconnected":
            await self._close("aborted")
            return
        await self._close("error", {"message": message or f"the provider answered HTTP {status}",
                                    "code": "UPSTREAM_ERROR", "status": status})  # fmt: skip

    async def _close(self, kind: str, error: dict[str, Any] | None = None) -> None:
        reason: dict[str, Any] = {"kind": kind}
        if kind == "aborted":
            reason["reason"] = {"kind": "user"}
        if error is not None:
            reason["error"] = error
        await self.writer.emit("step/end", {"turn": self.turn, "step": self.step})
        await self.writer.emit("turn/end", {"turn": self.turn, "reason": reason})


__all__ = ["RELEASE_PREFIX", "Recorder", "SessionBusy"]
