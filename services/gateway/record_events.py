"""Record mode's writes: a planned request's events (`write_plan`), and the response's events as it is relayed
(`Exchange`): `assistant/chunk` events in dsh's vocabulary (via `wireforms.ResponseAssembler`), then
`assistant/message` with its usage and one `tool/call` per call; a response without tool calls ends the step and the
turn (`completed`, or `max-tokens`), a client that disconnects ends it `aborted`, a provider error `error`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

import msgspec
from msgspec import UNSET

from sessionlog.errors import EventTooLarge, SessionLogError
from sessionlog.events import Event, encode_new_event
from sessionlog.log import SessionWriter
from sessionlog.session import Session
from sessionlog.store import check_event_size
from sessionlog.wireforms import ResponseAssembler, SseLines, first_repeat

from .record_plan import New, Plan, new_id

log = logging.getLogger("sessionlog.gateway")

# How long after a streamed answer's bytes were relayed they are read and logged: long enough for the event loop to
# sleep first (a timer of a millisecond, which is the resolution of the loop's timers), short beside the 20 ms window
# in which chunk records are published (`Exchange.relayed`).
READ_AFTER_S: Final = 0.001


class EventSink(Protocol):
    """What `write_plan` writes to: a session's writer, or a `DryRun`."""

    @property
    def session(self) -> Session: ...

    async def emit(
        self, event_type: str, data: Any, *, surface_op: Any = ..., source_event_seqs: Any = ...
    ) -> Event: ...


class DryRun:
    """The events a request would write, on an in-memory session: validated by the same rules as a writer's
    (structure, depth, and the size one record carries), written nowhere. A new session's first request is tried
    on one before the session is created, so that one refused leaves nothing behind."""

    def __init__(self, max_record_bytes: int) -> None:
        self.session = Session()
        self._max_record_bytes = max_record_bytes

    async def emit(
        self, event_type: str, data: Any, *, surface_op: Any = UNSET, source_event_seqs: Any = UNSET
    ) -> Event:
        session = self.session
        raw = encode_new_event(event_type, data, seq=len(session) if session.has_seqs else None, time=0,
                               surface_op=surface_op, source_event_seqs=source_event_seqs)  # fmt: skip
        check_event_size(raw, len(session), self._max_record_bytes)
        return session.append(raw)


async def write_plan(writer: EventSink, plan: Plan) -> None:
    """Append a planned request's events to the writer (queued; the caller flushes)."""
    session = writer.session
    step = session.open_step
    turn = session.open_turn
    if turn is None:
        turn = session.last_turn + 1
        await writer.emit("turn/start", {"turn": turn})
    for item in plan.leading:
        await _tool_result(writer, turn, step.number if step else 0, item, session.tool_call_event(item.call_id))
    if session.open_step is not None:
        await writer.emit("step/end", {"turn": turn, "step": session.open_step.number})
    number = session.last_step + 1 if session.open_turn == turn and session.last_step else 1
    await writer.emit("step/start", {"turn": turn, "step": number})
    if plan.header is not None:
        reason = "initial" if plan.initial else "change"
        await writer.emit("request/header", {"header": plan.header, "reason": reason})
    calls: dict[str, int] = {}
    for i, item in enumerate(plan.rest):
        surface: dict[str, Any] = {"surface_op": "append"}
        if i == 0 and plan.replace is not None:
            start, end, shadowed = plan.replace
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
            await _tool_result(writer, turn, number, item, calls.get(item.call_id))


async def _tool_result(writer: EventSink, turn: int, step: int, item: New, call_seq: int | None) -> None:
    data = {"turn": turn, "step": step, "message": item.message}
    seqs = [call_seq] if call_seq is not None else UNSET
    await writer.emit("tool/result", data, surface_op="append", source_event_seqs=seqs)


class Exchange:
    """One recorded request's response, logged as it is relayed (the gateway's forwarding calls these)."""

    def __init__(
        self,
        session_id: str,
        writer: SessionWriter,
        provider: str,
        finishing: Callable[[], None],
        free: Callable[[bool], None],
        fields: dict[str, Any],
        messages: bytes,
        turn: int,
        step: int,
    ) -> None:
        self.session_id = session_id
        self.writer = writer
        self.provider = provider
        self.finishing = finishing  # the provider has finished: only logging remains (a next request may wait)
        self._free = free  # the session is free for its next request (broken: its writer cannot go on)
        self.fields = fields  # what the provider receives: the header's fields, the transport fields
        self.messages = messages  # and the derivation's canonical messages
        self.turn = turn
        self.step = step
        self.sse = SseLines()
        self.assembler = ResponseAssembler()
        self.chunk_seqs: list[int] = []
        self.ended_once = False
        self.logged = False  # the end of the exchange is durably logged
        self._unread: list[bytes] = []  # bytes relayed, not yet read (`read_relayed`)
        self._reading: asyncio.TimerHandle | None = None
        self._relayed: deque[Any] = deque()  # lines read, not yet logged
        self._logging: asyncio.Task[None] | None = None

    async def _chunk(self, chunk: dict[str, Any]) -> None:
        event = await self.writer.emit("assistant/chunk", {"turn": self.turn, "step": self.step, "chunk": chunk})
        self.chunk_seqs.append(event.seq)

    async def relayed(self, data: bytes) -> None:
        """Bytes of a streamed answer that the client has been sent: kept, and read `READ_AFTER_S` later.

        Nothing else happens here, so that the gateway's event loop goes back to sleep as soon as it has written the
        bytes. Read and logged at once, each line reached the client a few µs later than through the gateway without
        logging, most likely because a process woken by a write to its socket is run on the writer's CPU, which the
        kernel expects the writer to leave: the client waited for the reading and logging to end. Read on a timer,
        lines come no later (docs/performance.md, "Streamed lines")."""
        self._unread.append(data)
        if self._reading is None:
            self._reading = asyncio.get_running_loop().call_later(READ_AFTER_S, self.read_relayed)

    def read_relayed(self) -> None:
        """Read the relayed bytes kept so far: the session is `finishing` once the answer's last line is read, and
        the chunks of its lines are logged in the exchange's own task, in order; the relay never waits for that
        logging (each piece used to wait for the logging of the one before)."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None
        unread, self._unread = self._unread, []
        for data in unread:
            self._relayed.extend(self.sse.feed(data))
        if self.sse.done:
            self.finishing()
        task = self._logging
        if task is not None and (not task.done() or task.cancelled() or task.exception() is not None):
            return  # the task in flight takes these lines too; after a failure nothing more is logged (`ended` says)
        if self._relayed:
            self._logging = asyncio.create_task(self._log_relayed(), name=f"record-chunks-{self.session_id}")

    async def _log_relayed(self) -> None:
        while self._relayed:
            for chunk in self.assembler.chunk(self._relayed.popleft()):
                await self._chunk(chunk)

    async def _logged_relayed(self) -> None:
        """Once every relayed byte is logged (raises what logging them raised). The task stays `_logging` while it
        runs, so that lines read meanwhile (`read_relayed`) join it rather than start a second one."""
        while (logging_ := self._logging) is not None:
            try:
                await logging_
            finally:
                if self._logging is logging_:
                    self._logging = None

    async def ended(
        self, outcome: str, status: int, *, body: bytes | None = None, message: str = "", code: str | None = None
    ) -> bool:
        """The exchange is over: log how it ended, and free the session. Whether the end is durably logged."""
        if self.ended_once:
            return self.logged
        self.ended_once = True
        self.read_relayed()
        self.finishing()
        broken = False
        try:
            await self._logged_relayed()
            await self._log_end(outcome, status, body, message, code)
            await self.writer.flush()  # the answer is durable before the session takes the next request
        except SessionLogError as err:
            log.warning("record mode: logging the end of a response in %s failed: %s", self.session_id, err)
            broken = True
        except BaseException:  # cancelled (a shutdown) or a bug: the end may not be durable
            broken = True
            raise
        finally:
            self.logged = not broken
            self._free(broken)
        return self.logged

    async def _log_end(self, outcome: str, status: int, body: bytes | None, message: str, code: str | None) -> None:
        if outcome == "forwarded" and status == 200:
            try:
                await self._log_answer(body)
            except EventTooLarge as err:
                # The client has the whole answer; the log keeps what fits (the chunks streamed so far) and says
                # why the rest is not there, rather than leaving the turn open for the repairer.
                await self._close("error", {"message": f"the answer could not be logged whole: {err.message}",
                                            "code": err.code})  # fmt: skip
            return
        if outcome == "client_disconnected":
            await self._close("aborted")
            return
        if code is not None:  # the provider was not reached, or broke off: no status of its own to give
            await self._close("error", {"message": message, "code": code})
            return
        await self._close("error", {"message": message or f"the provider answered HTTP {status}",
                                    "code": "UPSTREAM_ERROR", "status": status})  # fmt: skip

    async def _log_answer(self, body: bytes | None) -> None:
        emit = self.writer.emit
        turn, step = self.turn, self.step
        assembler = self.assembler
        if body is not None:
            try:
                assembler.completion(msgspec.json.decode(body))
            except msgspec.DecodeError:
                await self._close("error", {"message": "the provider's answer is not JSON", "code": "UPSTREAM_ERROR"})
                return
        if assembler.error is not None:  # sent with status 200, so the client's SDK raises it: not an answer
            await self._close("error", {"message": f"the provider's answer carried an error: {assembler.error}",
                                        "code": "UPSTREAM_ERROR"})  # fmt: skip
            return
        if body is None:
            for chunk in assembler.end():
                await self._chunk(chunk)
        calls = assembler.calls()
        if (i := first_repeat(c["id"] for c in calls)) is not None:
            twice = calls[i]["id"]
            await self._close("error", {"message": f"the provider's answer has two tool calls with id {twice!r}: no "
                                        "tool result could say which it answers, so they are not logged as calls",
                                        "code": "UPSTREAM_ERROR"})  # fmt: skip
            return
        source = {"kind": "model", "provider": self.provider,
                  "model": self.writer.session.fold_request_header().header.config.model}  # type: ignore[union-attr]  # fmt: skip
        data: dict[str, Any] = {"turn": turn, "step": step,
                                "message": {"id": new_id("msg"), "role": "assistant", "source": source,
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

    async def _close(self, kind: str, error: dict[str, Any] | None = None) -> None:
        reason: dict[str, Any] = {"kind": kind}
        if kind == "aborted":
            reason["reason"] = {"kind": "user"}
        if error is not None:
            reason["error"] = error
        await self.writer.emit("step/end", {"turn": self.turn, "step": self.step})
        await self.writer.emit("turn/end", {"turn": self.turn, "reason": reason})
