"""The transcript as data (the model the UI and the CLI share) and as plain text: entries, the updates a live page
applies, reader blocks (`shown_blocks`), and `transcript_plain`, what `sessionlog transcript` prints (its `--json`
prints the append-origin events themselves, `logged_entries`). Pure. The entries are built from a log by
`sessionlog.transcript.TranscriptBuilder`; the UI's page and the CLI read the same entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .events import ImageBlock, ReasoningBlock, TextBlock, ToolCallBlock, ToolResultBlock, data_bytes
from .header import SessionHeader, decode_header
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
    # A summary by a compaction (dsh's `compact` plugin, `SessionWriter.compact`); else some other message now stands
    # where those events were (a client's own edit in record mode, which may trim, summarise or rewrite).
    summarised: bool = False


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
    """Text appended to block `index` of stream entry `key` (a new block when `index` is new). `index` is the
    block's position in the entry's `blocks`, not the chunk's index (a stream a retry split may begin at chunk
    index 2: its first block is at position 0)."""

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


def fork_info(header: SessionHeader | bytes | None) -> ForkInfo | None:
    if header is None:
        return None
    if isinstance(header, bytes):
        header = decode_header(header)
    if not isinstance(header.parent_session, str):
        return None
    seed = header.seed_length if isinstance(header.seed_length, int) else None
    return ForkInfo(parent=header.parent_session, seed_length=seed)


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
        return f"[{entry.seq}] ({compaction_label(entry)})"
    if isinstance(entry, StreamEntry):
        text = " | ".join(_block_line(b) for b in entry.blocks)
        why = f" {entry.error}" if entry.error else ""
        return f"[{entry.seq}] assistant ({entry.state}{why}): {text}"
    who = entry.role if entry.source != "plugin" else f"{entry.role} (plugin {entry.plugin})"
    flags = " (interrupted)" if entry.interrupted else ""
    flags += f" (synthetic {entry.synthetic})" if entry.synthetic else ""
    sep = " " if entry.role == "tool" else ": "  # "[7] tool result [call c1]: ..."
    return "\n".join(f"[{entry.seq}] {who}{flags}{sep}{_block_line(b)}" for b in entry.blocks) or f"[{entry.seq}] {who}"


def compaction_label(entry: CompactionEntry) -> str:
    """`summarised for the model: events 3-9`, or `replaced for the model: ...` when no compaction wrote it."""
    how = "summarised" if entry.summarised else "replaced"
    return f"{how} for the model: events {entry.first}-{entry.through}"


# Control characters a terminal acts on (C0 but newline and tab, DEL, C1), shown as `\x1b`: a message may hold
# escape sequences that retitle the window, write the clipboard (OSC 52) or hide text behind a carriage return.
_TERMINAL_SAFE: Final = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}


def transcript_plain(transcript: Transcript) -> str:
    """The transcript as plain text, one line an entry (a message, one line a block): `sessionlog transcript`.
    Control characters a terminal would act on are shown escaped (`\x1b`); newlines and tabs stay."""
    lines: list[str] = []
    if transcript.fork is not None:
        seed = f" (seed length {transcript.fork.seed_length})" if transcript.fork.seed_length is not None else ""
        lines.append(f"forked from {transcript.fork.parent}{seed}")
    lines.extend(entry_line(e) for e in transcript.entries)
    return "".join(terminal_safe(line) + "\n" for line in lines)


def terminal_safe(text: str) -> str:
    """`text` with the control characters a terminal would act on shown escaped (`\x1b`); newlines and tabs stay."""
    return text.translate(_TERMINAL_SAFE)


_encoder: Final = msgspec.json.Encoder()


def entry_json(entry: Entry) -> bytes:
    return _encoder.encode(entry)


def transcript_json(transcript: Transcript) -> bytes:
    return _encoder.encode(transcript)


class LoggedEntry(Struct, frozen=True, omit_defaults=True):
    """An append-origin event as logged, its seq first (`sessionlog transcript --json`, for tools)."""

    seq: int
    type: str
    data: msgspec.Raw
    time: int | UnsetType = UNSET


def logged_entries(session: Session) -> list[LoggedEntry]:
    """The append-origin events the transcript's message entries show, with their data as logged."""
    return [
        LoggedEntry(
            seq=e.seq, type=e.type, data=msgspec.Raw(data_bytes(e)), time=e.time if e.time is not None else UNSET
        )
        for e in session.transcript()
    ]


__all__ = [
    "INTERRUPTED_RESULT_PREFIX",
    "SYNTHETIC_CODES",
    "CompactionEntry",
    "DeltaUpdate",
    "Entry",
    "EntryUpdate",
    "ForkInfo",
    "LoggedEntry",
    "MessageEntry",
    "NoteEntry",
    "SeedEntry",
    "ShownBlock",
    "StreamEntry",
    "Transcript",
    "TurnEndEntry",
    "TurnStartEntry",
    "Update",
    "coalesce",
    "compaction_label",
    "entry_json",
    "entry_line",
    "fork_info",
    "logged_entries",
    "shown_blocks",
    "terminal_safe",
    "transcript_json",
    "transcript_plain",
]
