"""The token-auditor projection, its raw-tee feed, its metrics and its micro endpoint."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from prometheus_client import Counter

from sessionlog import contracts
from sessionlog.audit import (
    AuditReport,
    RawExchange,
    SessionAuditor,
    TokenCounts,
    audit_session,
)
from sessionlog.contracts import ReportRequest
from sessionlog.errors import LogUnavailable, SessionNotFound
from sessionlog.feed import CheckpointedFeed
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.pull import Delivery
from sessionlog.reader import RawFeed, StreamReader, read_raw_exchanges
from sessionlog.record import Record
from sessionlog.runner import NotReached, Projection, ProjectionRunner, SessionLogState
from sessionlog.services import ProjectionService
from sessionlog.session import Session

SERVICE: Final = contracts.AUDIT.name

FINDINGS: Final = Counter("sessionlog_audit_findings_total", "Audit findings, by code", ["code"])
TOKENS: Final = Counter(
    "sessionlog_audit_tokens_total", "Tokens in the ledger, by provider, model and kind", ["provider", "model", "kind"]
)
AUDIT_REQUESTS: Final = Counter(
    "sessionlog_audit_model_requests_total", "Model requests (attempts) in the ledger", ["provider", "model"]
)
RAW_EXCHANGES: Final = Counter("sessionlog_audit_raw_exchanges_total", "Raw gateway exchanges read from the tee")

log = logging.getLogger("sessionlog.token_auditor")

# Sessions whose counted totals a replica remembers (at least; the service allows ten times the sessions it holds).
COUNTED_SESSIONS: Final = 100_000
_KINDS: Final = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")


class AuditState(SessionLogState):
    """One session's validated log and its running audit."""

    def __init__(self, session_id: str, model_aliases: Mapping[str, str]) -> None:
        super().__init__(session_id)
        self.auditor = SessionAuditor(session_id, model_aliases=model_aliases)

    def apply(self, record: Record) -> None:
        # The auditor's fast path appends to the session itself: the session validates (and may refuse,
        # changing nothing) before the auditor sees the event.
        self.auditor.feed(record.events, self.session)


class TokenAuditor(Projection[AuditState]):
    """The projection; it also exports what the audits find as Prometheus metrics, each finding once."""

    name: ClassVar[str] = "token-auditor"

    def __init__(self, model_aliases: Mapping[str, str] | None = None, *, counted_sessions: int = COUNTED_SESSIONS):
        self.model_aliases = dict(model_aliases or {})
        # What metrics already counted per session, for the `counted_sessions` sessions exported last: a session
        # read again (evicted, reloaded) finds the same things again and must not count them twice. Bounded: a
        # replica lives through far more sessions than it holds; one idle past that many others that resumes is
        # counted again from its start (the counters over count it; the report and the ledger stay exact).
        self._counted: LRU[str, _Counted] = LRU(counted_sessions)

    def new_state(self, session_id: str) -> AuditState:
        return AuditState(session_id, self.model_aliases)

    def on_applied(self, state: AuditState, record: Record) -> None:
        if state.owned:  # a view of another replica's session: that replica counts its findings
            self.export(state.session_id, state.auditor)

    @property
    def counted_sessions(self) -> int:
        """Sessions whose counted totals are remembered now (at most the bound)."""
        return len(self._counted)

    def export(self, session_id: str, auditor: SessionAuditor) -> None:
        findings = auditor.findings
        mark = (len(findings), auditor.charges)
        counted = self._counted.use(session_id)
        if counted is None:
            counted = _Counted()
            self._counted.put(session_id, counted)
        elif counted.exported == mark:
            return  # most records: a chunk settles nothing and finds nothing
        counted.exported = mark
        if len(findings) > counted.findings:
            for finding in findings[counted.findings :]:
                FINDINGS.labels(finding.code).inc()
                log.warning("audit finding in %s: %s: %s", session_id, finding.code, finding.message)
            counted.findings = len(findings)
        seen = counted.tokens
        for model, counts in auditor.charged().items():
            now = _tuple(counts)
            before = seen.get(model)
            if before == now:
                continue
            before = before or (0,) * len(now)
            provider, name = model
            if now[0] > before[0]:
                AUDIT_REQUESTS.labels(provider, name).inc(now[0] - before[0])
            for kind, new, old in zip(_KINDS, now[1:], before[1:], strict=True):
                if new > old:
                    TOKENS.labels(provider, name, kind).inc(new - old)
            # What was counted only grows: a session read again (a restart, an eviction) replays its totals from
            # zero, and they must climb back past what was counted before anything is counted again.
            seen[model] = tuple(map(max, now, before))


@dataclass(slots=True)
class _Counted:
    """What the metrics counted of one session: its findings, its token totals per model (each only grows), and
    the audit's (findings, charges) at the last export."""

    findings: int = 0
    tokens: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    exported: tuple[int, int] = (-1, -1)


def _tuple(counts: TokenCounts) -> tuple[int, ...]:
    return (
        counts.requests,
        counts.input_tokens,
        counts.output_tokens,
        counts.cache_read_tokens,
        counts.cache_write_tokens,
        counts.reasoning_tokens,
    )


class TokenAuditorService(ProjectionService[AuditState]):
    """The projection runner, the raw-tee feed and the `sessionlog.audit.report` endpoint."""

    def __init__(self, log_: SessionLog, *, raw_feed: bool = True, **runner_options: Any) -> None:
        counted = max(COUNTED_SESSIONS, 10 * log_.settings.projection_max_sessions)
        self.projection = TokenAuditor(dict(log_.settings.provider_model_map), counted_sessions=counted)
        super().__init__(log_, ProjectionRunner(log_, self.projection, **runner_options))
        self._raw_feed = raw_feed
        self._feed: CheckpointedFeed | None = None

    async def _start(self) -> None:
        await super()._start()
        if self._raw_feed:
            # The same checkpointed feed as the partitions': a consumer of this replica's own on the raw stream
            # (every replica reads every exchange and audits those of the sessions it owns).
            feed = RawFeed(StreamReader(self.log.nc, self.settings.raw_stream, timeout=self.settings.request_timeout_s))

            async def take(item: Delivery) -> None:
                try:
                    exchanges = await feed.take(
                        item.msg.subject, item.stream_seq, item.msg.headers or {}, item.msg.data
                    )
                    for exchange in exchanges:
                        RAW_EXCHANGES.inc()
                        await self._take_raw(item.msg.subject.rsplit(".", 1)[-1], exchange)
                except Exception as err:  # a bad message must not stop the audit: the report reads the tee again
                    log.warning("token-auditor: raw stream seq %d skipped: %s", item.stream_seq, err)

            self._feed = self.runner.follow(self.settings.raw_stream, None, "raw", take)  # all of it
        await self._serve_endpoints(contracts.AUDIT, {contracts.REPORT: self._report})

    @property
    def raw_applied(self) -> int:
        """Stream seq of the last raw-tee message the feed handled."""
        return self._feed.applied if self._feed is not None else 0

    def health(self) -> dict[str, Any]:
        health = super().health()
        health["raw_feed"] = self._feed is not None and self._feed.task is not None and not self._feed.task.done()
        health["raw_applied"] = self.raw_applied
        return health

    # ---------------------------------------------------------------------------------- raw tee

    async def _take_raw(self, session_id: str, exchange: RawExchange) -> None:
        if not self.runner.owns(session_id):
            return  # the replica that owns the session audits it
        try:
            state = await self.runner.session_at(session_id)
        except Exception as err:  # a quarantined session: nothing to compare with
            log.warning("token-auditor: raw exchange %s of %s not audited: %s", exchange.request_id, session_id, err)
            return
        if state is None:
            return  # no events yet: the report reads the raw stream again when asked
        state.auditor.add_raw(exchange)
        self.projection.export(session_id, state.auditor)

    # ---------------------------------------------------------------------------------- reports

    async def report(self, session_id: str, *, min_seq: int | None = None, timeout: float | None = None) -> AuditReport:
        """The session's ledger and findings, the raw tee read again so nothing it holds is missed."""
        check_session_id(session_id)
        timeout = timeout if timeout is not None else self.settings.request_timeout_s
        raw = await read_raw_exchanges(
            self.log.nc, self.settings.raw_stream, session_id, timeout=self.settings.request_timeout_s
        )
        try:
            state = await self.runner.session_at(session_id, min_seq, timeout)
        except NotReached as exc:
            raise LogUnavailable(str(exc)) from None
        if state is not None:
            for exchange in raw:
                state.auditor.add_raw(exchange)
            if state.owned:  # the replica that owns the session counts what it finds
                self.projection.export(session_id, state.auditor)
            return state.auditor.report()
        if await self.log.header(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        return audit_session(Session(), raw, session_id=session_id).report()

    async def _report(self, request: ReportRequest) -> AuditReport:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        return await self.report(request.session, min_seq=request.min_seq, timeout=timeout)
