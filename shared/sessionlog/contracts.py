"""The declared contracts of the services' NATS micro endpoints: each service's name and subject group, and each
endpoint's request and reply as msgspec Structs.

Both sides decode with the same types: a service decodes every request with its endpoint's request decoder (a bad
one is `INVALID_REQUEST`, naming msgspec's path, e.g. ``$.min_seq``) and encodes the reply Struct; a client
(`micro.ask`) encodes the request Struct and decodes the reply with the endpoint's reply decoder. JSON bodies use
snake_case keys; events inside keep the SPEC's camelCase bytes. Unknown request keys are ignored, so an older
service answers a newer client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Generic, TypeVar

import msgspec
from msgspec import Meta, Raw, Struct

from .audit import AuditReport
from .errors import InvalidRequest

NonNegInt = Annotated[int, Meta(ge=0)]

Req = TypeVar("Req", bound=Struct)
Rep = TypeVar("Rep")


@dataclass(frozen=True)
class ServiceSpec:
    """A micro service: its name, what it does, and the subject prefix of its endpoints."""

    name: str
    description: str
    group: str


@dataclass(frozen=True)
class Endpoint(Generic[Req, Rep]):
    """One endpoint: its subject (`service.group` + `.` + `name`) and the types of its request and reply."""

    service: ServiceSpec
    name: str
    request: type[Req]
    reply: type[Rep]
    _requests: msgspec.json.Decoder[Req] = field(init=False, repr=False, compare=False)
    _replies: msgspec.json.Decoder[Rep] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_requests", msgspec.json.Decoder(self.request))
        object.__setattr__(self, "_replies", msgspec.json.Decoder(self.reply))

    @property
    def subject(self) -> str:
        return f"{self.service.group}.{self.name}"

    def decode_request(self, data: bytes) -> Req:
        """The request a body declares; an empty body is `{}`. Anything else is `INVALID_REQUEST` with msgspec's
        words, which name the path of the field at fault."""
        try:
            return self._requests.decode(data or b"{}")
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{self.subject}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"{self.subject}: request body is not JSON: {exc}") from None

    def decode_reply(self, data: bytes) -> Rep:
        """The reply as declared; raises msgspec's `DecodeError` (`ValidationError` included) when it is not."""
        return self._replies.decode(data)


# ---------------------------------------------------------------------------------------------- context-deriver

CONTEXT: Final = ServiceSpec("sessionlog-context", "derived model context of sessions", "sessionlog.context")


class DeriveRequest(Struct, frozen=True, omit_defaults=True):
    """`min_seq`: wait until the derivation reflects it; `at_seq`: the prefix ending there (inclusive);
    `known_generation` + `known_count`: the caller holds that generation's first messages, send only the rest."""

    session: str
    min_seq: NonNegInt | None = None
    at_seq: NonNegInt | None = None
    timeout_ms: NonNegInt | None = None
    page: NonNegInt | None = None
    known_generation: NonNegInt | None = None
    known_count: NonNegInt | None = None


class DeriveReply(Struct, frozen=True, omit_defaults=True):
    """`messages` is the JSON array of the messages' canonical bytes (of this page, or from `messages_from` on),
    `seqs` each one's seq; `sha256` covers the whole list. `header` is the folded header object (null without
    one), `header_seq` and `header_reason` say where it was logged. `open_step` is `[turn, step]` or null: the
    gateway's invariant needs it, so it is always sent."""

    session: str
    seq: int
    generation: int
    header: Raw
    sha256: str
    open_step: tuple[int, int] | None
    seqs: list[int]
    messages: Raw
    header_seq: int | None = None
    header_reason: str | None = None
    messages_from: int | None = None
    next_page: int | None = None


class PlanReplaceRequest(Struct, frozen=True):
    session: str
    event: dict[str, Any]


class ErrorBody(Struct, frozen=True, omit_defaults=True):
    """A refusal as data: its SPEC code, its message, and the seq it concerns."""

    code: str
    message: str
    seq: int | None = None


class PlanReplaceReply(Struct, frozen=True, omit_defaults=True):
    accepted: bool
    shadowed: list[int]
    error: ErrorBody | None = None


class StatsRequest(Struct, frozen=True):
    pass


class StatsReply(Struct, frozen=True):
    sessions: int
    memory_bytes: int
    lag_events: dict[int, int]
    partitions: list[int]
    quarantined: int
    quarantine: list[dict[str, Any]]
    stalled: list[int]
    replica: str


DERIVE: Final = Endpoint(CONTEXT, "derive", DeriveRequest, DeriveReply)
PLAN_REPLACE: Final = Endpoint(CONTEXT, "plan_replace", PlanReplaceRequest, PlanReplaceReply)
STATS: Final = Endpoint(CONTEXT, "stats", StatsRequest, StatsReply)

# ---------------------------------------------------------------------------------------------- repairer

REPAIR: Final = ServiceSpec("sessionlog-repair", "closes turns whose writer died", "sessionlog.repair")


class SessionRequest(Struct, frozen=True):
    session: str


class CloseReply(Struct, frozen=True):
    """The closers appended, as their bytes (none when the session had no open turn)."""

    session: str
    closers: list[Raw]


CLOSE: Final = Endpoint(REPAIR, "close", SessionRequest, CloseReply)

# ---------------------------------------------------------------------------------------------- token-auditor

AUDIT: Final = ServiceSpec("sessionlog-audit", "token ledger and audit findings of sessions", "sessionlog.audit")


class ReportRequest(Struct, frozen=True):
    session: str
    min_seq: NonNegInt | None = None
    timeout_ms: NonNegInt | None = None


REPORT: Final = Endpoint(AUDIT, "report", ReportRequest, AuditReport)

ENDPOINTS: Final[tuple[Endpoint[Any, Any], ...]] = (DERIVE, PLAN_REPLACE, STATS, CLOSE, REPORT)
