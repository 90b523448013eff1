"""Typed refusals. Every error the log raises carries one stable SPEC section 10 code.

A refusal names the rule, the seq it concerns (when there is one) and what was expected, so a person can act
on it without reading the code. Callers switch on `code`, never on the message text.

Every code the system puts on a wire (a micro-service reply, an HTTP body, a CLI line) is declared here, once, in
the closed table `CODES`: its class and the HTTP status every HTTP surface answers with (`http_status`). A class
defined anywhere else is not a wire code. The JetStream API error numbers the log switches on are known here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, NamedTuple

if TYPE_CHECKING:
    from .provision import FieldDifference


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


class LeaseHeld(SessionLogError):
    """Another holder has a live lease on the session (`ttl_s`: its time to live, when known)."""

    code = "LEASE_HELD"
    ttl_s: float | None = None


class LeaseLost(SessionLogError):
    """The lease this holder had expired or was taken over; it must stop writing and reload."""

    code = "LEASE_LOST"


class PurgeRefused(SessionLogError):
    """The streams were created with `deny_purge`, so a session cannot be erased."""

    code = "PURGE_REFUSED"


class LogFull(SessionLogError):
    """The stream refused the write because it is full (`discard: new`): history is never dropped."""

    code = "LOG_FULL"


class InvalidStep(SessionLogError):
    """A `--step` that is not `TURN.STEP`, or names a step the session does not have."""

    code = "INVALID_STEP"


class SessionBusy(SessionLogError):
    """Another request of the session is being answered (here or by another gateway replica)."""

    code = "SESSION_BUSY"


class SessionHeld(SessionLogError):
    """The session's writer lease is held by a writer that does not answer (a gateway that died, an agent that
    writes the session itself): a retry once the lease has expired can succeed, `retry_after_s` from now."""

    code = "SESSION_HELD"

    def __init__(self, message: str, *, retry_after_s: float | None = None, seq: int | None = None) -> None:
        super().__init__(message, seq=seq)
        self.retry_after_s = retry_after_s


# --- the process and its JetStream resources ----------------------------------------------------------------


class PortInUse(SessionLogError):
    """An HTTP port this process was told to serve on is taken."""

    code = "PORT_IN_USE"


class StreamMismatch(SessionLogError):
    """An existing stream or bucket whose configuration differs from what the settings call for."""

    code = "STREAM_MISMATCH"

    def __init__(
        self, message: str, *, differences: dict[str, list[FieldDifference]] | None = None, seq: int | None = None
    ) -> None:
        super().__init__(message, seq=seq)
        self.differences = differences or {}


class ProvisionFailed(SessionLogError):
    """JetStream refused to create a stream or bucket (limits, permissions, a bad value)."""

    code = "PROVISION_FAILED"


class ServerNotFound(SessionLogError):
    """No nats-server binary where one was expected (an explicit path, the venv, PATH)."""

    code = "SERVER_NOT_FOUND"


class ServerTooOld(SessionLogError):
    """A nats-server older than 2.11 (no per-message TTL, no subject delete markers)."""

    code = "SERVER_TOO_OLD"


class ServerStartFailed(SessionLogError):
    """The nats-server process exited, or did not become ready in time; the message carries its log tail."""

    code = "SERVER_START_FAILED"


# --- the gateway's HTTP surface -------------------------------------------------------------------------------


class UpstreamError(SessionLogError):
    """The provider answered with an error status; `status` is what the gateway answers with."""

    code = "UPSTREAM_ERROR"

    def __init__(
        self, message: str, *, status: int = 502, upstream_status: int | None = None, seq: int | None = None
    ) -> None:
        super().__init__(message, seq=seq)
        self.status = status
        self.upstream_status = upstream_status


class UpstreamTimeout(SessionLogError):
    """The provider did not connect, answer or send the next bytes within the gateway's timeout."""

    code = "UPSTREAM_TIMEOUT"


class UpstreamUnreachable(SessionLogError):
    """The provider could not be reached (connection refused, DNS, TLS) or dropped the connection."""

    code = "UPSTREAM_UNREACHABLE"


class RouteNotFound(SessionLogError):
    """No endpoint at that path."""

    code = "NOT_FOUND"


class MethodNotAllowed(SessionLogError):
    """The path exists but not for that HTTP method."""

    code = "METHOD_NOT_ALLOWED"


class Unauthorized(SessionLogError):
    """The gateway has API keys and the request did not present one of them."""

    code = "UNAUTHORIZED"


class InvalidKeys(SessionLogError):
    """A keys setting or file that is not what the documentation says."""

    code = "INVALID_KEYS"


# --- the closed table -------------------------------------------------------------------------------------------


class Code(NamedTuple):
    """One wire code: the class it is rebuilt as, and the HTTP status every HTTP surface answers it with."""

    cls: type[SessionLogError]
    status: int


def _table(*rows: tuple[type[SessionLogError], int]) -> dict[str, Code]:
    return {cls.code: Code(cls, status) for cls, status in rows}


# 2026-12-03: one status per code for every HTTP surface (gateway, record mode, ui-replayer). The rule: bad input
# is 4xx and final (400 malformed, 404 absent, 409 against the log's current state, 413/422 cannot be carried);
# 503 only where a retry can succeed (the log did not answer); a broken store or process is 500. Hence
# STRUCTURE_INVALID is 409 (the UI said 503, which invites a retry that meets the same refusal).
CODES: Final[Mapping[str, Code]] = _table(
    (SessionLogError, 500),
    # the event and its place in the log (SPEC section 10)
    (InvalidEvent, 400),
    (SeqNotContiguous, 409),
    (SurfaceMarkerRequired, 400),
    (SurfaceMarkerForbidden, 400),
    (InvalidSurfaceOp, 400),
    (ReplaceRangeNotFound, 409),
    (ReplaceRangeInverted, 409),
    (ProvenanceInvalid, 400),
    (ProvenanceIncomplete, 409),
    (ToolResultReplaceInvalid, 409),
    (StructureInvalid, 409),
    (ReplaceSplitsToolPair, 409),
    (EventTooLarge, 413),
    (EventTooDeep, 400),
    (UnsupportedContent, 422),
    (InvalidRequest, 400),
    (InvalidStep, 400),
    # sessions
    (SessionNotFound, 404),
    (SessionAlreadyExists, 409),
    (InvalidSessionId, 400),
    (InvalidBoundary, 400),
    (OpenTurn, 409),
    (Conflict, 409),
    (SessionBusy, 409),
    (SessionHeld, 503),
    (LeaseHeld, 409),
    (LeaseLost, 409),
    (PurgeRefused, 409),
    (DerivationDiverges, 409),
    (HeaderDiverges, 409),
    # the store
    (CorruptLog, 500),
    (UnknownEventType, 500),  # on an HTTP surface, only ever read from the stored log
    (UnsupportedVersion, 500),
    (LogUnavailable, 503),
    (LogFull, 507),
    (StreamMismatch, 500),
    (ProvisionFailed, 500),
    (ServerNotFound, 500),
    (ServerTooOld, 500),
    (ServerStartFailed, 500),
    (PortInUse, 500),
    # HTTP and the provider
    (Unauthorized, 401),
    (InvalidKeys, 500),
    (RouteNotFound, 404),
    (MethodNotAllowed, 405),
    (UpstreamError, 502),
    (UpstreamUnreachable, 502),
    (UpstreamTimeout, 504),
)

ERRORS_BY_CODE: Final[Mapping[str, type[SessionLogError]]] = {code: row.cls for code, row in CODES.items()}


def http_status(err: SessionLogError) -> int:
    """The HTTP status of a refusal on every HTTP surface: the table's, except that a provider's error carries the
    status the gateway chose for it; a code outside the table (a reply from a newer peer) is 500."""
    if isinstance(err, UpstreamError):
        return err.status
    row = CODES.get(err.code)
    return row.status if row is not None else 500


def error_from_code(code: str, message: str, *, seq: int | None = None) -> SessionLogError:
    """Rebuild a typed error from its wire form (a micro-service reply, a CLI line); an unknown code keeps its
    code on a plain `SessionLogError`."""
    row = CODES.get(code)
    if row is None:
        err = SessionLogError(message, seq=seq)
        err.code = code  # type: ignore[misc]
        return err
    return row.cls(message, seq=seq)


# --- JetStream API error numbers (`err_code` of an API or publish-ack error) ---------------------------------

# An expected-last-sequence write lost the race: 10071 ("wrong last sequence: N"), 10164 (the constant form).
JS_WRONG_LAST_SEQUENCE: Final = (10071, 10164)
# The stream is full and refuses new messages (`discard: new`): resources, store full, and the limit forms.
JS_STORE_FULL: Final = (10047, 10077, 10027)
# "duplicate message id is in process": an earlier publish with this message id is still being stored (on a
# cluster, replicated); its outcome is pending, not refused.
JS_DUPLICATE_IN_PROCESS: Final = 10158


def js_not_yet(error: Mapping[str, Any]) -> bool:
    """Whether a JetStream publish error says "not yet" rather than no: 503 (no leader, no quorum) or a duplicate
    still being replicated (what the one node left of a stream without quorum answers a record sent again). The
    publish asks again, and such an answer is no progress of the server through its queue."""
    return error.get("code") == 503 or error.get("err_code") == JS_DUPLICATE_IN_PROCESS


JS_STREAM_NOT_FOUND: Final = 10059
JS_STREAM_NAME_IN_USE: Final = 10058
