"""What an event's bytes must be before any decoder reads them: at most `MAX_EVENT_DEPTH` levels of JSON nesting
(`EVENT_TOO_DEEP`, found without recursing) and UTF-8 (`INVALID_EVENT`)."""

from __future__ import annotations

from typing import Final

from .errors import EventTooDeep, InvalidEvent

# The deepest an event's JSON may nest, counting the event object itself and `data` (so `data`'s own values get
# 62 levels). dsh's logs nest 13 deep at most; decoders and projections recurse once per level, and at about 980
# levels Python's recursion limit turned one record into a RecursionError in every projection (issue 11).
MAX_EVENT_DEPTH: Final = 64

_NOT_BRACKET: Final = bytes(b for b in range(256) if b not in b"[]{}")
_AS_SQUARE: Final = bytes.maketrans(b"{}", b"[]")  # for depth, an object is a pair like an array


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether JSON bytes nest more than `limit` objects and arrays, found without recursing.

    Counting brackets costs two C-level scans; only bytes with more brackets than the limit (strings included)
    pay for removing their strings, keeping the brackets, and taking off the innermost pairs once per level (each
    pass removes every container that holds no other, so a value `d` deep is gone after `d` passes). Every step is
    a C-level bytes operation."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Escaped backslashes go first (pairs from the left, as JSON reads them), then escaped quotes: every quote
    # left opens or closes a string, so the even pieces between quotes are what lies outside strings.
    unescaped = raw
    if b"\\\\" in unescaped:
        unescaped = unescaped.replace(b"\\\\", b"")
    if b'\\"' in unescaped:
        unescaped = unescaped.replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(_AS_SQUARE, _NOT_BRACKET)
    for _ in range(limit):
        reduced = brackets.replace(b"[]", b"")  # finds pairs in the bytes as they were: one level per pass
        if not reduced or len(reduced) == len(brackets):
            return False  # all gone within the limit (or not JSON: the decoder says so)
        brackets = reduced
    return b"[]" in brackets


def check_depth(raw: bytes, position: int) -> None:
    """Refuse an event whose JSON nests deeper than `MAX_EVENT_DEPTH` (`EVENT_TOO_DEEP`), before anything
    recurses into it."""
    if nests_deeper_than(raw, MAX_EVENT_DEPTH):
        raise EventTooDeep(
            f"event nests more than {MAX_EVENT_DEPTH} levels of JSON objects and arrays (the event and its "
            "`data` count as two); flatten it, or store deep content as a string or a blob",
            seq=position,
        )


def check_utf8(raw: bytes, position: int) -> None:
    """Refuse bytes that are not UTF-8 (`INVALID_EVENT`): the decoders check only the strings they read, so
    invalid bytes in a skipped field or an ignorable type's `data` would otherwise be kept and exported."""
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        raise InvalidEvent(f"the event is not valid UTF-8 (byte {exc.start}: {exc.reason})", seq=position) from None
