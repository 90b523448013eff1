"""Renderings of the transcript for people and for tools: pure functions of a session."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Raw, UnsetType

from .events import (
    Event,
    ImageBlock,
    Message,
    ReasoningBlock,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    data_bytes,
)
from .session import Session


class TranscriptEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One transcript line as data: the event with its seq first, `data` as logged."""

    seq: int
    type: str
    data: Raw
    time: int | UnsetType = UNSET


def transcript_entries(session: Session) -> list[TranscriptEntry]:
    return [
        TranscriptEntry(seq=e.seq, type=e.type, data=Raw(data_bytes(e)), time=e.time if e.time is not None else UNSET)
        for e in session.transcript()
    ]


def _message_of(event: Event) -> Message:
    return event.data if event.type == "user/message" else event.data.message  # type: ignore[no-any-return]


def _block_lines(block: Any, who: str) -> list[str]:
    if isinstance(block, TextBlock):
        return [f"{who}: {block.text}"]
    if isinstance(block, ReasoningBlock):
        return [f"{who} (thinking): {block.text}"]
    if isinstance(block, ImageBlock):
        return [f"{who}: [image {block.attachment.get('attachmentId', '?')}]"]
    if isinstance(block, ToolCallBlock):
        return [f"{who} -> {block.name}({block.arguments})  [call {block.id}]"]
    if isinstance(block, ToolResultBlock):
        text = "".join(b.text for b in block.content if isinstance(b, TextBlock))
        flag = " (error)" if block.is_error is True else ""
        return [f"tool result{flag} [call {block.tool_call_id}]: {text}"]
    return []


def transcript_text(session: Session) -> str:
    """The transcript for a person: turns, messages as they were appended, and compaction markers."""
    lines: list[str] = []
    for event in session:
        kind = event.type
        if kind == "turn/start":
            lines.append(f"--- turn {event.data.turn} ---")
        elif kind == "turn/end":
            reason = event.data.reason
            lines.append(f"--- turn {event.data.turn} ended: {msgspec.json.encode(reason).decode()} ---")
        elif kind == "session/end-seed":
            lines.append(f"[{event.seq}] (inherited history ends here)")
        elif event.is_surface and event.is_replace:
            covered = event.source_event_seqs
            lines.append(f"[{event.seq}] (summarised for the model: events {min(covered)}-{max(covered)})")
        elif event.is_surface:
            message = _message_of(event)
            who = "user" if kind == "user/message" else ("assistant" if kind == "assistant/message" else "tool")
            for block in message.content:
                lines.extend(f"[{event.seq}] {line}" for line in _block_lines(block, who))
    return "".join(line + "\n" for line in lines)
