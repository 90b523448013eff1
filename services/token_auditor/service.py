"""The token-auditor projection, its raw-tee feed, its metrics and its micro endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Final

import nats.errors
from nats.js import api
from nats.js.errors import KeyNotFoundError, NotFoundError
from prometheus_client import Counter

from sessionlog import contracts
from sessionlog.audit import (
    AuditReport,
    RawAssembler,
    RawExchange,
    SessionAuditor,
    TokenCounts,
    audit_session,
)
from sessionlog.contracts import ReportRequest
from sessionlog.errors import LogUnavailable, SessionNotFound
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.provision import RAW_ALL
from sessionlog.reader import read_raw_exchanges
from sessionlog.record import Record
from sessionlog.runner import Projection, ProjectionRunner, SessionState
from sessionlog.services import ProjectionService
from sessionlog.session import Session
from sessionlog.tasks import cancel_and_wait

SERVICE: Final = contracts.AUDIT.name
RAW_CHECKPOINT_EVERY_S: Final = 1.0

FINDINGS: Final = Counter("sessionlog_audit_findings_total", "Audit findings, by code", ["code"])
TOKENS: Final = Counter(
    "sessionlog_audit_tokens_total", "Tokens in the ledger, by provider, model and kind", ["provider", "model", "kind"]
)
AUDIT_REQUESTS: Final = Counter(
    "sessionlog_audit_model_requests_total", "Model requests (attempts) in the ledger", ["provider", "model"]
)
RAW_EXCHANGES: Final = Counter("sessionlog_audit_raw_exchanges_total", "Raw gateway exchanges read from the tee")

log = logging.getLogger("sessionlog.token_auditor")

_KINDS: Final = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")


class AuditState(SessionState):
    """One session's validated log and its running audit."""

    def __init__(self, session_id: str, model_aliases: Mapping[str, str]) -> None:
        super().__init__(session_id)
        self.session = Session()
        self.auditor = SessionAuditor(session_id, model_aliases=model_aliases)

    def apply(self, record: Record) -> None:
        # The session validates (and may refuse, changing nothing) before the auditor sees the event.
        self.auditor.feed(record.events, self.session)


class TokenAuditor(Projection[AuditState]):
    """The projection; it also exports what the audits find as Prometheus metrics, each finding once."""

    name: ClassVar[str] = "token-auditor"

    def __init__(self, model_aliases: Mapping[str, str] | None = None) -> None:
        self.model_aliases = dict(model_aliases or {})
        # What metrics already counted per session: a reloaded session finds the same things again.
        self._findings_counted: dict[str, int] = {}
        self._tokens_counted: dict[str, dict[tuple[str, str], tuple[int, ...]]] = {}

    def new_state(self, session_id: str) -> AuditState:
        return AuditState(session_id, self.model_aliases)

    def on_applied(self, state: AuditState, record: Record) -> None:
        self.export(state.session_id, state.auditor)

    def export(self, session_id: str, auditor: SessionAuditor) -> None:
        findings = auditor.findings
        counted = self._findings_counted.get(session_id, 0)
        if len(findings) > counted:
            for finding in findings[counted:]:
                FINDINGS.labels(finding.code).inc()
                log.warning("audit finding in %s: %s: %s", session_id, finding.code, finding.message)
            self._findings_counted[session_id] = len(findings)
        seen = self._tokens_counted.setdefault(session_id, {})
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
            seen[model] = now


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
        self.projection = TokenAuditor(dict(log_.settings.provider_model_map))
        super().__init__(log_, ProjectionRunner(log_, self.projection, **runner_options))
        self._raw_feed = raw_feed
        self._rebuild = bool(runner_options.get("rebuild"))
        self._feed: asyncio.Task[None] | None = None
        self.raw_applied = 0  # stream seq of the last raw-tee message the feed handled
        self._raw_checkpointed = 0

    async def _start(self) -> None:
        await super()._start()
        if self._raw_feed:
            start = await self._raw_start_seq()
            self._feed = asyncio.create_task(self._feed_loop(start), name="token-auditor-raw")
        await self._serve_endpoints(contracts.AUDIT, {contracts.REPORT: self._report})

    def health(self) -> dict[str, Any]:
        health = super().health()
        health["raw_feed"] = self._feed is not None and not self._feed.done()
        health["raw_applied"] = self.raw_applied
        return health

    async def stop(self) -> None:
        if self._feed is not None:
            await cancel_and_wait(self._feed)
            await self._raw_checkpoint(force=True)
        await super().stop()

    # ---------------------------------------------------------------------------------- raw tee

    def _raw_key(self) -> str:
        return f"{self.projection.name}.raw"

    async def _raw_start_seq(self) -> int:
        if self._rebuild:
            return 1
        try:
            kv = await self.log.js.key_value(self.settings.kv_checkpoints)
            entry = await kv.get(self._raw_key())
            seq = int(json.loads(entry.value or b"{}").get("stream_seq", 0))
        except (KeyNotFoundError, NotFoundError, ValueError):
            seq = 0
        self.raw_applied = self._raw_checkpointed = seq
        return seq + 1

    async def _raw_checkpoint(self, *, force: bool = False) -> None:
        if self.raw_applied <= self._raw_checkpointed and not force:
            return
        if self.raw_applied == 0:
            return
        body = json.dumps({"stream_seq": self.raw_applied, "replica": self.runner.replica_id}).encode()
        with contextlib.suppress(Exception):
            kv = await self.log.js.key_value(self.settings.kv_checkpoints)
            await kv.put(self._raw_key(), body)
            self._raw_checkpointed = self.raw_applied

    async def _feed_loop(self, start: int) -> None:
        """Follow the raw stream; give each complete exchange of an owned session to its audit."""
        assembler = RawAssembler()
        while True:
            try:
                sub = await self.log.js.subscribe(
                    RAW_ALL,
                    stream=self.settings.raw_stream,
                    ordered_consumer=True,
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    config=api.ConsumerConfig(opt_start_seq=max(1, start)),
                )
            except (nats.errors.Error, NotFoundError) as err:
                log.warning("token-auditor: cannot follow the raw stream %s: %s", self.settings.raw_stream, err)
                await asyncio.sleep(1.0)
                continue
            last_checkpoint = time.monotonic()
            try:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=1.0)
                    except (TimeoutError, nats.errors.TimeoutError):
                        await self._raw_checkpoint()
                        continue
                    start = msg.metadata.sequence.stream + 1
                    session_id = msg.subject.rsplit(".", 1)[-1]
                    exchange = assembler.add(msg.headers or {}, msg.data)
                    if exchange is not None:
                        RAW_EXCHANGES.inc()
                        await self._take_raw(session_id, exchange)
                    self.raw_applied = start - 1
                    if time.monotonic() - last_checkpoint >= RAW_CHECKPOINT_EVERY_S:
                        await self._raw_checkpoint()
                        last_checkpoint = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # keep following: a bad message or a reconnect must not stop the audit
                log.warning("token-auditor: raw feed interrupted: %s", err)
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _take_raw(self, session_id: str, exchange: RawExchange) -> None:
        if not self.runner.owns(session_id):
            return  # the replica that owns the session audits it
        try:
            state = await self.runner.state(session_id)
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
        if self.runner.owns(session_id):
            if min_seq is not None:
                try:
                    state: AuditState | None = await self.runner.wait_for(session_id, min_seq, timeout)
                except TimeoutError as exc:
                    raise LogUnavailable(str(exc)) from None
            else:
                state = await self.runner.state(session_id)
            if state is not None:
                for exchange in raw:
                    state.auditor.add_raw(exchange)
                self.projection.export(session_id, state.auditor)
                return state.auditor.report()
        else:
            records = await self.log.reader.records(session_id)
            if records:
                session = Session([e for r in records for e in r.events])
                if min_seq is not None and len(session) <= min_seq:
                    raise LogUnavailable(
                        f"session {session_id}: seq {min_seq} is not in the log (have {len(session) - 1})"
                    )
                auditor = audit_session(
                    session, raw, session_id=session_id, model_aliases=self.projection.model_aliases
                )
                return auditor.report()
        if await self.log.header(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        return audit_session(Session(), raw, session_id=session_id).report()

    async def _report(self, request: ReportRequest) -> AuditReport:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        return await self.report(request.session, min_seq=request.min_seq, timeout=timeout)
