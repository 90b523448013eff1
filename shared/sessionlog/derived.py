"""What a session derives for the model (SPEC section 5), as immutable values: `DerivedMessage` (a surface node's
message bytes as logged, its canonical JSON computed once), `DerivedMessages` (a view of one generation's list that
never changes once handed out) and `FoldedHeader` (the latest `request/header` of a prefix)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, overload

import msgspec

from .events import AssistantMessageData, Event, Message, RequestHeader, ToolResultData, canonical_json, message_bytes


class DerivedMessage:
    """One model-visible message: the surface node's seq and the message bytes exactly as logged.

    `canonical` (sorted keys, compact) is computed once, on first use, and kept: the gateway compares
    requests against it without re-encoding the whole context each time.
    """

    __slots__ = ("_canonical", "_message", "raw", "seq")

    def __init__(self, seq: int, raw: bytes, message: Message) -> None:
        self.seq = seq
        self.raw = raw
        self._message = message
        self._canonical: bytes | None = None

    @property
    def message(self) -> Message:
        return self._message

    @property
    def role(self) -> str:
        return self._message.role

    @property
    def canonical(self) -> bytes:
        if self._canonical is None:
            self._canonical = canonical_json(self.raw)
        return self._canonical

    def to_builtins(self) -> Any:
        return msgspec.json.decode(self.raw)

    def __repr__(self) -> str:
        return f"DerivedMessage(seq={self.seq}, role={self.role!r})"


class DerivedMessages(Sequence[DerivedMessage]):
    """An immutable view of the first `len` derived messages of one generation.

    Within a generation the backing list only grows, and a replace starts a new list, so a view handed out
    earlier never changes: derive is O(1) per call and shares every message with the live cache.
    """

    __slots__ = ("_items", "_len")

    def __init__(self, items: list[DerivedMessage], length: int) -> None:
        self._items = items
        self._len = length

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> DerivedMessage: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[DerivedMessage, ...]: ...
    def __getitem__(self, index: int | slice) -> DerivedMessage | tuple[DerivedMessage, ...]:
        if isinstance(index, slice):
            return tuple(self._items[: self._len][index])
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("derived message index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[DerivedMessage]:
        items = self._items
        for i in range(self._len):
            yield items[i]

    def extends(self, other: DerivedMessages) -> bool:
        """True when this view holds every message of `other`, in order, and maybe more after them. O(1): both are
        views of one generation's list, which only grows (a replace starts a new list), so no message is compared."""
        return self._items is other._items and other._len <= self._len

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DerivedMessages):
            return len(self) == len(other) and all(a.raw == b.raw for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(m.raw for m in self))

    def __repr__(self) -> str:
        return f"DerivedMessages({self._len} messages)"


class FoldedHeader(msgspec.Struct, frozen=True):
    """The latest `request/header` of a prefix: its seq, its typed view and the header object's bytes."""

    seq: int
    reason: str
    header: RequestHeader
    raw: bytes

    def to_builtins(self) -> dict[str, Any]:
        """The header as plain data, with an empty `system` or empty `tools` left out (SPEC section 5)."""
        out: dict[str, Any] = msgspec.json.decode(self.raw)
        if not out.get("system"):
            out.pop("system", None)
        if not out.get("tools"):
            out.pop("tools", None)
        return out


def derived_message(event: Event) -> DerivedMessage | None:
    """The message a surface event puts on the surface; None for an assistant/message with no content."""
    if event.type == "user/message":
        message: Message = event.data
    else:
        data: AssistantMessageData | ToolResultData = event.data
        message = data.message
        if event.type == "assistant/message" and not message.content:
            return None
    return DerivedMessage(event.seq, message_bytes(event), message)


class _HeaderBytes(msgspec.Struct):
    header: msgspec.Raw


class _HeaderEnvelope(msgspec.Struct):
    data: _HeaderBytes


_header_decoder: Final = msgspec.json.Decoder(_HeaderEnvelope)


def header_bytes(raw: bytes) -> bytes:
    return bytes(_header_decoder.decode(raw).data.header)


def folded_header(event: Event) -> FoldedHeader:
    """The folded header a `request/header` event gives."""
    return FoldedHeader(seq=event.seq, reason=event.data.reason, header=event.data.header, raw=header_bytes(event.raw))


def messages_json(messages: Iterable[DerivedMessage]) -> bytes:
    """The messages as one JSON array of their logged bytes."""
    return b"[" + b",".join(m.raw for m in messages) + b"]"


def messages_canonical(messages: Iterable[DerivedMessage]) -> bytes:
    """The messages as canonical JSON (sorted keys, compact): what the gateway compares and hashes."""
    return b"[" + b",".join(m.canonical for m in messages) + b"]"
