"""`SessionAuditor`: one session's events, in order, turned into steps and attempts, each message checked against
its attempt (`MESSAGE_DIFFERS_FROM_CHUNKS`, `PROVENANCE_DOES_NOT_COVER_CHUNKS`, `MESSAGE_USAGE_DIFFERS`), with the
token ledger (`TokenLedger`) and the raw check (`RawMatcher`) beside it. See `sessionlog.audit` for the rules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from msgspec import UNSET

from ..assembly import block_type
from ..errors import InvalidStep
from ..events import AssistantMessageData, Event, FinishChunk, TextDeltaChunk
from ..session import Session
from .attempts import Attempt, Step, source_model
from .content import channels, content_difference, provenance_difference, seq_list, seq_range
from .findings import (
    MESSAGE_DIFFERS,
    MESSAGE_USAGE_DIFFERS,
    PROVENANCE_UNCOVERED,
    REQUEST_NOT_REBUILDABLE,
    AuditReport,
    Findings,
    Ledger,
    StepReport,
    TokenCounts,
    usage_dict,
)
from .ledger import TokenLedger
from .raw import RawExchange
from .rawcheck import RawMatcher


class SessionAuditor:
    """The audit of one session, fed event by event; see `sessionlog.audit`."""

    def __init__(self, session_id: str = "", *, model_aliases: Mapping[str, str] | None = None) -> None:
        self.session_id = session_id
        self.model_aliases = dict(model_aliases or {})
        self.findings = Findings()
        self.steps: dict[tuple[int, int], Step] = {}
        self.events = 0
        self._step: Step | None = None  # the open step
        self._attempt: Attempt | None = None  # the attempt chunks go to
        self._ledger = TokenLedger(self.model_aliases)
        self._raw = RawMatcher(self.steps, self.findings, self._ledger, self.model_aliases)

    # ------------------------------------------------------------------------------------------ feeding

    def feed(self, events: Iterable[bytes | Event], session: Session) -> list[Event]:
        """Append each event to `session` (the gate that validates it: a refused event raises and is not taken)
        and take it, as `add` does; return the events taken. The bulk of a stream, a text delta to the block the
        previous delta went to, is taken here inline, as `StreamAssembly.take` takes it, without a method call per
        chunk."""
        append = session.append
        text_delta = TextDeltaChunk
        taken: list[Event] = []
        keep = taken.append
        for item in events:
            event = append(item)
            keep(event)
            if event.type == "assistant/chunk":
                data = event.data
                chunk = data.chunk
                attempt = self._attempt
                if (
                    attempt is not None
                    and type(chunk) is text_delta
                    and chunk.index == attempt.last_index
                    and not attempt.closed
                    and attempt.step == data.step
                    and attempt.turn == data.turn
                ):
                    seq = event.seq
                    attempt.chunk_seqs.append(seq)
                    attempt.last_parts.append(chunk.text)
                    self.events = seq + 1
                    continue
            self.add(event, session)
        return taken

    def add(self, event: Event, session: Session) -> None:
        """Take the next event; `session` is the log it was just appended to."""
        self.events = event.seq + 1
        kind = event.type
        if kind == "assistant/chunk":
            self._chunk(event, session)
        elif kind == "assistant/message":
            if not event.is_replace:
                self._message(event, session)
        elif kind == "step/start":
            step = Step(event.data.turn, event.data.step, event.seq)
            self.steps[(step.turn, step.step)] = step
            self._step = step
        elif kind == "step/end" or kind == "turn/end":
            self._close_step(event.seq)
        elif kind == "llm/retry" and self._attempt is not None:
            self._settle(self._attempt)
            self._attempt = None

    def extend(self, events: Iterable[Event], session: Session) -> None:
        for event in events:
            self.add(event, session)

    def _chunk(self, event: Event, session: Session) -> None:
        data = event.data
        attempt = self._attempt
        if attempt is None or attempt.closed or attempt.step != data.step or attempt.turn != data.turn:
            attempt = self._open_attempt(event, session)
        attempt.chunk_seqs.append(event.seq)
        attempt.take(data.chunk, event.seq)
        if type(data.chunk) is FinishChunk:
            attempt.closed = True
            self._raw.match()

    def _open_attempt(self, event: Event, session: Session) -> Attempt:
        previous = self._attempt
        if previous is not None and not previous.closed:
            self._settle(previous)
        attempt = Attempt(event, session.derive_messages(), session.fold_request_header())
        step = self.steps.get((attempt.turn, attempt.step))
        if step is None:  # a log whose step/start this auditor never saw (it started mid-log)
            step = self.steps[(attempt.turn, attempt.step)] = Step(attempt.turn, attempt.step, event.seq)
        step.attempts.append(attempt)
        self._attempt = attempt
        if attempt.header is None:
            self.findings.find(
                REQUEST_NOT_REBUILDABLE,
                f"the request of step {attempt.turn}.{attempt.step} (first chunk at seq {event.seq}) has no "
                "request/header before it: its model, system prompt, tools and sampling are not in the log",
                event.seq,
                attempt.turn,
                attempt.step,
            )
        self._match()
        return attempt

    def _match(self) -> None:
        if self._raw.pending:
            self._raw.match()

    def _settle(self, attempt: Attempt) -> None:
        attempt.closed = True
        self._match()

    def _close_step(self, seq: int) -> None:
        step = self._step
        if step is not None:
            step.end_seq = seq
            for attempt in step.attempts:
                attempt.closed = True
                self._ledger.account(attempt)
        self._step = None
        self._attempt = None
        self._match()

    # ------------------------------------------------------------------------------------------ messages

    def _message(self, event: Event, session: Session) -> None:
        data: AssistantMessageData = event.data
        step = self.steps.get((data.turn, data.step))
        attempt = step.untaken() if step is not None else None
        if step is not None:
            step.messages.append(event.seq)
        where = f"assistant/message at seq {event.seq} (step {data.turn}.{data.step})"
        at = (event.seq, data.turn, data.step)
        seqs = event.source_event_seqs if isinstance(event.source_event_seqs, list) else []
        if step is not None and attempt is None and not seqs and data.message.source.kind == "model":
            self._whole_answer(event, step, session)
            return
        if step is None or attempt is None:
            if data.usage is not UNSET:
                self._ledger.charge(source_model(event), data.usage)
            if seqs:
                message = f"{where}: sourceEventSeqs names {seq_list(seqs)}, but the step has no chunks left for it"
                self.findings.find(PROVENANCE_UNCOVERED, message, *at)
            return
        attempt.message = event
        attempt.closed = True
        if self._attempt is attempt:
            self._attempt = None
        own = attempt.chunk_seqs
        spare = (s for a in step.attempts if a.message is None for s in a.chunk_seqs)
        uncovered = provenance_difference(seqs, own, spare)
        if uncovered is not None:
            message = f"{where}: sourceEventSeqs {uncovered} (its chunks are {seq_range(own)})"
            self.findings.find(PROVENANCE_UNCOVERED, message, *at)
        difference = content_difference(data.message.content, attempt.assembled(), cut_short=attempt.cut_short)
        if difference is not None:
            message = f"{where} differs from its chunks ({seq_range(own)}): {difference}"
            self.findings.find(MESSAGE_DIFFERS, message, *at)
        if data.usage is not UNSET and attempt.usage is not None and data.usage != attempt.usage:
            message = f"{where}: usage {usage_dict(data.usage)} is not the usage chunk's {usage_dict(attempt.usage)}"
            self.findings.find(MESSAGE_USAGE_DIFFERS, message, *at)
        self._ledger.account(attempt)
        self._match()

    def _whole_answer(self, event: Event, step: Step, session: Session) -> None:
        """A model's message that was not streamed: an attempt of its own, its blocks as it gives them, so a raw
        exchange that answered it is compared with it and the ledger counts it like a streamed one."""
        messages = session.derive_messages()
        if messages and messages[-1].seq == event.seq:  # the request is what the prefix before it derives
            before: Sequence[Any] = messages[: len(messages) - 1]
        else:
            before = messages
        attempt = Attempt(event, before, session.fold_request_header())  # type: ignore[arg-type]
        for index, block in enumerate(event.data.message.content):
            attempt.block(index, block_type(block)).end = block
        attempt.message = event
        attempt.closed = True
        attempt.whole = True
        step.attempts.append(attempt)
        self._ledger.account(attempt)
        self._match()

    # ------------------------------------------------------------------------------------------ ledger and raw

    @property
    def chunks(self) -> int:
        """Chunks applied so far."""
        return sum(len(a.chunk_seqs) for s in self.steps.values() for a in s.attempts)

    def charged(self) -> Mapping[tuple[str, str], TokenCounts]:
        """The running totals per (provider, model), settled attempts only (what metrics export). Read only."""
        return self._ledger.charged()

    @property
    def charges(self) -> int:
        """How many times `charged` changed: the same count means the same totals."""
        return self._ledger.charges

    def ledger(self) -> Ledger:
        """The token ledger now. An attempt still in progress counts once its step moves on."""
        return self._ledger.ledger(a for s in self.steps.values() for a in s.attempts)

    def add_raw(self, exchange: RawExchange) -> None:
        """A request the gateway forwarded; compared once the attempt it answered is complete in the log."""
        self._raw.add(exchange)

    @property
    def raw_exchanges(self) -> int:
        return self._raw.exchanges

    @property
    def raw_matched(self) -> int:
        return self._raw.matched

    def provider_ledger(self) -> Ledger:
        return self._ledger.provider_ledger()

    def ledger_difference(self, logged: Ledger) -> list[str]:
        """What the provider was seen to answer (raw tee) and the log does not hold, or the reverse, in words."""
        return self._ledger.difference(logged) if self.raw_exchanges else []

    # ------------------------------------------------------------------------------------------ reading

    def step_report(self, turn: int, step: int) -> StepReport:
        found = self.steps.get((turn, step))
        if found is None:
            raise InvalidStep(f"session {self.session_id or '?'} has no step {turn}.{step}")
        attempts = found.attempts
        last = attempts[-1] if attempts else None
        text, reasoning, calls = channels(last.assembled()) if last is not None else ("", "", [])
        return StepReport(
            turn=turn,
            step=step,
            attempts=len(attempts),
            chunks=sum(len(a.chunk_seqs) for a in attempts),
            first_chunk=attempts[0].first_seq if attempts else None,
            message=found.messages[-1] if found.messages else None,
            text=text,
            reasoning=reasoning,
            tool_calls=tuple((c[0], c[1], c[2]) for c in calls),
            usage=usage_dict(last.usage) if last is not None and last.usage is not None else None,
            finish=last.finish if last is not None else None,
            delta_mismatches=tuple(s for a in attempts for s in a.mismatches()),
        )

    def report(self) -> AuditReport:
        ledger = self.ledger()
        return AuditReport(
            session=self.session_id,
            seq=self.events - 1,
            events=self.events,
            chunks=self.chunks,
            steps=len(self.steps),
            ledger=ledger,
            findings=list(self.findings),
            raw_exchanges=self.raw_exchanges,
            raw_matched=self.raw_matched,
            provider_ledger=self.provider_ledger() if self.raw_exchanges else None,
            ledger_difference=self.ledger_difference(ledger),
        )


def audit_session(
    session: Session,
    raw: Iterable[RawExchange] = (),
    *,
    session_id: str = "",
    model_aliases: Mapping[str, str] | None = None,
) -> SessionAuditor:
    """The audit of a whole log and the raw exchanges the gateway recorded for it."""
    auditor = SessionAuditor(session_id, model_aliases=model_aliases)
    auditor.feed(session, Session())
    for exchange in raw:
        auditor.add_raw(exchange)
    return auditor
