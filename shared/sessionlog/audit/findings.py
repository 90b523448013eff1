"""What the audit answers, as data: the finding codes and `Finding`, the token counts and ledgers, a step as
replay shows it (`StepReport`) and the whole `AuditReport`."""

from __future__ import annotations

from typing import Any, Final

import msgspec
from msgspec import Struct

from ..events import Usage

MESSAGE_DIFFERS: Final = "MESSAGE_DIFFERS_FROM_CHUNKS"
PROVENANCE_UNCOVERED: Final = "PROVENANCE_DOES_NOT_COVER_CHUNKS"
MESSAGE_USAGE_DIFFERS: Final = "MESSAGE_USAGE_DIFFERS"
REQUEST_NOT_REBUILDABLE: Final = "REQUEST_NOT_REBUILDABLE"
RAW_STREAM_DIFFERS: Final = "RAW_STREAM_DIFFERS"
PROVIDER_USAGE_DIFFERS: Final = "PROVIDER_USAGE_DIFFERS"
FINDING_CODES: Final = (
    MESSAGE_DIFFERS,
    PROVENANCE_UNCOVERED,
    MESSAGE_USAGE_DIFFERS,
    REQUEST_NOT_REBUILDABLE,
    RAW_STREAM_DIFFERS,
    PROVIDER_USAGE_DIFFERS,
)


class Finding(Struct, frozen=True, omit_defaults=True):
    """One disagreement, as data: which rule, which event, and what was expected against what was found."""

    code: str
    message: str
    seq: int | None = None
    turn: int | None = None
    step: int | None = None
    request_id: str | None = None


class TokenCounts(Struct, omit_defaults=False):
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.requests += 1
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cache_read_tokens += _or0(usage.cache_read_tokens)
        self.cache_write_tokens += _or0(usage.cache_write_tokens)
        self.reasoning_tokens += _or0(usage.reasoning_tokens)

    def count_request(self) -> None:
        self.requests += 1


class ModelTokens(Struct):
    provider: str
    model: str
    tokens: TokenCounts


class Ledger(Struct):
    total: TokenCounts
    by_model: list[ModelTokens]


class StepReport(Struct, frozen=True, omit_defaults=True):
    """One step as the auditor holds it (for `replay` and the report)."""

    turn: int
    step: int
    attempts: int
    chunks: int
    first_chunk: int | None
    message: int | None
    text: str
    reasoning: str
    tool_calls: tuple[tuple[str, str, str], ...]
    usage: dict[str, int] | None
    finish: str | None
    delta_mismatches: tuple[int, ...] = ()  # block-end chunk seqs whose block is not their deltas joined


class AuditReport(Struct, frozen=True):
    session: str
    seq: int
    events: int
    chunks: int
    steps: int
    ledger: Ledger
    findings: list[Finding]
    raw_exchanges: int
    raw_matched: int
    # every exchange the provider answered (HTTP 200), counted from the raw tee, by the model it was sent; beside
    # the log's ledger, and what differs between the two, in words
    provider_ledger: Ledger | None = None
    ledger_difference: list[str] = msgspec.field(default_factory=list)


def _or0(value: int | Any) -> int:
    return value if type(value) is int else 0


def usage_dict(usage: Usage) -> dict[str, int]:
    return msgspec.to_builtins(usage)  # type: ignore[no-any-return]


class Findings(list[Finding]):
    """The findings of one audit, in the order they were found."""

    def find(
        self,
        code: str,
        message: str,
        seq: int | None,
        turn: int | None,
        step: int | None,
        request_id: str | None = None,
    ) -> None:
        self.append(Finding(code=code, message=message, seq=seq, turn=turn, step=step, request_id=request_id))
