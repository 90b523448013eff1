"""The session views other than the transcript, as plain data (JSON-ready dicts) built from the library's
projections: the model's view at a request (`Session.derive_at`, one derive), the audit (`SessionAuditor`'s steps,
ledger and findings) and the raw exchanges against the log's derivation. Pure: no I/O, no HTML.

A *request* is an attempt of a step as the auditor holds it: the model was asked at its first chunk, so the view
the model got is the prefix ending just before it (SPEC section 6's theorem), `at = first_seq - 1`.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from msgspec import UNSET

from sessionlog.audit import Attempt, Finding, RawExchange, SessionAuditor
from sessionlog.events import Event, Usage
from sessionlog.session import DerivedMessage, Session, messages_json
from sessionlog.transcript import shown_blocks

SYNTHETIC_CODES: Final = frozenset({"TOOL_OUTCOME_UNKNOWN", "TOOL_NOT_STARTED"})
RAW_TEXT_LIMIT: Final = 200_000  # characters of a raw body shown on a page (the JSON endpoint has them all)


def _n(value: int | Any) -> int:
    return value if type(value) is int else 0


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the session: step, attempt and where the model's view of it ends."""

    turn: int
    step: int
    attempt: int  # 1-based within the step
    first_chunk: int
    at: int  # the last seq of the prefix the request was built from
    messages: int  # derived messages the request carried
    model: str
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    finish: str | None

    def label(self) -> str:
        return f"{self.turn}.{self.step}" + (f" #{self.attempt}" if self.attempt > 1 else "")


def _usage_of(attempt: Attempt) -> Usage | None:
    if attempt.usage is not None:
        return attempt.usage
    if attempt.message is not None and attempt.message.data.usage is not UNSET:
        usage: Usage = attempt.message.data.usage
        return usage
    return None


def requests_of(auditor: SessionAuditor) -> list[Request]:
    """Every request of the session in log order."""
    out: list[Request] = []
    for step in auditor.steps.values():
        for index, attempt in enumerate(step.attempts, 1):
            usage = _usage_of(attempt)
            out.append(
                Request(
                    turn=attempt.turn,
                    step=attempt.step,
                    attempt=index,
                    first_chunk=attempt.first_seq,
                    at=attempt.first_seq - 1,
                    messages=len(attempt.messages),
                    model=attempt.model[1],
                    input_tokens=usage.input_tokens if usage is not None else None,
                    output_tokens=usage.output_tokens if usage is not None else None,
                    cache_read_tokens=_n(usage.cache_read_tokens) if usage is not None else None,
                    finish=attempt.finish,
                )
            )
    out.sort(key=lambda r: r.first_chunk)
    return out


def compactions_of(session: Session, replaces: Sequence[int]) -> list[dict[str, Any]]:
    """The replacement events (seqs given), each with the range of nodes it shadowed."""
    out = []
    for seq in replaces:
        event = session[seq]
        op = event.surface_op
        assert isinstance(op, dict)
        out.append({"seq": seq, "type": event.type, "start": op["start"], "end": op["end"]})
    return out


# ---------------------------------------------------------------------------------------------- the model's view


def _blocks(message: Any) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(b) for b in shown_blocks(message.content)]


def _synthetic(event: Event) -> str | None:
    if event.type != "tool/result" or event.data.error is UNSET:
        return None
    code = event.data.error.code
    return code if code in SYNTHETIC_CODES else None


def _message_item(session: Session, message: DerivedMessage) -> dict[str, Any]:
    event = session[message.seq]
    item: dict[str, Any] = {
        "seq": message.seq,
        "type": event.type,
        "role": message.role,
        "blocks": _blocks(message.message),
    }
    synthetic = _synthetic(event)
    if synthetic:
        item["synthetic"] = synthetic
    if event.is_replace:
        op = event.surface_op
        assert isinstance(op, dict)
        sources = event.source_event_seqs if isinstance(event.source_event_seqs, list) else []
        item["replaces"] = {
            "start": op["start"],
            "end": op["end"],
            "source_event_seqs": list(sources),
            "shadowed": [_shadowed(session, s) for s in sources if _is_surface(session, s)],
        }
    return item


def _is_surface(session: Session, seq: int) -> bool:
    return 0 <= seq < len(session) and session[seq].surface_op is not UNSET


def _shadowed(session: Session, seq: int) -> dict[str, Any]:
    event = session[seq]
    message = event.data if event.type == "user/message" else event.data.message
    return {"seq": seq, "type": event.type, "role": message.role, "blocks": _blocks(message)}


def previous_request(requests: Sequence[Request], at: int) -> Request | None:
    """The latest request whose view ends before `at`."""
    index = bisect.bisect_left([r.at for r in requests], at)
    return requests[index - 1] if index > 0 else None


def context_view(
    session: Session, at: int, requests: Sequence[Request], *, start: int | None = 0, limit: int | None = None
) -> dict[str, Any]:
    """What the model was given at `at`: the derived messages (a compaction with what it replaced), the folded
    request header, and the difference from the previous request (messages added, messages taken off).

    `start`/`limit` window the messages shown (a request may carry thousands; `start=None` is the last `limit`);
    counts, the diff and the list of compactions in force always cover the whole request."""
    messages = session.derive_at(at)
    header = session.fold_request_header_at(at)
    previous = previous_request(requests, at)
    current = [m.seq for m in messages]
    total = len(messages)
    if start is None:
        start = max(0, total - limit) if limit is not None else 0
    start = min(max(0, start), total)
    stop = total if limit is None else min(total, start + limit)
    window = messages[start:stop]
    view: dict[str, Any] = {
        "at": at,
        "request": next((_request_dict(r) for r in requests if r.at == at), None),
        "header": None
        if header is None
        else {
            "seq": header.seq,
            "reason": header.reason,
            "provider": header.header.config.provider,
            "model": header.header.config.model,
            "header": msgspec.json.decode(header.raw),
        },
        "total": total,
        "start": start,
        "compactions": [{"index": i, "seq": m.seq} for i, m in enumerate(messages) if session[m.seq].is_replace],
        "messages": [_message_item(session, m) for m in window],
        "previous": None,
    }
    if previous is not None:
        before = [m.seq for m in session.derive_at(previous.at)]
        now = set(current)
        then = set(before)
        removed = [s for s in before if s not in now]
        replaced_by: dict[int, int] = {}
        for seq in current:
            event = session[seq]
            if event.is_replace and isinstance(event.source_event_seqs, list):
                for source in event.source_event_seqs:
                    replaced_by[source] = seq
        view["previous"] = {
            "at": previous.at,
            "request": _request_dict(previous),
            "added": [s for s in current if s not in then],
            "removed": [{**_shadowed(session, s), "replaced_by": replaced_by.get(s)} for s in removed],
        }
    return view


def requests_view(session: Session, requests: Sequence[Request], replaces: Sequence[int]) -> dict[str, Any]:
    """The session's timeline: every request, every compaction (seqs in `replaces`) and the length of the log."""
    return {
        "requests": [_request_dict(r) for r in requests],
        "compactions": compactions_of(session, replaces),
        "events": len(session),
    }


def _request_dict(request: Request) -> dict[str, Any]:
    return {
        "turn": request.turn,
        "step": request.step,
        "attempt": request.attempt,
        "label": request.label(),
        "first_chunk": request.first_chunk,
        "at": request.at,
        "messages": request.messages,
        "model": request.model,
        "input_tokens": request.input_tokens,
        "output_tokens": request.output_tokens,
        "cache_read_tokens": request.cache_read_tokens,
        "finish": request.finish,
    }


# ---------------------------------------------------------------------------------------------- the audit


def cost_of(prices: Mapping[str, Mapping[str, float]], model: str, r: Request) -> float | None:
    """USD for one request at the configured per-million-token prices of its model; None when unpriced."""
    price = prices.get(model)
    if price is None or r.input_tokens is None or r.output_tokens is None:
        return None
    cache = r.cache_read_tokens or 0
    input_price = price.get("input", 0.0)
    return (
        r.input_tokens * input_price
        + r.output_tokens * price.get("output", 0.0)
        + cache * price.get("cache_read", input_price)
    ) / 1e6


def audit_view(
    auditor: SessionAuditor,
    requests: Sequence[Request],
    compactions: Sequence[dict[str, Any]],
    prices: Mapping[str, Any],
) -> dict[str, Any]:
    """The ledger per step and per turn, the findings, and the series the charts draw (each chart's numbers)."""
    report = auditor.report()
    findings_at: dict[tuple[int | None, int | None], list[Finding]] = {}
    for finding in report.findings:
        findings_at.setdefault((finding.turn, finding.step), []).append(finding)
    steps: list[dict[str, Any]] = []
    turns: dict[int, dict[str, int]] = {}
    cumulative = 0.0
    priced = False
    points: list[dict[str, Any]] = []
    by_step: dict[tuple[int, int], list[Request]] = {}
    for r in requests:
        by_step.setdefault((r.turn, r.step), []).append(r)
        cost = cost_of(prices, r.model, r)
        if cost is not None:
            cumulative += cost
            priced = True
        points.append(
            {
                "label": r.label(),
                "first_chunk": r.first_chunk,
                "at": r.at,
                "messages": r.messages,
                "input_tokens": r.input_tokens,
                "output_tokens": r.output_tokens,
                "cost_usd": cost,
                "cumulative_cost_usd": round(cumulative, 6) if priced else None,
            }
        )
    for (turn, number), step in auditor.steps.items():
        rs = by_step.get((turn, number), [])
        tokens_in = sum(r.input_tokens or 0 for r in rs)
        tokens_out = sum(r.output_tokens or 0 for r in rs)
        found = findings_at.get((turn, number), [])
        steps.append(
            {
                "turn": turn,
                "step": number,
                "attempts": len(step.attempts),
                "first_chunk": step.attempts[0].first_seq if step.attempts else None,
                "message": step.messages[-1] if step.messages else None,
                "model": rs[-1].model if rs else None,
                "context_messages": rs[-1].messages if rs else None,
                "input_tokens": tokens_in,
                "output_tokens": tokens_out,
                "finish": rs[-1].finish if rs else None,
                "findings": [msgspec.to_builtins(f) for f in found],
            }
        )
        total = turns.setdefault(turn, {"turn": turn, "steps": 0, "input_tokens": 0, "output_tokens": 0, "findings": 0})
        total["steps"] += 1
        total["input_tokens"] += tokens_in
        total["output_tokens"] += tokens_out
        total["findings"] += len(found)
    return {
        "ledger": msgspec.to_builtins(report.ledger),
        "findings": [msgspec.to_builtins(f) for f in report.findings],
        "raw_exchanges": report.raw_exchanges,
        "raw_matched": report.raw_matched,
        "steps": steps,
        "turns": list(turns.values()),
        "requests": points,
        "compactions": list(compactions),
        "priced": priced,
        "total_cost_usd": round(cumulative, 6) if priced else None,
    }


# ---------------------------------------------------------------------------------------------- raw exchanges


def _text(body: bytes, limit: int | None) -> str:
    text = body.decode("utf-8", "replace")
    with contextlib.suppress(msgspec.DecodeError):  # an SSE stream, or not JSON at all: shown as it came
        text = msgspec.json.format(body, indent=2).decode("utf-8", "replace")
    if limit is not None and len(text) > limit:
        return text[:limit] + f"\n… ({len(text) - limit} more characters in the JSON endpoint)"
    return text


def raw_view(
    session: Session, exchanges: Sequence[RawExchange], findings: Sequence[Finding], *, limit: int | None = None
) -> list[dict[str, Any]]:
    """Each raw exchange: what the provider received and returned, the log's derivation at the seq the gateway
    checked it at, and the token-auditor's verdict (its findings that name the request)."""
    out = []
    for exchange in exchanges:
        named = [msgspec.to_builtins(f) for f in findings if f.request_id == exchange.request_id]
        at = exchange.session_seq
        known = 0 <= at < len(session)
        derivation = session.derive_at(at) if known else None
        header = session.fold_request_header_at(at) if known else None
        out.append(
            {
                "request_id": exchange.request_id,
                "session_seq": at,
                "status": exchange.status,
                "outcome": exchange.outcome,
                "request": _text(exchange.request, limit),
                "response": _text(exchange.response, limit),
                "derivation": _text(messages_json(derivation), limit) if derivation is not None else None,
                "header": _text(header.raw, limit) if header is not None else None,
                "verdict": "differs" if named else ("agrees" if known else "not in the log yet"),
                "findings": named,
            }
        )
    return out
