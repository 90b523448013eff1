"""The one assembler of a streamed response (`sessionlog.assembly`): the auditor and the transcript assemble every
chunk sequence alike (a block is its block-end block once it has one, else its deltas), and the auditor's inlined
text-delta path gives exactly what taking each chunk through the assembler gives."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from sessiongen import SessionBuilder, generated_sessions

from sessionlog.assembly import StreamAssembly
from sessionlog.audit import SessionAuditor
from sessionlog.events import Chunk
from sessionlog.session import Session
from sessionlog.transcript import StreamEntry, build_transcript, shown_blocks

TEXTS = st.sampled_from(["", "a", "Hel", "lo ", "wörld", '{"p":1}'])
INDEXES = st.integers(0, 2)


@st.composite
def chunks(draw: Any) -> dict[str, Any]:
    """One stream chunk of any kind, aimed at a few block indexes (so deltas, block-ends and restarts mix)."""
    index = draw(INDEXES)
    kind = draw(st.sampled_from(["text", "text", "text", "reasoning", "call", "start", "end", "usage", "finish"]))
    if kind == "text":
        return {"type": "text-delta", "index": index, "text": draw(TEXTS)}
    if kind == "reasoning":
        return {"type": "reasoning-delta", "index": index, "text": draw(TEXTS)}
    if kind == "call":
        call: dict[str, Any] = {"type": "tool-call-delta", "index": index, "id": draw(st.sampled_from(["", "c1"]))}
        if draw(st.booleans()):
            call["name"] = draw(st.sampled_from(["", "read"]))
        return {**call, "argumentsDelta": draw(TEXTS)}
    if kind == "start":
        return {"type": "block-start", "index": index, "blockType": draw(st.sampled_from(["text", "reasoning"]))}
    if kind == "end":
        block = draw(
            st.sampled_from(
                [
                    {"type": "text", "text": draw(TEXTS)},
                    {"type": "reasoning", "text": draw(TEXTS)},
                    {"type": "tool-call", "id": "c1", "name": "read", "arguments": draw(TEXTS)},
                ]
            )
        )
        return {"type": "block-end", "index": index, "block": block}
    if kind == "usage":
        return {"type": "usage", "usage": {"inputTokens": 3, "outputTokens": draw(st.integers(0, 9))}}
    return {"type": "finish", "reason": {"kind": draw(st.sampled_from(["stop", "error", "max-tokens"]))}}


@st.composite
def streamed_steps(draw: Any) -> Session:
    """A turn of one or two steps whose responses are arbitrary chunk sequences, with retries between them."""
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Go.")
    b.request_header()
    for _ in range(draw(st.integers(1, 2))):
        b.step_start()
        for item in draw(st.lists(st.one_of(chunks(), st.just("retry")), max_size=30)):
            if item == "retry":
                b.emit("llm/retry", {"retry": 1, "maxRetries": 3})
            else:
                b.chunk(item)
        b.step_end()
    b.turn_end()
    return b.session


def audit_state(auditor: SessionAuditor) -> Any:
    steps = [auditor.step_report(turn, step) for turn, step in auditor.steps]
    return msgspec.to_builtins((auditor.report(), steps))


def fed_and_added(events: Any) -> tuple[SessionAuditor, SessionAuditor]:
    fed = SessionAuditor()
    fed.feed(events, Session())
    added = SessionAuditor()
    replay = Session()
    for event in events:
        added.add(replay.append(event), replay)
    return fed, added


@settings(max_examples=150, deadline=None)
@given(streamed_steps())
def test_the_auditor_and_the_transcript_assemble_every_stream_alike(session: Session) -> None:
    fed, added = fed_and_added(list(session))
    assert audit_state(fed) == audit_state(added)  # the inlined text-delta path is the assembler's
    streams = [e for e in build_transcript(session).entries if isinstance(e, StreamEntry)]
    attempts = [a for step in fed.steps.values() for a in step.attempts]
    assert [s.seq for s in streams] == [a.first_seq for a in attempts]
    for stream, attempt in zip(streams, attempts, strict=True):
        assert stream.blocks == shown_blocks(attempt.assembled())
        assert stream.finish == attempt.finish


@settings(max_examples=60, deadline=None)
@given(generated_sessions())
def test_the_inlined_text_delta_path_audits_generated_sessions_as_the_assembler_does(generated: Any) -> None:
    fed, added = fed_and_added(list(generated.session))
    assert audit_state(fed) == audit_state(added)


@settings(max_examples=150, deadline=None)
@given(st.lists(chunks(), max_size=40))
def test_taking_chunks_one_by_one_keeps_every_delta_of_every_block(bodies: list[dict[str, Any]]) -> None:
    # Independent of the assembler: each block's deltas are the deltas sent to its index, in order.
    assembly = StreamAssembly()
    for seq, body in enumerate(bodies):
        assembly.take(msgspec.json.decode(msgspec.json.encode(body), type=Chunk), seq)
    for index, block in assembly.blocks.items():
        sent = [
            b.get("text", b.get("argumentsDelta"))
            for b in bodies
            if b.get("index") == index and b["type"] in ("text-delta", "reasoning-delta", "tool-call-delta")
        ]
        assert block.parts == sent
