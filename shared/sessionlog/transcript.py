"""The transcript as the user saw it: a pure model of a session's log for people (the UI, the CLI).

The durable source is the append-origin events (SPEC section 1). Around them the transcript adds what a reader
needs to follow the session: turn starts and outcomes (completed, aborted and by whom, error, max-tokens,
interrupted by a crash with its synthetic tool results marked as such), the assistant's text as it streamed
(a `StreamEntry` while a response is in progress, or for a response that never became a message: a failed or
retried request), forks and resumes (the seed boundary, a link to the parent), and compactions as markers
("summarised for the model: events 12-40"). A compaction never removes a line: the replacement event only adds
its marker, and every message it shadows stays.

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
- A streamed block shows its deltas; a block with no deltas shows its `block-end` block.
- Plugin context messages (`user/message` whose source is a plugin) are kept with their source, so the page can
  fold them away; nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
from msgspec import UNSET, Struct

from .events import (
    Aborted,
    AssistantMessageData,
    BlockEndChunk,
    BlockStartChunk,
    Errored,
    Event,
    FinishChunk,
    ImageBlock,
    Message,
    ReasoningBlock,
    ReasoningDeltaChunk,
    TextBlock,
    TextDeltaChunk,
    ToolCallBlock,
    ToolCallDeltaChunk,
    ToolResultBlock,
    ToolResultData,
    data_bytes,
)
from .jsonl import SessionHeader, decode_header
from .session import TOOL_NOT_STARTED, TOOL_OUTCOME_UNKNOWN, Session

SYNTHETIC_CODES: Final = frozenset({TOOL_OUTCOME_UNKNOWN, TOOL_NOT_STARTED})
INTERRUPTED_RESULT_PREFIX: Final = "interrupted-tool-result-"

# ---------------------------------------------------------------------------------------------- the model


class ShownBlock(Struct, frozen=True, omit_defaults=True):
    """One content block as a reader sees it. `type` is the SPEC block type."""

    type: str
    text: str = ""
    id: str | None = None  # tool-call id
    name: str | None = None  # tool name
    tool_call_id: str | None = None  # tool-result: the call it answers
    is_error: bool = False
    attachment: str | None = None  # image: the attachment id


class _Entry(Struct, frozen=True, tag_field="kind"):
    key: str
    seq: int
    last: int
    time: int | None = None


class TurnStartEntry(_Entry, frozen=True, tag="turn-start"):
    turn: int = 0


class MessageEntry(_Entry, frozen=True, tag="message"):
    """An append-origin surface event: a user, assistant or tool message exactly as it was appended."""

    event_type: str = ""
    role: str = ""
    source: str = ""  # source kind: user, model, tool, plugin, ...
    plugin: str | None = None
    provider: str | None = None
    model: str | None = None
    turn: int | None = None
    step: int | None = None
    blocks: tuple[ShownBlock, ...] = ()
    interrupted: bool = False  # a partial assistant message (cancelled mid-stream)
    synthetic: str | None = None  # a closer's tool result: TOOL_OUTCOME_UNKNOWN or TOOL_NOT_STARTED
    error: str | None = None  # a tool/result's error code
    replaces: str | None = None  # the key of the stream entry this message completes


class StreamEntry(_Entry, frozen=True, tag="stream"):
    """A response as it streamed, before (or without) its assistant/message."""

    turn: int = 0
    step: int = 0
    blocks: tuple[ShownBlock, ...] = ()
    state: str = "streaming"  # streaming | finished | failed | retried | cut (the step ended without a message)
    finish: str | None = None
    error: str | None = None


class CompactionEntry(_Entry, frozen=True, tag="compaction"):
    """A surface replacement: what the model now sees instead of events `first`..`through`, which stay visible."""

    event_type: str = ""
    first: int = 0
    through: int = 0
    covered: tuple[int, ...] = ()
    summary: tuple[ShownBlock, ...] = ()


class TurnEndEntry(_Entry, frozen=True, tag="turn-end"):
    turn: int = 0
    outcome: str = ""  # completed | aborted | blocked | error | max-tokens | interrupted
    detail: str = ""


class SeedEntry(_Entry, frozen=True, tag="seed"):
    """`session/end-seed`: the inherited (forked or resumed) prefix ends here."""


class NoteEntry(_Entry, frozen=True, tag="note"):
    """A plugin event worth a line (a retried request)."""

    text: str = ""


Entry = TurnStartEntry | MessageEntry | StreamEntry | CompactionEntry | TurnEndEntry | SeedEntry | NoteEntry


class ForkInfo(Struct, frozen=True, omit_defaults=True):
    """Where a session came from: its parent and the seed boundary (the last inherited event is `seed_length-1`)."""

    parent: str
    seed_length: int | None = None


class Transcript(Struct, frozen=True, omit_defaults=True):
    session: str
    title: str | None
    fork: ForkInfo | None
    next_seq: int  # the seq the next event of the log will have
    open_turn: int | None
    entries: tuple[Entry, ...]

    def since(self, from_seq: int) -> tuple[Entry, ...]:
        """Entries a reader that has seen everything before `from_seq` does not know yet."""
        return tuple(e for e in self.entries if e.last >= from_seq)


class EntryUpdate(Struct, frozen=True, tag="entry", tag_field="update"):
    """A new entry, or a new version of the entry with the same key."""

    seq: int
    entry: Entry


class DeltaUpdate(Struct, frozen=True, tag="delta", tag_field="update", omit_defaults=True):
    """Text appended to block `index` of stream entry `key` (a new block when `index` is new)."""

    seq: int
    key: str
    index: int
    block: str
    text: str
    name: str | None = None  # tool-call deltas: the tool's name and the call id, as the stream gives them
    id: str | None = None


Update = EntryUpdate | DeltaUpdate


def coalesce(updates: Sequence[Update]) -> list[Update]:
    """Fewer updates, same result: an entry sent again later in the batch is sent once (in the place of its last
    version, which already holds every earlier delta), and runs of deltas to one block merge into one."""
    last_full: dict[str, int] = {}
    for i, update in enumerate(updates):
        if isinstance(update, EntryUpdate):
            last_full[update.entry.key] = i
    out: list[Update] = []
    for i, update in enumerate(updates):
        key = update.entry.key if isinstance(update, EntryUpdate) else update.key
        if last_full.get(key, -1) > i:
            continue
        prev = out[-1] if out else None
        if (
            isinstance(update, DeltaUpdate)
            and isinstance(prev, DeltaUpdate)
            and prev.key == update.key
            and prev.index == update.index
            and prev.block == update.block
        ):
            out[-1] = DeltaUpdate(
                seq=update.seq,
                key=prev.key,
                index=prev.index,
                block=prev.block,
                text=prev.text + update.text,
                name=prev.name or update.name,
                id=prev.id or update.id,
            )
        else:
            out.append(update)
    return out


# ---------------------------------------------------------------------------------------------- building


def shown_blocks(blocks: Iterable[Any]) -> tuple[ShownBlock, ...]:
    """Content blocks (typed Structs of `events`) as reader blocks."""
    out: list[ShownBlock] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            out.append(ShownBlock(type="text", text=block.text))
        elif isinstance(block, ReasoningBlock):
            out.append(ShownBlock(type="reasoning", text=block.text))
        elif isinstance(block, ToolCallBlock):
            out.append(ShownBlock(type="tool-call", text=block.arguments, id=block.id, name=block.name))
        elif isinstance(block, ToolResultBlock):
            text = "".join(b.text for b in block.content if isinstance(b, TextBlock))
            images = [b for b in block.content if isinstance(b, ImageBlock)]
            if images:
                text += "".join(f"[image {_attachment_id(b)}]" for b in images)
            out.append(
                ShownBlock(
                    type="tool-result", text=text, tool_call_id=block.tool_call_id, is_error=block.is_error is True
                )
            )
        elif isinstance(block, ImageBlock):
            out.append(ShownBlock(type="image", attachment=_attachment_id(block)))
    return tuple(out)


def _attachment_id(block: ImageBlock) -> str:
    attachment = block.attachment
    for key in ("attachmentId", "id", "name", "uri"):
        value = attachment.get(key)
        if isinstance(value, str):
            return value
    return "?"


class _Block:
    __slots__ = ("end", "id", "name", "parts", "type")

    def __init__(self, block_type: str) -> None:
        self.type = block_type
        self.parts: list[str] = []
        self.id: str | None = None
        self.name: str | None = None
        self.end: ShownBlock | None = None

    def shown(self) -> ShownBlock:
        if not self.parts and self.end is not None:
            return self.end
        text = "".join(self.parts)
        if self.type == "tool-call":
            return ShownBlock(type="tool-call", text=text, id=self.id, name=self.name)
        return ShownBlock(type=self.type, text=text)


class _Stream:
    """One attempt of a step, accumulated chunk by chunk."""

    __slots__ = ("blocks", "error", "finish", "key", "last", "seq", "state", "step", "taken", "time", "turn")

    def __init__(self, event: Event) -> None:
        self.seq = event.seq
        self.key = f"s{event.seq}"
        self.last = event.seq
        self.time = event.time
        self.turn: int = event.data.turn
        self.step: int = event.data.step
        self.blocks: dict[int, _Block] = {}
        self.state = "streaming"
        self.finish: str | None = None
        self.error: str | None = None
        self.taken = False  # an assistant/message completed it

    @property
    def open(self) -> bool:
        return self.state == "streaming"

    def entry(self) -> StreamEntry:
        return StreamEntry(
            key=self.key,
            seq=self.seq,
            last=self.last,
            time=self.time,
            turn=self.turn,
            step=self.step,
            blocks=tuple(self.blocks[i].shown() for i in sorted(self.blocks)),
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
        self._entries: list[Entry | _Stream] = []
        self._streams: dict[tuple[int, int], list[_Stream]] = {}  # (turn, step) -> attempts of the open turn
        self._streaming: _Stream | None = None  # the attempt chunks currently go to

    # ------------------------------------------------------------------------------------------ reading

    def snapshot(self, header: SessionHeader | bytes | None = None) -> Transcript:
        """The whole transcript now. Streams a message has completed are left out (the message stands in their
        place); every other entry is there."""
        entries: list[Entry] = []
        for item in self._entries:
            if isinstance(item, _Stream):
                if not item.taken:
                    entries.append(item.entry())
            else:
                entries.append(item)
        return Transcript(
            session=self.session_id,
            title=self.title,
            fork=fork_info(header),
            next_seq=self.next_seq,
            open_turn=self.open_turn,
            entries=tuple(entries),
        )

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------------------------------ writing

    def extend(self, events: Iterable[Event]) -> list[Update]:
        out: list[Update] = []
        for event in events:
            out.extend(self.add(event))
        return out

    def add(self, event: Event) -> list[Update]:
        """Take the next event of the log; return what changed."""
        self.next_seq = event.seq + 1
        kind = event.type
        if kind == "assistant/chunk":
            return self._chunk(event)
        if kind == "user/message" or kind == "assistant/message" or kind == "tool/result":
            if event.is_replace:
                return self._push(_compaction(event))
            return self._message(event)
        if kind == "turn/start":
            self.open_turn = event.data.turn
            return self._push(
                TurnStartEntry(
                    key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time, turn=event.data.turn
                )
            )
        if kind == "turn/end":
            self.open_turn = None
            return self._turn_end(event)
        if kind == "step/end":
            return self._step_end(event)
        if kind == "session/end-seed":
            return self._push(SeedEntry(key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time))
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

    def _push(self, entry: Entry) -> list[Update]:
        self._entries.append(entry)
        return [EntryUpdate(seq=entry.last, entry=entry)]

    # ------------------------------------------------------------------------------------------ streams

    def _chunk(self, event: Event) -> list[Update]:
        data = event.data
        stream = self._streaming
        if stream is None or not stream.open or stream.turn != data.turn or stream.step != data.step:
            stream = _Stream(event)
            self._streaming = stream
            self._streams.setdefault((stream.turn, stream.step), []).append(stream)
            self._entries.append(stream)
            created: list[Update] = [EntryUpdate(seq=event.seq, entry=stream.entry())]
        else:
            created = []
        stream.last = event.seq
        chunk = data.chunk
        if isinstance(chunk, (TextDeltaChunk, ReasoningDeltaChunk)):
            block = stream.blocks.get(chunk.index)
            block_type = "text" if isinstance(chunk, TextDeltaChunk) else "reasoning"
            if block is None:
                block = stream.blocks[chunk.index] = _Block(block_type)
            block.parts.append(chunk.text)
            return [
                *created,
                DeltaUpdate(seq=event.seq, key=stream.key, index=chunk.index, block=block.type, text=chunk.text),
            ]
        if isinstance(chunk, ToolCallDeltaChunk):
            block = stream.blocks.get(chunk.index)
            if block is None:
                block = stream.blocks[chunk.index] = _Block("tool-call")
            block.id = chunk.id
            name = chunk.name if chunk.name is not UNSET else None
            if name is not None and block.name is None:
                block.name = name
            block.parts.append(chunk.arguments_delta)
            return [
                *created,
                DeltaUpdate(
                    seq=event.seq,
                    key=stream.key,
                    index=chunk.index,
                    block="tool-call",
                    text=chunk.arguments_delta,
                    id=chunk.id,
                    name=name,
                ),
            ]
        if isinstance(chunk, BlockStartChunk):
            if chunk.index not in stream.blocks:
                stream.blocks[chunk.index] = _Block(chunk.block_type)
            return [
                *created,
                DeltaUpdate(seq=event.seq, key=stream.key, index=chunk.index, block=chunk.block_type, text=""),
            ]
        if isinstance(chunk, BlockEndChunk):
            shown = shown_blocks((chunk.block,))
            block = stream.blocks.get(chunk.index)
            if block is None:
                block = stream.blocks[chunk.index] = _Block(shown[0].type if shown else "text")
            if shown:
                block.end = shown[0]
            if block.parts or not shown:
                return created
            return [*created, self._stream_update(stream, event.seq)]  # a block that arrived whole
        if isinstance(chunk, FinishChunk):
            stream.finish = chunk.reason.kind
            if chunk.reason.kind == "error":
                stream.state = "failed"
                stream.error = _failure_text(event)
            else:
                stream.state = "finished"
            return [*created, self._stream_update(stream, event.seq)]
        return created  # usage: nothing to show while streaming

    def _stream_update(self, stream: _Stream, seq: int) -> EntryUpdate:
        return EntryUpdate(seq=seq, entry=stream.entry())

    def _take_stream(self, turn: int, step: int) -> _Stream | None:
        for stream in reversed(self._streams.get((turn, step), ())):
            if not stream.taken:
                return stream
        return None

    def _retry(self, event: Event) -> list[Update]:
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
        out: list[Update] = []
        stream = self._streaming
        if stream is not None and not stream.taken and stream.state in ("streaming", "failed"):
            stream.state = "retried"
            stream.last = event.seq
            out.append(self._stream_update(stream, event.seq))
            self._streaming = None
        return [
            *out,
            *self._push(NoteEntry(key=f"e{event.seq}", seq=event.seq, last=event.seq, time=event.time, text=text)),
        ]

    def _step_end(self, event: Event) -> list[Update]:
        out: list[Update] = []
        for stream in self._streams.get((event.data.turn, event.data.step), ()):
            if not stream.taken and stream.state == "streaming":
                stream.state = "cut"
                stream.last = event.seq
                out.append(self._stream_update(stream, event.seq))
        self._streaming = None
        return out

    # ------------------------------------------------------------------------------------------ messages

    def _message(self, event: Event) -> list[Update]:
        kind = event.type
        message: Message
        turn = step = None
        interrupted = False
        synthetic = error = None
        replaces: str | None = None
        out: list[Update] = []
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
                if error in SYNTHETIC_CODES and message.id.startswith(INTERRUPTED_RESULT_PREFIX):
                    synthetic = error
        source = message.source
        role = "tool" if kind == "tool/result" else message.role
        entry = MessageEntry(
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
            blocks=shown_blocks(message.content),
            interrupted=interrupted,
            synthetic=synthetic,
            error=error,
            replaces=replaces,
        )
        return [*out, *self._push(entry)]

    def _turn_end(self, event: Event) -> list[Update]:
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
        out: list[Update] = []
        for streams in self._streams.values():
            for stream in streams:
                if not stream.taken and stream.state == "streaming":
                    stream.state = "cut"
                    stream.last = event.seq
                    out.append(self._stream_update(stream, event.seq))
        self._streams.clear()  # a message of a later turn never completes a stream of this one
        self._streaming = None
        entry = TurnEndEntry(
            key=f"e{event.seq}",
            seq=event.seq,
            last=event.seq,
            time=event.time,
            turn=event.data.turn,
            outcome=outcome,
            detail=detail,
        )
        return [*out, *self._push(entry)]


def _compaction(event: Event) -> CompactionEntry:
    covered = tuple(sorted(event.source_event_seqs)) if isinstance(event.source_event_seqs, list) else ()
    op = event.surface_op
    first, through = (covered[0], covered[-1]) if covered else (op["start"], op["end"])
    if event.type == "user/message":
        message: Message = event.data
    else:
        message = event.data.message
    return CompactionEntry(
        key=f"e{event.seq}",
        seq=event.seq,
        last=event.seq,
        time=event.time,
        event_type=event.type,
        first=first,
        through=through,
        covered=covered,
        summary=shown_blocks(message.content),
    )


class _FinishData(Struct):
    chunk: dict[str, Any]


class _FinishEnvelope(Struct):
    data: _FinishData


_finish_decoder: Final = msgspec.json.Decoder(_FinishEnvelope)


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


def fork_info(header: SessionHeader | bytes | None) -> ForkInfo | None:
    if header is None:
        return None
    if isinstance(header, bytes):
        header = decode_header(header)
    if not isinstance(header.parent_session, str):
        return None
    seed = header.seed_length if isinstance(header.seed_length, int) else None
    return ForkInfo(parent=header.parent_session, seed_length=seed)


def build_transcript(
    session: Session, header: SessionHeader | bytes | None = None, *, session_id: str = ""
) -> Transcript:
    """The transcript of a whole log (a pure function of its events and header)."""
    if not session_id and header is not None:
        session_id = (decode_header(header) if isinstance(header, bytes) else header).id
    builder = TranscriptBuilder(session_id)
    for event in session:
        builder.add(event)
    return builder.snapshot(header)


# ---------------------------------------------------------------------------------------------- plain text


def _block_line(block: ShownBlock) -> str:
    if block.type == "text":
        return block.text
    if block.type == "reasoning":
        return f"(thinking) {block.text}"
    if block.type == "tool-call":
        return f"-> {block.name}({block.text})  [call {block.id}]"
    if block.type == "tool-result":
        flag = " (error)" if block.is_error else ""
        return f"result{flag} [call {block.tool_call_id}]: {block.text}"
    if block.type == "image":
        return f"[image {block.attachment}]"
    return block.text


def entry_line(entry: Entry) -> str:
    """One entry as plain text (what the CLI prints)."""
    if isinstance(entry, TurnStartEntry):
        return f"--- turn {entry.turn} ---"
    if isinstance(entry, TurnEndEntry):
        detail = f": {entry.detail}" if entry.detail else ""
        return f"--- turn {entry.turn} {entry.outcome}{detail} ---"
    if isinstance(entry, SeedEntry):
        return f"[{entry.seq}] (inherited history ends here)"
    if isinstance(entry, NoteEntry):
        return f"[{entry.seq}] ({entry.text})"
    if isinstance(entry, CompactionEntry):
        return f"[{entry.seq}] (summarised for the model: events {entry.first}-{entry.through})"
    if isinstance(entry, StreamEntry):
        text = " | ".join(_block_line(b) for b in entry.blocks)
        why = f" {entry.error}" if entry.error else ""
        return f"[{entry.seq}] assistant ({entry.state}{why}): {text}"
    who = entry.role if entry.source != "plugin" else f"{entry.role} (plugin {entry.plugin})"
    flags = " (interrupted)" if entry.interrupted else ""
    flags += f" (synthetic {entry.synthetic})" if entry.synthetic else ""
    return "\n".join(f"[{entry.seq}] {who}{flags}: {_block_line(b)}" for b in entry.blocks) or f"[{entry.seq}] {who}"


def transcript_plain(transcript: Transcript) -> str:
    lines: list[str] = []
    if transcript.fork is not None:
        seed = f" (seed length {transcript.fork.seed_length})" if transcript.fork.seed_length is not None else ""
        lines.append(f"forked from {transcript.fork.parent}{seed}")
    lines.extend(entry_line(e) for e in transcript.entries)
    return "".join(line + "\n" for line in lines)


_encoder: Final = msgspec.json.Encoder()


def entry_json(entry: Entry) -> bytes:
    return _encoder.encode(entry)


def transcript_json(transcript: Transcript) -> bytes:
    return _encoder.encode(transcript)


__all__ = [
    "CompactionEntry",
    "DeltaUpdate",
    "Entry",
    "EntryUpdate",
    "ForkInfo",
    "MessageEntry",
    "NoteEntry",
    "SeedEntry",
    "ShownBlock",
    "StreamEntry",
    "Transcript",
    "TranscriptBuilder",
    "TurnEndEntry",
    "TurnStartEntry",
    "Update",
    "build_transcript",
    "coalesce",
    "entry_json",
    "entry_line",
    "fork_info",
    "shown_blocks",
    "transcript_json",
    "transcript_plain",
]
