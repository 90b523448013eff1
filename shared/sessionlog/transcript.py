"""The transcript as the user saw it: a pure model of a session's log for people. This module builds it; the
entries are `sessionlog.transcript_model`'s (re-exported here). The UI's page and `sessionlog transcript` (its
plain text, `transcript_plain`) read the same transcript.

The durable source is the append-origin events (SPEC section 1). Around them the transcript adds what a reader
needs to follow the session: turn starts and outcomes (completed, aborted and by whom, error, max-tokens,
interrupted by a crash with its synthetic tool results marked as such), the assistant's text as it streamed
(a `StreamEntry` while a response is in progress, or for a response that never became a message: a failed or
retried request), forks and resumes (the seed boundary, a link to the parent), and compactions as markers
("summarised for the model: events 12-40" for a compaction's summary, "replaced for the model: ..." for any other
message put in their place, such as a client's own edit in record mode). A compaction never removes a line: the
replacement event only adds its marker, and every message it shadows stays.

`TranscriptBuilder` is incremental: `add(event)` returns the `Update`s the event causes (a new or changed entry,
or text appended to a streaming block), so a live page can follow a session without re-sending it; `snapshot()`
is the whole transcript. `build_transcript(session, header)` is the same thing for a finished log; both are pure
functions of the events (and the session header, which only adds the fork banner).

Entries carry `seq` (the event that opened them) and `last` (the last event that changed them), so a reader that
has seen everything before seq N asks for the entries with `last >= N`. Keys (`e<seq>` for event entries,
`s<seq>` for streams) are stable across snapshots: an update with a known key replaces that entry.

Decisions (2026-12):
- A step may hold several attempts (a retried request): a `finish` chunk or an `llm/retry` event closes the
  current attempt, and the next chunk opens another. An `assistant/message` takes the step's latest attempt that
  no message has taken; earlier attempts stay in the transcript as failed or retried responses.
- A streamed block shows its deltas while it streams and its `block-end` block once it has one: one rule, in
  `sessionlog.assembly`, shared with the audit (it showed the deltas until 2026-12-03, so a retried response whose
  recorder rewrote the final block showed other text here than in `sessionlog replay`).
- Plugin context messages (`user/message` whose source is a plugin) are kept with their source, so the page can
  fold them away; nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec
from msgspec import UNSET, Struct

from . import transcript_model as tm
from .assembly import StreamAssembly, StreamBlock
from .events import (
    Aborted,
    AssistantMessageData,
    BlockEndChunk,
    BlockStartChunk,
    Errored,
    Event,
    FinishChunk,
    Message,
    ReasoningDeltaChunk,
    TextDeltaChunk,
    ToolCallDeltaChunk,
    ToolResultData,
    UsageChunk,
    data_bytes,
)
from .header import SessionHeader, decode_header
from .session import Session
from .transcript_model import *  # noqa: F403  (the model's names are this module's public names too)


def _shown(block: StreamBlock) -> tm.ShownBlock:
    """A streamed block for a reader, by the one rule (`sessionlog.assembly`): its block-end block once it has one,
    else its deltas joined (a block of a type deltas cannot build keeps its type, with the text)."""
    shown = tm.shown_blocks((block.assembled(),))
    if shown and (block.end is not None or block.type in _DELTA_TYPES):
        return shown[0]
    return tm.ShownBlock(type=block.type, text="".join(block.parts))


_DELTA_TYPES: Final = frozenset({"text", "reasoning", "tool-call"})


class _Stream(StreamAssembly):
    """One attempt of a step, assembled chunk by chunk."""

    __slots__ = ("error", "key", "last", "positions", "seq", "state", "step", "taken", "time", "turn")

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.seq = event.seq
        self.key = f"s{event.seq}"
        self.last = event.seq
        self.time = event.time
        self.turn: int = event.data.turn
        self.step: int = event.data.step
        self.state = "streaming"
        self.error: str | None = None
        self.taken = False  # an assistant/message completed it
        self.positions: dict[int, int] = {}  # chunk index -> the block's position in the entry (what updates name)

    @property
    def open(self) -> bool:
        return self.state == "streaming"

    def place(self, index: int) -> int | None:
        """The position of block `index` in the entry's blocks; None when a new block lands before others (a
        stream a retry split begins at a later index, and may go back): every later block moved."""
        position = self.positions.get(index)
        if position is not None:
            return position
        if self.positions and index < max(self.positions):
            self.positions = {i: p for p, i in enumerate(sorted({*self.positions, index}))}
            return None
        position = self.positions[index] = len(self.positions)
        return position

    def entry(self) -> tm.StreamEntry:
        return tm.StreamEntry(
            key=self.key,
            seq=self.seq,
            last=self.last,
            time=self.time,
            turn=self.turn,
            step=self.step,
            blocks=tuple(_shown(self.blocks[i]) for i in sorted(self.blocks)),
            state=self.state,
            finish=self.finish,
            error=self.error,
        )


class _RetryData(Struct):
    retry: int | None = None
    maxRetries: int | None = None  # the plugin's own key
    failure: dict[str, Any] | None = None


class _TitleData(Struct):
    title: str | None = None


_retry_decoder: Final = msgspec.json.Decoder(_RetryData)
_title_decoder: Final = msgspec.json.Decoder(_TitleData)


class TranscriptBuilder:
    """Builds a transcript event by event; see the module docstring."""

    def __init__(self, session_id: str = "") -> None:
        self.session_id = session_id
        self.title: str | None = None
        self.next_seq = 0
        self.open_turn: int | None = None
        self._entries: list[tm.Entry | _Stream] = []
        self._streams: dict[tuple[int, int], list[_Stream]] = {}  # (turn, step) -> attempts of the open turn
        self._streaming: _Stream | None = None  # the attempt chunks currently go to
        # Whether a chunk's updates are built: a builder nobody follows live (a rebuild, a session no page tails)
        # sets it False, and its chunks then return no updates; every entry is kept the same either way.
        self.live = True
        self.replaces: list[int] = []  # the seqs of the session's compactions (its surface replaces)

    # ------------------------------------------------------------------------------------------ reading

    def snapshot(self, header: SessionHeader | bytes | None = None) -> tm.Transcript:
        """The whole transcript now. Streams a message has completed are left out (the message stands in their
        place); every other entry is there."""
        entries: list[tm.Entry] = []
        for item in self._entries:
            if isinstance(item, _Stream):
                if not item.taken:
                    entries.append(item.entry())
            else:
                entries.append(item)
        return tm.Transcript(
            session=self.session_id,
            title=self.title,
            fork=tm.fork_info(header),
            next_seq=self.next_seq,
            open_turn=self.open_turn,
            entries=tuple(entries),
        )

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------------------------------ writing

    def extend(self, events: Iterable[Event]) -> list[tm.Update]:
        """Take each event in turn, as `add` does; the updates of them all. A quiet builder (not `live`) takes
        the bulk of a stream, a text delta to the block the previous delta went to, inline."""
        out: list[tm.Update] = []
        if self.live:
            for event in events:
                out.extend(self.add(event))
            return out
        add, text_delta = self.add, TextDeltaChunk
        for event in events:
            if event.type == "assistant/chunk":
                data = event.data
                chunk = data.chunk
                stream = self._streaming
                if (
                    stream is not None
                    and type(chunk) is text_delta
                    and chunk.index == stream.last_index
                    and stream.state == "streaming"
                    and stream.step == data.step
                    and stream.turn == data.turn
                ):
                    seq = event.seq
                    stream.last = seq
                    stream.last_parts.append(chunk.text)
                    self.next_seq = seq + 1
                    continue
            add(event)
        return out

    def add(self, event: Event) -> list[tm.Update]:
        """Take the next event of the log; return what changed."""
        self.next_seq = event.seq + 1
        kind = event.type
        if kind == "assistant/chunk":
            return self._chunk(event)
        if kind == "user/message" or kind == "assistant/message" or kind == "tool/result":
            if event.is_replace:
                self.replaces.append(event.seq)
                return self._push(_compaction(event))
            return self._message(event)
        if kind == "turn/start":
            self.open_turn = event.data.turn
            return self._push(
                tm.TurnStartEntry(
                    key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time, turn=event.data.turn
                )
            )
        if kind == "turn/end":
            self.open_turn = None
            return self._turn_end(event)
        if kind == "step/end":
            return self._step_end(event)
        if kind == "session/end-seed":
            return self._push(tm.SeedEntry(key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time))
        if kind == "llm/retry":
            return self._retry(event)
        if kind == "session/title":
            try:
                title = _title_decoder.decode(data_bytes(event)).title
            except msgspec.DecodeError:  # a plugin's own shape: nothing to show
                title = None
            if title:
                self.title = title
        return []

    def _push(self, entry: tm.Entry) -> list[tm.Update]:
        self._entries.append(entry)
        return [tm.EntryUpdate(seq=entry.last, entry=entry)]

    # ------------------------------------------------------------------------------------------ streams

    def _chunk(self, event: Event) -> list[tm.Update]:
        data = event.data
        stream = self._streaming
        if stream is None or not stream.open or stream.turn != data.turn or stream.step != data.step:
            stream = _Stream(event)
            self._streaming = stream
            self._streams.setdefault((stream.turn, stream.step), []).append(stream)
            self._entries.append(stream)
            created: list[tm.Update] = [tm.EntryUpdate(seq=event.seq, entry=stream.entry())] if self.live else []
        else:
            created = []
        stream.last = event.seq
        chunk = data.chunk
        if not self.live:
            self._chunk_quiet(stream, chunk, event)
            return created
        before = None  # a block-end may rewrite what the deltas showed: then the entry is sent again
        if type(chunk) is BlockEndChunk and chunk.index in stream.blocks:
            before = _shown(stream.blocks[chunk.index])
        stream.take(chunk, event.seq)
        kind = type(chunk)
        if kind is UsageChunk:
            return created  # nothing to show while streaming
        if kind is FinishChunk:
            _finished(stream, chunk, event)
            return [*created, self._stream_update(stream, event.seq)]
        position = stream.positions.get(chunk.index)
        if position is None:
            position = stream.place(chunk.index)
            if position is None:
                return [*created, self._stream_update(stream, event.seq)]
        if kind is TextDeltaChunk or kind is ReasoningDeltaChunk:
            block_type = "text" if kind is TextDeltaChunk else "reasoning"
            return [
                *created,
                tm.DeltaUpdate(seq=event.seq, key=stream.key, index=position, block=block_type, text=chunk.text),
            ]
        if kind is ToolCallDeltaChunk:
            name = chunk.name if chunk.name is not UNSET else None
            return [
                *created,
                tm.DeltaUpdate(
                    seq=event.seq,
                    key=stream.key,
                    index=position,
                    block="tool-call",
                    text=chunk.arguments_delta,
                    id=chunk.id,
                    name=name,
                ),
            ]
        if kind is BlockStartChunk:
            return [
                *created,
                tm.DeltaUpdate(seq=event.seq, key=stream.key, index=position, block=chunk.block_type, text=""),
            ]
        if kind is BlockEndChunk:
            if before == _shown(stream.blocks[chunk.index]):
                return created  # the deltas already showed it
            return [*created, self._stream_update(stream, event.seq)]  # a block that arrived whole, or was rewritten
        return created

    @staticmethod
    def _chunk_quiet(stream: _Stream, chunk: Any, event: Event) -> None:
        """What `_chunk` changes, without the updates: the block taken, its place kept, the attempt closed."""
        stream.take(chunk, event.seq)
        kind = type(chunk)
        if kind is FinishChunk:
            _finished(stream, chunk, event)
        elif kind is not UsageChunk and chunk.index not in stream.positions:
            stream.place(chunk.index)

    def _stream_update(self, stream: _Stream, seq: int) -> tm.EntryUpdate:
        return tm.EntryUpdate(seq=seq, entry=stream.entry())

    def _take_stream(self, turn: int, step: int) -> _Stream | None:
        for stream in reversed(self._streams.get((turn, step), ())):
            if not stream.taken:
                return stream
        return None

    def _retry(self, event: Event) -> list[tm.Update]:
        try:
            data = _retry_decoder.decode(data_bytes(event))
        except msgspec.DecodeError:
            data = _RetryData()
        failure = data.failure or {}
        code = failure.get("code")
        message = failure.get("message")
        count = f" {data.retry} of {data.maxRetries}" if data.retry is not None and data.maxRetries else ""
        why = f" after {code}" if isinstance(code, str) else ""
        text = f"retry{count}{why}" + (f": {message}" if isinstance(message, str) else "")
        out: list[tm.Update] = []
        stream = self._streaming
        if stream is not None and not stream.taken and stream.state in ("streaming", "failed"):
            stream.state = "retried"
            stream.last = event.seq
            out.append(self._stream_update(stream, event.seq))
            self._streaming = None
        return [
            *out,
            *self._push(tm.NoteEntry(key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time, text=text)),
        ]

    def _step_end(self, event: Event) -> list[tm.Update]:
        out: list[tm.Update] = []
        for stream in self._streams.get((event.data.turn, event.data.step), ()):
            if not stream.taken and stream.state == "streaming":
                stream.state = "cut"
                stream.last = event.seq
                out.append(self._stream_update(stream, event.seq))
        self._streaming = None
        return out

    # ------------------------------------------------------------------------------------------ messages

    def _message(self, event: Event) -> list[tm.Update]:
        kind = event.type
        message: Message
        turn = step = None
        interrupted = False
        synthetic = error = None
        replaces: str | None = None
        out: list[tm.Update] = []
        if kind == "user/message":
            message = event.data
        elif kind == "assistant/message":
            data: AssistantMessageData = event.data
            message, turn, step = data.message, data.turn, data.step
            interrupted = data.interrupted is True
            stream = self._take_stream(turn, step)
            if stream is not None:
                stream.taken = True
                replaces = stream.key
                if self._streaming is stream:
                    self._streaming = None
        else:
            result: ToolResultData = event.data
            message, turn, step = result.message, result.turn, result.step
            if result.error is not UNSET:
                error = result.error.code
                if error in tm.SYNTHETIC_CODES and message.id.startswith(tm.INTERRUPTED_RESULT_PREFIX):
                    synthetic = error
        source = message.source
        role = "tool" if kind == "tool/result" else message.role
        entry = tm.MessageEntry(
            key=f"e{event.seq}",
            seq=event.seq,
            last=event.seq,
            time=event.time,
            event_type=kind,
            role=role,
            source=source.kind,
            plugin=source.plugin if source.plugin is not UNSET else None,
            provider=source.provider if source.provider is not UNSET else None,
            model=source.model if source.model is not UNSET else None,
            turn=turn,
            step=step,
            blocks=tm.shown_blocks(message.content),
            interrupted=interrupted,
            synthetic=synthetic,
            error=error,
            replaces=replaces,
        )
        return [*out, *self._push(entry)]

    def _turn_end(self, event: Event) -> list[tm.Update]:
        reason = event.data.reason
        outcome = str(type(reason).__struct_config__.tag)
        detail = ""
        if isinstance(reason, Aborted):
            detail = {
                "user": "cancelled by the user",
                "parent": "cancelled by the parent agent",
                "hook": "stopped by a hook",
                "disposed": "the session was disposed",
                "legacy": "aborted",
            }.get(reason.reason.kind, reason.reason.kind)
        elif isinstance(reason, Errored):
            code = f" [{reason.error.code}]" if reason.error.code else ""
            status = f" (HTTP {reason.error.status})" if reason.error.status is not UNSET else ""
            detail = f"{reason.error.message}{code}{status}"
        elif outcome == "interrupted":
            # All the log can tell is that the writer's lease lapsed, so the text claims no more (2026-12-03).
            detail = (
                "its writer's lease was lost (the writer died, stalled past its lease, or was cut off from the "
                "log); the turn was closed from the log and its missing tool results are synthetic"
            )
        elif outcome == "max-tokens":
            detail = "the response reached the token limit"
        elif outcome == "blocked":
            detail = "blocked"
        out: list[tm.Update] = []
        for streams in self._streams.values():
            for stream in streams:
                if not stream.taken and stream.state == "streaming":
                    stream.state = "cut"
                    stream.last = event.seq
                    out.append(self._stream_update(stream, event.seq))
        self._streams.clear()  # a message of a later turn never completes a stream of this one
        self._streaming = None
        entry = tm.TurnEndEntry(
            key=f"e{event.seq}",
            seq=event.seq,
            last=event.seq,
            time=event.time,
            turn=event.data.turn,
            outcome=outcome,
            detail=detail,
        )
        return [*out, *self._push(entry)]


def _compaction(event: Event) -> tm.CompactionEntry:
    covered = tuple(sorted(event.source_event_seqs)) if isinstance(event.source_event_seqs, list) else ()
    op = event.surface_op
    first, through = (covered[0], covered[-1]) if covered else (op["start"], op["end"])
    if event.type == "user/message":
        message: Message = event.data
    else:
        message = event.data.message
    return tm.CompactionEntry(
        key=f"e{event.seq}",
        seq=event.seq,
        last=event.seq,
        time=event.time,
        event_type=event.type,
        first=first,
        through=through,
        covered=covered,
        summary=tm.shown_blocks(message.content),
        summarised=message.source.kind == "plugin" and message.source.plugin == "compact",
    )


class _FinishData(Struct):
    chunk: dict[str, Any]


class _FinishEnvelope(Struct):
    data: _FinishData


_finish_decoder: Final = msgspec.json.Decoder(_FinishEnvelope)


def _finished(stream: _Stream, chunk: FinishChunk, event: Event) -> None:
    """A finish chunk closes its attempt: failed (with the provider's failure) or finished."""
    if chunk.reason.kind == "error":
        stream.state = "failed"
        stream.error = _failure_text(event)
    else:
        stream.state = "finished"


def _failure_text(event: Event) -> str:
    """The failure a finish chunk of kind error carries (dsh writes `reason.failure {message, code}`)."""
    try:
        reason = _finish_decoder.decode(event.raw).data.chunk.get("reason") or {}
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "error"
    failure = reason.get("failure") or reason.get("error") or {}
    if not isinstance(failure, dict):
        return "error"
    message = failure.get("message")
    code = failure.get("code")
    text = message if isinstance(message, str) else "error"
    return f"{text} [{code}]" if isinstance(code, str) else text


def build_transcript(
    session: Session, header: SessionHeader | bytes | None = None, *, session_id: str = ""
) -> tm.Transcript:
    """The transcript of a whole log (a pure function of its events and header)."""
    if not session_id and header is not None:
        session_id = (decode_header(header) if isinstance(header, bytes) else header).id
    builder = TranscriptBuilder(session_id)
    builder.live = False
    builder.extend(session)
    return builder.snapshot(header)


__all__ = [*tm.__all__, "TranscriptBuilder", "build_transcript"]
