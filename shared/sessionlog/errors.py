"""Typed refusals. Every error the log raises carries one stable SPEC section 10 code.

A refusal names the rule, the seq it concerns (when there is one) and what was expected, so a person can act
on it without reading the code. Callers switch on `code`, never on the message text.
"""

from __future__ import annotations

from typing import ClassVar


class SessionLogError(Exception):
    """Base of every refusal; `code` is stable, `seq` is the event it concerns (None when not one event)."""

    code: ClassVar[str] = "SESSIONLOG_ERROR"

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.seq = seq

    def __str__(self) -> str:
        where = f" at seq {self.seq}" if self.seq is not None else ""
        return f"{self.code}{where}: {self.message}"

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code, "message": self.message}
        if self.seq is not None:
            out["seq"] = self.seq
        return out


class InvalidEvent(SessionLogError):
    """An event does not match its type's schema (missing or mistyped field, or an unknown envelope key)."""

    code = "INVALID_EVENT"


class SeqNotContiguous(SessionLogError):
    """An appended event's seq is not the log length."""

    code = "SEQ_NOT_CONTIGUOUS"


class SurfaceMarkerRequired(SessionLogError):
    """A surface type (user/message, assistant/message, tool/result) without `surfaceOp`."""

    code = "SURFACE_MARKER_REQUIRED"


class SurfaceMarkerForbidden(SessionLogError):
    """A non-surface type that carries `surfaceOp` or `sourceEventSeqs`."""

    code = "SURFACE_MARKER_FORBIDDEN"


class InvalidSurfaceOp(SessionLogError):
    """`surfaceOp` is neither "append" nor exactly {op: "replace", start, end} with non-negative integers."""

    code = "INVALID_SURFACE_OP"


class ReplaceRangeNotFound(SessionLogError):
    """A replace names a start or end seq that is not a current surface node."""

    code = "REPLACE_RANGE_NOT_FOUND"


class ReplaceRangeInverted(SessionLogError):
    """A replace whose start node comes after its end node on the surface."""

    code = "REPLACE_RANGE_INVERTED"


class ProvenanceInvalid(SessionLogError):
    """`sourceEventSeqs` is malformed: not an array, empty where not allowed, not integers, duplicated, or late."""

    code = "PROVENANCE_INVALID"


class ProvenanceIncomplete(SessionLogError):
    """A replacement's `sourceEventSeqs` misses a node it shadows."""

    code = "PROVENANCE_INCOMPLETE"


class ToolResultReplaceInvalid(SessionLogError):
    """A tool/result replacement that spans several nodes, targets another type, or changes more than content."""

    code = "TOOL_RESULT_REPLACE_INVALID"


class StructureInvalid(SessionLogError):
    """The structural rules of SPEC section 6: nesting, numbering, step scope, a result without its call."""

    code = "STRUCTURE_INVALID"


class UnknownEventType(SessionLogError):
    """An event type this build does not know, without `"ignorable": true`."""

    code = "UNKNOWN_EVENT_TYPE"


class CorruptLog(SessionLogError):
    """A bad line or a seq gap that is not at the torn tail (a later line holds a turn/end)."""

    code = "CORRUPT_LOG"


class ReplaceSplitsToolPair(SessionLogError):
    """A replace that would leave a tool call without its result on the surface, or the reverse."""

    code = "REPLACE_SPLITS_TOOL_PAIR"


class EventTooLarge(SessionLogError):
    """An event bigger than one record may carry; move its large content to the blob store."""

    code = "EVENT_TOO_LARGE"


class EventTooDeep(SessionLogError):
    """An event whose JSON nests deeper than `events.MAX_EVENT_DEPTH` containers (no agent event needs that many,
    and every reader of the log would have to recurse that deep)."""

    code = "EVENT_TOO_DEEP"


class UnsupportedVersion(SessionLogError):
    """A session header version this build does not read."""

    code = "UNSUPPORTED_VERSION"


class InvalidBoundary(SessionLogError):
    """A fork boundary that is not a non-negative integer, or lies past the end of the log."""

    code = "INVALID_BOUNDARY"


class OpenTurn(SessionLogError):
    """A fork boundary inside an open turn."""

    code = "OPEN_TURN"


class SessionNotFound(SessionLogError):
    """No session with that id."""

    code = "SESSION_NOT_FOUND"


class SessionAlreadyExists(SessionLogError):
    """A session with that id already exists."""

    code = "SESSION_ALREADY_EXISTS"


class InvalidSessionId(SessionLogError):
    """A session id that is not a safe NATS subject token (letters, digits, '-', '_'; at most 128)."""

    code = "INVALID_SESSION_ID"


class Conflict(SessionLogError):
    """Another writer appended first (optimistic concurrency), or this writer was fenced; reload and retry."""

    code = "CONFLICT"


class DerivationDiverges(SessionLogError):
    """A request's messages differ from the dispatch-time durable derivation."""

    code = "DERIVATION_DIVERGES"


class HeaderDiverges(SessionLogError):
    """A request's model, system prompt, tools or sampling differ from the folded request header."""

    code = "HEADER_DIVERGES"


class UnsupportedContent(SessionLogError):
    """Content the wire conversion cannot carry yet (an image block without its bytes)."""

    code = "UNSUPPORTED_CONTENT"


class InvalidRequest(SessionLogError):
    """A request to a service that is not one at all: a body that is not JSON or not an object, a field of the
    wrong type, or (at the gateway) a `messages` that is not an array of messages. Events have `INVALID_EVENT`."""

    code = "INVALID_REQUEST"


class LogUnavailable(SessionLogError):
    """The log could not acknowledge a write in time (for example a cluster without quorum); nothing was
    reported written that was not acknowledged."""

    code = "LOG_UNAVAILABLE"


def errors_by_code() -> dict[str, type[SessionLogError]]:
    """Every error class this process knows, by code (subclasses defined in other modules included)."""
    found: dict[str, type[SessionLogError]] = {}
    pending: list[type[SessionLogError]] = [SessionLogError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


def error_from_code(code: str, message: str, *, seq: int | None = None) -> SessionLogError:
    """Rebuild a typed error from its wire form (a micro-service reply, a CLI line)."""
    cls = errors_by_code().get(code)
    if cls is None:
        err = SessionLogError(message, seq=seq)
        err.code = code  # type: ignore[misc]
        return err
    return cls(message, seq=seq)


# The codes of this module (SPEC section 10 and the log's own); `errors_by_code()` also finds later subclasses.
ERRORS_BY_CODE: dict[str, type[SessionLogError]] = errors_by_code()
