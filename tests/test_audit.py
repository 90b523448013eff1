"""The token audit (`sessionlog.audit`) as pure functions: no false alarms on the 81 dsh logs, a ledger that adds
up, and every kind of disagreement flagged (a tampered message, provenance that misses chunks, usage, a request
that does not rebuild from the log, a raw provider stream that is not what the agent logged)."""

from __future__ import annotations

import gc
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sessiongen import SessionBuilder, text_block, tool_call_block
from test_fixtures_corpus import FIXTURE_FILES, FIXTURES_DIR, load_fixture, read_fixture

from sessionlog.audit import (
    MESSAGE_DIFFERS,
    MESSAGE_USAGE_DIFFERS,
    PROVENANCE_UNCOVERED,
    PROVIDER_USAGE_DIFFERS,
    RAW_STREAM_DIFFERS,
    REQUEST_NOT_REBUILDABLE,
    InvalidStep,
    RawAssembler,
    RawExchange,
    SessionAuditor,
    audit_session,
    chunk_delays,
    parse_raw_response,
    parse_step,
    step_chunks,
)
from sessionlog.errors import StructureInvalid
from sessionlog.events import UsageChunk
from sessionlog.session import Session
from sessionlog.wire import to_wire

_encode = msgspec.json.encode


def codes(auditor: SessionAuditor) -> list[str]:
    return [f.code for f in auditor.findings]


def usage_sum(session: Session) -> dict[str, int]:
    """The log's usage, summed independently of the auditor: every usage chunk, plus the usage of each message
    whose response carried no usage chunk."""
    total = {"requests": 0, "input": 0, "output": 0, "cache_read": 0, "cache_write": 0, "reasoning": 0}

    def add(usage: Any) -> None:
        total["input"] += usage.input_tokens
        total["output"] += usage.output_tokens
        for key, name in (("cache_read", "cache_read_tokens"), ("cache_write", "cache_write_tokens")):
            value = getattr(usage, name)
            total[key] += value if isinstance(value, int) else 0
        value = usage.reasoning_tokens
        total["reasoning"] += value if isinstance(value, int) else 0

    chunk_usage: set[tuple[int, int]] = set()
    for event in session:
        if event.type == "assistant/chunk" and isinstance(event.data.chunk, UsageChunk):
            add(event.data.chunk.usage)
            chunk_usage.add((event.data.turn, event.data.step))
    for event in session:
        if (
            event.type == "assistant/message"
            and not event.is_replace
            and event.data.usage is not msgspec.UNSET
            and (event.data.turn, event.data.step) not in chunk_usage
        ):
            add(event.data.usage)
    return total


def ledger_totals(auditor: SessionAuditor) -> dict[str, int]:
    t = auditor.ledger().total
    return {
        "requests": 0,
        "input": t.input_tokens,
        "output": t.output_tokens,
        "cache_read": t.cache_read_tokens,
        "cache_write": t.cache_write_tokens,
        "reasoning": t.reasoning_tokens,
    }


def tampered(path: Path, seq: int, old: bytes, new: bytes) -> Session:
    """The fixture with one event's bytes edited (the edit must change them)."""
    events = list(read_fixture(path).events)
    assert old in events[seq], f"{old!r} is not in event {seq}"
    events[seq] = events[seq].replace(old, new, 1)
    return Session(events)


FIXTURE = FIXTURES_DIR / "acp-agent-tool-call-turn-session.jsonl"


def text_step(b: SessionBuilder, text: str) -> None:
    """A streamed step answering `text` (sessiongen's own step writes a fixed message usage of its own)."""
    b.step_start()
    blocks = [text_block(text)]
    b.assistant_message(blocks, source_seqs=b.stream(blocks), usage=False)
    b.step_end()


def first_of(session: Session, kind: str) -> int:
    return next(e.seq for e in session if e.type == kind and not e.is_replace)


# ---------------------------------------------------------------------------------------------- the corpus


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_no_fixture_gives_a_finding_and_its_ledger_is_the_sum_of_its_usage(path: Path) -> None:
    session = load_fixture(path)
    auditor = audit_session(session, session_id=path.name)
    assert auditor.findings == []
    totals = ledger_totals(auditor)
    expected = usage_sum(session)
    expected["requests"] = totals["requests"] = 0
    assert totals == expected
    ledger = auditor.ledger()
    assert sum(m.tokens.input_tokens for m in ledger.by_model) == ledger.total.input_tokens
    assert sum(m.tokens.requests for m in ledger.by_model) == ledger.total.requests
    assert ledger.total.requests >= sum(1 for e in session if e.type == "assistant/message" and e.data.usage)


@pytest.mark.parametrize(
    "name",
    [
        "acp-agent-cancel-session.jsonl",  # cancelled mid-stream: an interrupted partial message
        "acp-agent-subagent-max-tokens-partial-session.1.jsonl",  # max-tokens: the unfinished tool call is dropped
        "acp-agent-empty-response-retry-session.jsonl",  # an empty response, retried; provenance names the retry
        "acp-agent-error-finish-session.jsonl",  # a provider error: chunks and no message
        "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl",
        "web-goal-multi-turn-actions-session.jsonl",  # block-ends the recorder rewrote, deltas it did not
    ],
)
def test_the_legitimate_odd_shapes_are_recognised(name: str) -> None:
    auditor = audit_session(load_fixture(FIXTURES_DIR / name))
    assert auditor.findings == []


def test_the_retried_step_is_charged_for_both_requests() -> None:
    auditor = audit_session(load_fixture(FIXTURES_DIR / "acp-agent-empty-response-retry-session.jsonl"))
    report = auditor.step_report(1, 1)
    assert report.attempts == 2 and report.text == "Recovered."
    assert auditor.ledger().total.requests == 2
    assert auditor.ledger().total.input_tokens == 12


def test_a_step_whose_deltas_differ_from_its_block_end_is_noted_for_replay() -> None:
    auditor = audit_session(load_fixture(FIXTURES_DIR / "web-goal-multi-turn-actions-session.jsonl"))
    assert auditor.step_report(1, 3).delta_mismatches == (504,)


def audit_state(auditor: SessionAuditor) -> Any:
    """Everything the auditor holds and answers, as plain data: its report and every step as replay shows it."""
    steps = [auditor.step_report(turn, step) for turn, step in auditor.steps]
    return msgspec.to_builtins((auditor.report(), steps))


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_a_fed_batch_of_bytes_audits_exactly_as_events_taken_one_by_one(path: Path) -> None:
    one_by_one = SessionAuditor(path.name)
    replay = Session()
    for event in load_fixture(path):
        one_by_one.add(replay.append(event), replay)
    fed = SessionAuditor(path.name)
    fed.feed(read_fixture(path).events, Session())  # the bytes, as the service's records carry them
    assert audit_state(fed) == audit_state(one_by_one)
    assert fed.events == len(replay)


def test_a_refused_event_stops_a_feed_and_nothing_after_it_is_audited() -> None:
    events = list(read_fixture(FIXTURE).events)
    bad = next(i for i, raw in enumerate(events) if b'"text-delta"' in raw) + 1
    assert b'"text-delta"' in events[bad]
    events[bad] = events[bad].replace(b'"step":2', b'"step":3', 1)
    auditor = SessionAuditor()
    session = Session()
    with pytest.raises(StructureInvalid):
        auditor.feed(events, session)
    assert len(session) == auditor.events == bad
    assert auditor.chunks == sum(1 for raw in events[:bad] if b'"assistant/chunk"' in raw)


def test_the_chunks_a_session_keeps_are_not_tracked_by_the_garbage_collector() -> None:
    # The auditor's session keeps every chunk of a stream: tracked ones made each collection walk them all. (A
    # delta holds no container, so msgspec leaves it untracked; a block-end or usage chunk, one per block, is.)
    chunks = [e for e in load_fixture(FIXTURE) if e.type == "assistant/chunk"]
    assert chunks
    assert not any(gc.is_tracked(e) or gc.is_tracked(e.data) for e in chunks)


# ---------------------------------------------------------------------------------------------- tampering


def test_a_tampered_assistant_message_is_flagged_with_the_block_that_differs() -> None:
    session = load_fixture(FIXTURE)
    seq = first_of(session, "assistant/message")
    message = msgspec.json.decode(session[seq].raw)["data"]["message"]
    call = next(b for b in message["content"] if b["type"] == "tool-call")
    old = _encode(call["arguments"])[1:-1]
    auditor = audit_session(tampered(FIXTURE, seq, old, old.replace(b"a", b"b", 1) + b" "))
    assert codes(auditor) == [MESSAGE_DIFFERS]
    finding = auditor.findings[0]
    assert finding.seq == seq and (finding.turn, finding.step) == (1, 1)
    assert "tool-call" in finding.message and f"seq {seq}" in finding.message


def test_a_message_with_text_the_stream_never_sent_is_flagged() -> None:
    path = FIXTURES_DIR / "acp-agent-multi-turn-session.jsonl"
    session = load_fixture(path)
    seq = next(e.seq for e in session if e.type == "assistant/message" and b'"type":"text"' in e.raw)
    text = next(b["text"] for b in msgspec.json.decode(session[seq].raw)["data"]["message"]["content"] if "text" in b)
    old = _encode(text)
    auditor = audit_session(tampered(path, seq, old, _encode(text + " (edited)")))
    assert codes(auditor) == [MESSAGE_DIFFERS]


def test_provenance_that_misses_a_chunk_is_flagged() -> None:
    session = load_fixture(FIXTURE)
    seq = first_of(session, "assistant/message")
    seqs = session[seq].source_event_seqs
    old = b'"sourceEventSeqs":' + _encode(seqs)
    auditor = audit_session(tampered(FIXTURE, seq, old, b'"sourceEventSeqs":' + _encode(seqs[:-1])))
    assert codes(auditor) == [PROVENANCE_UNCOVERED]
    assert f"misses chunks [{seqs[-1]}]" in auditor.findings[0].message


def test_provenance_that_names_a_non_chunk_is_flagged() -> None:
    session = load_fixture(FIXTURE)
    seq = first_of(session, "assistant/message")
    seqs = session[seq].source_event_seqs
    old = b'"sourceEventSeqs":' + _encode(seqs)
    auditor = audit_session(tampered(FIXTURE, seq, old, b'"sourceEventSeqs":' + _encode([2, *seqs])))
    assert codes(auditor) == [PROVENANCE_UNCOVERED]
    assert "names [2], which are not chunks of this step" in auditor.findings[0].message


def test_a_message_usage_other_than_its_usage_chunk_is_flagged() -> None:
    session = load_fixture(FIXTURE)
    seq = first_of(session, "assistant/message")
    usage = msgspec.json.decode(session[seq].raw)["data"]["usage"]
    old = b'"usage":' + _encode(usage)
    auditor = audit_session(tampered(FIXTURE, seq, old, b'"usage":' + _encode({**usage, "outputTokens": 1})))
    assert codes(auditor) == [MESSAGE_USAGE_DIFFERS]


def test_a_response_without_a_request_header_does_not_rebuild() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi.")
    text_step(b, "Hello.")
    b.turn_end()
    auditor = audit_session(b.session)
    assert codes(auditor) == [REQUEST_NOT_REBUILDABLE]
    assert "no request/header" in auditor.findings[0].message


# ---------------------------------------------------------------------------------------------- raw tee


def sse(blocks: Sequence[dict[str, Any]], *, finish: str = "stop", usage: dict[str, Any] | None = None) -> bytes:
    """An OpenAI-compatible SSE body carrying `blocks`, as a provider streams it."""
    chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    calls = 0
    for block in blocks:
        if block["type"] in ("text", "reasoning"):
            key = "content" if block["type"] == "text" else "reasoning_content"
            for piece in re.findall(r"\S+\s*|\s+", block["text"]):
                chunks.append({"choices": [{"index": 0, "delta": {key: piece}}]})
        else:
            head = {"index": calls, "id": block["id"], "type": "function", "function": {"name": block["name"]}}
            chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [head]}}]})
            args = block["arguments"]
            for start in range(0, len(args), 5):
                part = {"index": calls, "function": {"arguments": args[start : start + 5]}}
                chunks.append({"choices": [{"index": 0, "delta": {"tool_calls": [part]}}]})
            calls += 1
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if usage is not None:
        chunks.append({"choices": [], "usage": usage})
    return b"".join(b"data: " + _encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class Streamed:
    """A session of one streamed step, and the exchange a gateway would have recorded for it."""

    def __init__(
        self,
        blocks: Sequence[dict[str, Any]],
        *,
        logged: Sequence[dict[str, Any]] | None = None,
        usage: dict[str, int] | None = None,
        reported_usage: dict[str, Any] | None = None,
        finish: str = "stop",
    ) -> None:
        b = SessionBuilder()
        b.turn_start()
        b.user_message("Read a.txt and tell me what it says.")
        b.request_header(system="You are careful.", temperature=0.2)
        b.step_start()
        dispatch_seq = b.next_seq - 1
        self.request = to_wire(b.session.derive_messages(), b.session.fold_request_header())  # type: ignore[arg-type]
        logged = list(logged if logged is not None else blocks)
        seqs = b.stream(logged)
        if usage is not None:
            # the builder writes a usage chunk of its own; this test states the usage itself
            usage_seq = seqs[-2]
            raw = b.events[usage_seq].replace(
                _encode(msgspec.json.decode(b.events[usage_seq])["data"]["chunk"]["usage"]), _encode(usage)
            )
            b.events[usage_seq] = raw
        self.usage = usage or msgspec.json.decode(b.events[seqs[-2]])["data"]["chunk"]["usage"]
        self.events = list(b.events)
        message = b.assistant_message(logged, source_seqs=seqs, usage=False)
        self.events.append(b.events[message])
        for raw in (b.events[b.step_end()], b.events[b.turn_end()]):
            self.events.append(raw)
        self.session = Session(self.events)
        reported = reported_usage or {
            "prompt_tokens": self.usage["inputTokens"],
            "completion_tokens": self.usage["outputTokens"],
        }
        self.exchange = RawExchange(
            request_id="req-1",
            session_seq=dispatch_seq,
            request=_encode({**self.request, "stream": True, "stream_options": {"include_usage": True}}),
            response=sse(blocks, finish=finish, usage=reported),
        )


ANSWER = [text_block("a.txt says hello, world."), tool_call_block("call-9", "read", '{"path":"b.txt"}')]


def test_a_raw_stream_that_matches_the_log_gives_no_finding() -> None:
    case = Streamed(ANSWER, finish="tool_calls")
    auditor = audit_session(case.session, [case.exchange])
    assert auditor.findings == []
    assert (auditor.raw_exchanges, auditor.raw_matched) == (1, 1)


def test_the_raw_exchange_may_come_before_or_after_the_log_and_in_any_batching() -> None:
    case = Streamed(ANSWER, finish="tool_calls")
    auditor = SessionAuditor()
    auditor.add_raw(case.exchange)  # the tee landed first
    replay = Session()
    for event in case.session:
        replay.append(event)
        auditor.add(event, replay)
    assert auditor.findings == [] and auditor.raw_matched == 1


def test_a_raw_stream_whose_text_differs_from_the_logged_chunks_is_flagged() -> None:
    logged = [text_block("a.txt says goodbye."), ANSWER[1]]
    case = Streamed(ANSWER, logged=logged, finish="tool_calls")
    auditor = audit_session(case.session, [case.exchange])
    assert codes(auditor) == [RAW_STREAM_DIFFERS]
    assert "goodbye" in auditor.findings[0].message and auditor.findings[0].request_id == "req-1"


def test_a_raw_stream_with_other_tool_arguments_is_flagged() -> None:
    logged = [ANSWER[0], tool_call_block("call-9", "read", '{"path":"c.txt"}')]
    auditor = audit_session(*_case(Streamed(ANSWER, logged=logged, finish="tool_calls")))
    assert codes(auditor) == [RAW_STREAM_DIFFERS]
    assert "tool calls" in auditor.findings[0].message


def _case(case: Streamed) -> tuple[Session, list[RawExchange]]:
    return case.session, [case.exchange]


def test_usage_the_provider_reported_differently_is_flagged() -> None:
    usage = {"inputTokens": 40, "outputTokens": 9}
    case = Streamed(
        ANSWER, usage=usage, reported_usage={"prompt_tokens": 40, "completion_tokens": 11}, finish="tool_calls"
    )
    auditor = audit_session(*_case(case))
    assert codes(auditor) == [PROVIDER_USAGE_DIFFERS]
    assert "output: logged 9, provider 11" in auditor.findings[0].message


def test_provider_usage_with_cache_hits_matches_either_input_convention() -> None:
    usage = {"inputTokens": 30, "outputTokens": 9, "cacheReadTokens": 10}
    reported = {"prompt_tokens": 40, "completion_tokens": 9, "prompt_cache_hit_tokens": 10}
    auditor = audit_session(*_case(Streamed(ANSWER, usage=usage, reported_usage=reported, finish="tool_calls")))
    assert auditor.findings == []


def test_a_raw_request_that_is_not_the_derivation_of_the_prefix_does_not_rebuild() -> None:
    case = Streamed(ANSWER, finish="tool_calls")
    request = dict(case.request)
    request["messages"] = [*request["messages"], {"role": "user", "content": "(the time is 12:00)"}]
    exchange = RawExchange("req-2", case.exchange.session_seq, _encode(request), case.exchange.response)
    auditor = audit_session(case.session, [exchange])
    assert codes(auditor) == [REQUEST_NOT_REBUILDABLE]
    assert "DERIVATION_DIVERGES" in auditor.findings[0].message


def test_a_raw_request_with_a_field_the_header_does_not_hold_does_not_rebuild() -> None:
    case = Streamed(ANSWER, finish="tool_calls")
    exchange = RawExchange(
        "req-3", case.exchange.session_seq, _encode({**case.request, "seed": 7}), case.exchange.response
    )
    auditor = audit_session(case.session, [exchange])
    assert codes(auditor) == [REQUEST_NOT_REBUILDABLE]
    assert "HEADER_DIVERGES" in auditor.findings[0].message


def test_the_gateways_model_rename_is_not_a_divergence() -> None:
    case = Streamed(ANSWER, finish="tool_calls")
    renamed = RawExchange(
        "req-4", case.exchange.session_seq, _encode({**case.request, "model": "provider-model"}), case.exchange.response
    )
    assert codes(audit_session(case.session, [renamed])) == [REQUEST_NOT_REBUILDABLE]
    aliases = {"deepseek-v4-flash": "provider-model"}
    assert audit_session(case.session, [renamed], model_aliases=aliases).findings == []


def test_a_complete_provider_response_the_agent_never_logged_is_flagged() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi.")
    b.request_header()
    b.step_start()
    seq = b.next_seq - 1
    b.step_end()
    b.turn_end({"kind": "aborted", "reason": {"kind": "user"}})
    exchange = RawExchange("req-5", seq, b"", sse([text_block("Hello!")]))
    auditor = audit_session(b.session, [exchange])
    assert codes(auditor) == [RAW_STREAM_DIFFERS]
    assert "holds no chunks" in auditor.findings[0].message


def test_a_call_cut_short_only_needs_the_logged_prefix() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Tell me a story.")
    b.request_header()
    b.step_start()
    seq = b.next_seq - 1
    chunks = [
        b.chunk({"type": "block-start", "index": 0, "blockType": "text"}),
        b.chunk({"type": "text-delta", "index": 0, "text": "Once upon "}),
    ]
    message = b.assistant_message([text_block("Once upon ")], source_seqs=chunks, usage=False)
    raw = msgspec.json.decode(b.events[message])
    raw["data"]["interrupted"] = True
    b.events[message] = _encode(raw)
    b.session = Session(b.events)
    b.step_end()
    b.turn_end({"kind": "aborted", "reason": {"kind": "user"}})
    exchange = RawExchange("req-6", seq, b"", sse([text_block("Once upon a time")]), outcome="client_disconnected")
    assert audit_session(b.session, [exchange]).findings == []
    other = RawExchange("req-7", seq, b"", sse([text_block("Twice upon a time")]), outcome="client_disconnected")
    assert codes(audit_session(b.session, [other])) == [RAW_STREAM_DIFFERS]


def test_the_raw_assembler_joins_parts_and_pairs_a_request_with_its_response() -> None:
    assembler = RawAssembler()
    base = {"Sessionlog-Request-Id": "req-8", "Sessionlog-Session-Seq": "4"}
    assert (
        assembler.take({**base, "Sessionlog-Kind": "request", "Sessionlog-Part": "0", "Sessionlog-Parts": "1"}, b"{}")
        == []
    )
    assert assembler.take({"Other": "x"}, b"noise") == []
    head = {**base, "Sessionlog-Kind": "response", "Sessionlog-Parts": "2", "Sessionlog-Upstream-Status": "200"}
    assert assembler.take({**head, "Sessionlog-Part": "1"}, b"world") == []
    exchange = assembler.take({**head, "Sessionlog-Part": "0", "Sessionlog-Outcome": "complete"}, b"hello ")
    assert exchange == [RawExchange("req-8", 4, b"{}", b"hello world", 200, "complete")]


def test_a_raw_response_parses_from_sse_and_from_one_completion() -> None:
    body = sse([{"type": "reasoning", "text": "think"}, *ANSWER], finish="tool_calls", usage={"prompt_tokens": 3})
    parsed = parse_raw_response(body)
    assert (parsed.text, parsed.reasoning, parsed.finish) == ("a.txt says hello, world.", "think", "tool-calls")
    assert parsed.tool_calls == [["call-9", "read", '{"path":"b.txt"}']]
    completion = {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "length"}], "usage": {}}
    one = parse_raw_response(_encode(completion))
    assert (one.text, one.finish) == ("hi", "max-tokens")


# ---------------------------------------------------------------------------------------------- replay


def test_a_step_replays_its_chunks_in_order_with_their_delays() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi.")
    b.request_header()
    text_step(b, "Hello there, friend.")
    b.turn_end()
    chunks = step_chunks(b.session, 1, 1)
    assert [c.type for c in chunks] == ["assistant/chunk"] * len(chunks)
    delays = list(chunk_delays(chunks))
    assert delays[0][0] == 0.0
    assert sum(d for d, _ in delays) == pytest.approx((chunks[-1].time - chunks[0].time) / 1000)  # type: ignore[operator]
    with pytest.raises(InvalidStep):
        step_chunks(b.session, 2, 1)
    assert parse_step("3.2") == (3, 2)
    for bad in ("3", "a.b", "0.1", "1.0", "1.2.3"):
        with pytest.raises(InvalidStep):
            parse_step(bad)


# ---------------------------------------------------------------------------------------------- exported metrics


def _counters(provider_model: tuple[str, str]) -> tuple[float, ...]:
    from prometheus_client import REGISTRY

    provider, model = provider_model
    kinds = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "reasoning_tokens")
    requests = {"provider": provider, "model": model}
    values = [REGISTRY.get_sample_value("sessionlog_audit_model_requests_total", requests)]
    for kind in kinds:
        labels = {"provider": provider, "model": model, "kind": kind}
        values.append(REGISTRY.get_sample_value("sessionlog_audit_tokens_total", labels))
    return tuple(v or 0.0 for v in values)


@pytest.mark.parametrize("path", FIXTURE_FILES[::9], ids=lambda p: p.name.removesuffix(".jsonl"))
def test_the_token_auditor_exports_the_ledger_record_by_record_once_even_when_the_session_is_read_again(
    path: Path,
) -> None:
    from services.token_auditor.service import TokenAuditor
    from sessionlog.record import Record

    session = load_fixture(path)
    raws = [e.raw for e in session]
    records = [
        Record(stream_seq=n + 1, subject="sessionlog.events.0.s", first_seq=n * 3,
               events=tuple(raws[n * 3 : n * 3 + 3]), epoch=1, digest="", open_turn=0, payload_size=0)
        for n in range((len(raws) + 2) // 3)
    ]  # fmt: skip
    projection = TokenAuditor()
    session_id = f"export-{path.stem}"
    whole = audit_session(session).ledger()
    models = [(m.provider, m.model) for m in whole.by_model]
    before = {m: _counters(m) for m in models}
    for reading in range(2):  # the second is the session loaded again (a restart, an eviction): counted once
        state = projection.new_state(session_id)
        state.owned = True
        for record in records:
            state.apply(record)
            projection.on_applied(state, record)
        charged = state.auditor.charged()
        for model in models:
            counts = charged[model]
            expected = (counts.requests, counts.input_tokens, counts.output_tokens, counts.cache_read_tokens,
                        counts.cache_write_tokens, counts.reasoning_tokens)  # fmt: skip
            moved = tuple(a - b for a, b in zip(_counters(model), before[model], strict=True))
            assert moved == expected, (reading, model)


def test_the_token_auditor_remembers_what_it_counted_for_a_bounded_number_of_sessions() -> None:
    """A replica lives through far more sessions than it holds: what its metrics counted is kept for the sessions
    exported last (a session read again within them is counted once), never for every session it ever saw."""
    from services.token_auditor.service import TokenAuditor
    from sessionlog.record import Record

    session = load_fixture(FIXTURE_FILES[0])
    raws = tuple(e.raw for e in session)
    record = Record(stream_seq=1, subject="sessionlog.events.0.s", first_seq=0, events=raws, epoch=1, digest="",
                    open_turn=0, payload_size=0)  # fmt: skip
    (model,) = [(m.provider, m.model) for m in audit_session(session).ledger().by_model][:1]
    projection = TokenAuditor(counted_sessions=3)

    def read(session_id: str) -> None:
        state = projection.new_state(session_id)
        state.owned = True
        state.apply(record)
        projection.on_applied(state, record)

    start = _counters(model)
    for n in range(10):
        read(f"bounded-{n}")
        assert projection.counted_sessions == min(n + 1, 3)
    after_ten = _counters(model)
    assert after_ten != start  # each new session counted
    read("bounded-9")  # within the last three: read again, counted once
    assert _counters(model) == after_ten
    read("bounded-0")  # long forgotten: counted again from its start (the documented over count)
    assert _counters(model) != after_ten


def test_a_streamed_tool_call_finished_as_stop_is_the_logged_tool_calls_finish() -> None:
    """Some OpenAI-compatible servers finish a tool call with `stop`; the log's finish is `tool-calls` (a step that
    called tools), which is what that finish means: no finding (it was `RAW_STREAM_DIFFERS`). Another finish still
    differs."""
    from sessionlog.audit.raw import raw_difference
    from sessionlog.events import ToolCallBlock
    from sessionlog.openai_wire import RawResponse

    raw = RawResponse(tool_calls=[["c1", "f", "{}"]], finish="stop")
    logged = [ToolCallBlock(id="c1", name="f", arguments="{}")]
    assert raw_difference(raw, logged, finish="tool-calls", partial=False) is None
    cut = RawResponse(tool_calls=[["c1", "f", "{}"]], finish="max-tokens")
    assert raw_difference(cut, logged, finish="tool-calls", partial=False) is not None
    assert raw_difference(RawResponse(text="x", finish="stop"), [], finish="tool-calls", partial=False) is not None
