"""The transcript model (`sessionlog.transcript`): what a person sees of a session, as pure data.

Every append-origin event shows, in order and unchanged by any compaction; turns show their outcome; a crash's
synthetic results, a cancelled partial answer, a failed or retried request and a fork's seed are marked; the
incremental builder's updates, applied as a live page applies them, give exactly the snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from sessiongen import SessionBuilder, generated_sessions, text_block, tool_call_block, user_message_data
from test_fixtures_corpus import FIXTURE_FILES, FIXTURES_DIR, load_fixture, read_fixture

from services.ui_replayer.service import UIState
from sessionlog.audit import audit_session
from sessionlog.events import SURFACE_TYPES
from sessionlog.record import Record
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session
from sessionlog.transcript import (
    CompactionEntry,
    DeltaUpdate,
    EntryUpdate,
    MessageEntry,
    NoteEntry,
    SeedEntry,
    StreamEntry,
    Transcript,
    TranscriptBuilder,
    TurnEndEntry,
    TurnStartEntry,
    Update,
    build_transcript,
    coalesce,
    shown_blocks,
    transcript_json,
    transcript_plain,
)


def fixture(name: str) -> tuple[Session, bytes]:
    path = FIXTURES_DIR / name
    return load_fixture(path), read_fixture(path).header_raw


def entries_of(transcript: Transcript, kind: type[Any]) -> list[Any]:
    return [e for e in transcript.entries if isinstance(e, kind)]


class Page:
    """Applies updates the way the page's script does: entries by key, deltas appended to a block's text."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []

    def apply(self, updates: list[Update]) -> None:
        for update in updates:
            if isinstance(update, EntryUpdate):
                entry = msgspec.json.decode(msgspec.json.encode(update.entry))
                key = entry["key"]
                replaces = entry.get("replaces")
                if key not in self.entries and replaces in self.entries:
                    self.order[self.order.index(replaces)] = key
                    del self.entries[replaces]
                elif key not in self.entries:
                    self.order.append(key)
                self.entries[key] = entry
            else:
                assert isinstance(update, DeltaUpdate)
                entry = self.entries[update.key]
                blocks = entry.setdefault("blocks", [])
                while len(blocks) <= update.index:
                    blocks.append({"type": update.block})
                block = blocks[update.index]
                block["text"] = block.get("text", "") + update.text
                if update.name and not block.get("name"):
                    block["name"] = update.name
                if update.id:
                    block["id"] = update.id

    def normalized(self) -> list[dict[str, Any]]:
        return [_normal(self.entries[k]) for k in self.order]


def _normal(entry: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in entry.items() if k != "last"}
    out["blocks"] = [{k: v for k, v in b.items() if v not in ("", None, False)} for b in entry.get("blocks", [])]
    return out


def page_of(transcript: Transcript) -> list[dict[str, Any]]:
    return [_normal(msgspec.json.decode(msgspec.json.encode(e))) for e in transcript.entries]


def one_step(*chunks: dict[str, Any]) -> SessionBuilder:
    """A turn with one step that has streamed `chunks` so far (`llm/retry` for a retry between them)."""
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Say hello.")
    b.request_header()
    b.step_start()
    for chunk in chunks:
        if chunk["type"] == "llm/retry":
            b.emit("llm/retry", {"attempt": 1, "delayMs": 250})
        else:
            b.chunk(chunk)
    return b


# ---------------------------------------------------------------------------------------------- the corpus


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_every_fixture_renders_every_append_origin_event_once_in_order(path: Path) -> None:
    session = load_fixture(path)
    transcript = build_transcript(session, read_fixture(path).header_raw)
    messages = entries_of(transcript, MessageEntry)
    appended = [e for e in session if e.type in SURFACE_TYPES and e.surface_op == "append"]
    assert [m.seq for m in messages] == [e.seq for e in appended]
    for entry, event in zip(messages, appended, strict=True):
        message = event.data if event.type == "user/message" else event.data.message
        assert entry.blocks == shown_blocks(message.content)
        assert entry.event_type == event.type
    assert len(entries_of(transcript, CompactionEntry)) == sum(1 for e in session if e.is_replace)
    assert len(entries_of(transcript, TurnStartEntry)) == session.last_turn
    assert len(entries_of(transcript, TurnEndEntry)) == sum(1 for e in session if e.type == "turn/end")
    assert transcript.next_seq == len(session)
    msgspec.json.decode(transcript_json(transcript))  # the JSON the API serves
    assert transcript_plain(transcript) or not session.events


@pytest.mark.parametrize("path", FIXTURE_FILES[::8], ids=lambda p: p.name.removesuffix(".jsonl"))
def test_a_page_that_follows_the_updates_record_by_record_shows_the_snapshot(path: Path) -> None:
    session = load_fixture(path)
    builder = TranscriptBuilder()
    page = Page()
    batch: list[Update] = []
    for event in session:
        batch.extend(builder.add(event))
        if event.seq % 7 == 0:  # records of a few events, as the writer batches them
            page.apply(coalesce(batch))
            batch = []
    page.apply(coalesce(batch))
    assert page.normalized() == page_of(builder.snapshot())


@given(generated_sessions())
def test_generated_sessions_stream_to_the_snapshot_and_the_incremental_build_equals_the_batch_one(
    generated: Any,
) -> None:
    builder = TranscriptBuilder()
    page = Page()
    for event in generated.session:
        page.apply(builder.add(event))
    snapshot = builder.snapshot()
    assert page.normalized() == page_of(snapshot)
    assert snapshot == build_transcript(generated.session)


# ---------------------------------------------------------------------------------------------- quiet builders
# A builder nobody follows live (a rebuild, a session no page tails) builds no updates; what it keeps is the same.


def _records(events: list[Any], size: int) -> list[list[Any]]:
    return [events[i : i + size] for i in range(0, len(events), size)]


def _quiet_then_live(events: list[Any], switch: int) -> tuple[TranscriptBuilder, Page]:
    """A builder quiet for the first `switch` records of 5 events, then followed by a page that starts from its
    snapshot there (as a live tail attaches) and applies every update after."""
    builder = TranscriptBuilder("s")
    builder.live = False
    page = Page()
    records = _records(events, 5)
    for number, record in enumerate([*records, []]):  # a tail may attach after the last record too
        if number == min(switch, len(records)):
            builder.live = True
            page.apply([EntryUpdate(seq=e.last, entry=e) for e in builder.snapshot().entries])
        updates = builder.extend(record)
        assert builder.live or updates == []  # a quiet builder builds none
        page.apply(coalesce(updates))
    return builder, page


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_a_quiet_builder_keeps_the_transcript_a_live_one_keeps_on_every_fixture(path: Path) -> None:
    session = load_fixture(path)
    live = TranscriptBuilder("s")
    for event in session:
        live.add(event)
    events = list(session)
    builder, page = _quiet_then_live(events, len(events) // 10)  # a tail attaches a tenth of the way in
    assert builder.snapshot() == live.snapshot()
    assert builder.replaces == live.replaces == [e.seq for e in session if e.is_replace]
    assert page.normalized() == page_of(live.snapshot())


@given(generated_sessions())
def test_generated_sessions_built_quietly_then_followed_give_the_snapshot(generated: Any) -> None:
    events = list(generated.session)
    for switch in (0, 1, len(events) // 10):
        builder, page = _quiet_then_live(events, switch)
        snapshot = builder.snapshot()
        assert snapshot == build_transcript(generated.session, session_id="s")
        assert page.normalized() == page_of(snapshot)


def test_the_ui_state_builds_updates_only_while_its_session_is_watched() -> None:
    session = load_fixture(FIXTURES_DIR / "acp-agent-agent-instructions-session.jsonl")  # one with a compaction
    assert any(e.is_replace for e in session)
    raws = [e.raw for e in session]
    watched: dict[str, object] = {}
    state = UIState("s", None, watched)
    followed: list[Update] = []
    for number, chunk in enumerate(_records(raws, 5)):
        if number == 3:
            watched["s"] = object()  # a page starts tailing it
        state.apply(_record(number, chunk))
        if number < 3:
            assert state.updates == []
        followed.extend(state.updates)
        state.updates = []
    assert followed  # what a tail was sent after it attached
    assert followed[0].seq >= 15  # nothing from before it attached
    assert state.builder.snapshot() == build_transcript(session, session_id="s")
    assert state.replaces == [e.seq for e in session if e.is_replace]
    assert len(state.session) == len(session)


def _record(number: int, events: list[bytes]) -> Record:
    return Record(
        stream_seq=number + 1, subject="sessionlog.events.0.s", first_seq=number * 5, events=tuple(events),
        epoch=1, digest="", open_turn=0, payload_size=0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- compaction


def test_a_replacement_no_compaction_wrote_is_called_replaced_not_summarised() -> None:
    """Record mode logs a client's own history edit (a trimming, a rewrite, a summary it made) as the client's
    message in a replacement; the transcript cannot know it for a summary and says "replaced" (found probing record
    mode, 2026-12-05: an openai-agents trimming was shown as "summarised for the model")."""
    b = SessionBuilder()
    b.turn_start()
    first = b.user_message("Question one?")
    b.request_header()
    b.text_step("Answer one.")
    b.turn_end()
    b.turn_start()
    nodes = b.session.surface.nodes
    envelope = {"surfaceOp": {"op": "replace", "start": nodes[0], "end": nodes[-1]}, "sourceEventSeqs": list(nodes)}
    b.emit("user/message", user_message_data("Question two?", b.fresh_id("user"), {"kind": "user"}), **envelope)
    transcript = build_transcript(b.session)
    (marker,) = entries_of(transcript, CompactionEntry)
    assert not marker.summarised
    assert f"replaced for the model: events {first}-{nodes[-1]}" in transcript_plain(transcript)
    assert "summarised" not in transcript_plain(transcript)


def test_a_compaction_is_a_marker_and_the_messages_it_summarises_stay() -> None:
    b = SessionBuilder()
    b.turn_start()
    first = b.user_message("Read a.txt, please.")
    b.request_header()
    b.tool_step(["call-1"], text="Reading.")
    b.text_step("a.txt says hello.")
    b.turn_end()
    b.turn_start()
    nodes = b.session.surface.nodes
    summary = b.replace(nodes[0], nodes[-1], text="Earlier: the user asked for a.txt; it says hello.")
    b.user_message("Thanks. Now b.txt?")
    b.turn_end()
    before = len(b.session.derive_messages())
    transcript = build_transcript(b.session)
    (marker,) = entries_of(transcript, CompactionEntry)
    assert marker.seq == summary
    assert (marker.first, marker.through) == (first, nodes[-1])
    assert marker.summary[0].text.startswith("Earlier:")
    texts = [b.text for m in entries_of(transcript, MessageEntry) for b in m.blocks]
    assert "Read a.txt, please." in texts and "a.txt says hello." in texts and "Reading." in texts
    assert before == 2  # the model sees the summary and the new message; the page still shows everything
    assert f"summarised for the model: events {first}-{nodes[-1]}" in transcript_plain(transcript)
    # the marker comes where the compaction happened, after every message it summarises
    keys = [e.key for e in transcript.entries]
    assert keys.index(marker.key) > keys.index(f"e{first}")


def test_the_compacted_dsh_fixture_shows_its_marker_and_keeps_the_shadowed_message() -> None:
    session, header = fixture("acp-agent-agent-instructions-session.jsonl")
    transcript = build_transcript(session, header)
    (marker,) = entries_of(transcript, CompactionEntry)
    assert (marker.seq, marker.first, marker.through) == (17, 5, 5)
    assert any(m.seq == 5 for m in entries_of(transcript, MessageEntry))


# ---------------------------------------------------------------------------------------------- outcomes


def test_a_repaired_turn_shows_interrupted_says_the_lease_was_lost_and_marks_its_synthetic_results() -> None:
    session, header = fixture(
        "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl"
    )
    transcript = build_transcript(session, header)
    synthetic = [m for m in entries_of(transcript, MessageEntry) if m.synthetic]
    assert [(m.seq, m.synthetic) for m in synthetic] == [(5, "TOOL_OUTCOME_UNKNOWN")]
    ends = entries_of(transcript, TurnEndEntry)
    # The log knows only that the writer's lease lapsed (a crash, a blocked loop, a pause or a lost connection):
    # the transcript says that, and does not claim a crash.
    assert ends[0].outcome == "interrupted" and "lease was lost" in ends[0].detail
    assert "crashed" not in ends[0].detail
    assert entries_of(transcript, SeedEntry)[0].seq == 8


def test_our_own_closers_show_as_synthetic_results_of_both_kinds() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Write two files.")
    b.request_header()
    b.step_start()
    blocks = [tool_call_block("w1", "write"), tool_call_block("w2", "write")]
    b.assistant_message(blocks, source_seqs=b.stream(blocks))
    b.tool_call("w1", "write")
    session = b.session.copy()
    session.extend(interrupted_turn_closers(session))
    transcript = build_transcript(session)
    synthetic = {m.blocks[0].tool_call_id: m.synthetic for m in entries_of(transcript, MessageEntry) if m.synthetic}
    assert synthetic == {"w1": "TOOL_OUTCOME_UNKNOWN", "w2": "TOOL_NOT_STARTED"}
    assert entries_of(transcript, TurnEndEntry)[-1].outcome == "interrupted"


def test_a_cancelled_turn_shows_the_partial_answer_and_who_cancelled() -> None:
    transcript = build_transcript(*fixture("acp-agent-cancel-session.jsonl"))
    answer = [m for m in entries_of(transcript, MessageEntry) if m.role == "assistant"]
    assert answer[0].interrupted and answer[0].blocks[0].text == "partial"
    assert entries_of(transcript, TurnEndEntry)[0].outcome == "aborted"
    assert entries_of(transcript, TurnEndEntry)[0].detail == "cancelled by the user"
    assert not entries_of(transcript, StreamEntry)  # the message completed its stream


def test_a_provider_error_shows_the_failed_response_and_the_error_outcome() -> None:
    transcript = build_transcript(*fixture("acp-agent-error-finish-session.jsonl"))
    (failed,) = entries_of(transcript, StreamEntry)
    assert failed.state == "failed" and "HTTP 401" in (failed.error or "")
    end = entries_of(transcript, TurnEndEntry)[0]
    assert end.outcome == "error" and "[AUTH]" in end.detail


def test_a_retried_empty_response_shows_the_failed_attempt_the_retry_and_the_answer() -> None:
    transcript = build_transcript(*fixture("acp-agent-empty-response-retry-session.jsonl"))
    kinds = [(type(e).__name__, getattr(e, "state", None)) for e in transcript.entries]
    assert ("StreamEntry", "retried") in kinds
    (note,) = entries_of(transcript, NoteEntry)
    assert "retry 1 of 2 after EMPTY_RESPONSE" in note.text
    answer = [m for m in entries_of(transcript, MessageEntry) if m.role == "assistant"]
    assert answer[0].blocks[0].text == "Recovered."
    assert kinds.index(("StreamEntry", "retried")) < kinds.index(("NoteEntry", None))


def test_a_fork_names_its_parent_and_seed_boundary() -> None:
    session, header = fixture("acp-agent-subagent-mixed-session.2.jsonl")
    transcript = build_transcript(session, header)
    assert transcript.fork is not None and transcript.fork.parent
    (seed,) = entries_of(transcript, SeedEntry)
    assert seed.seq == 36


# ---------------------------------------------------------------------------------------------- streaming


def test_a_streaming_answer_is_a_stream_entry_until_its_message_replaces_it() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Say hello.")
    b.request_header()
    b.step_start()
    builder = TranscriptBuilder("s")
    builder.extend(b.session)
    seen = len(b.session)
    chunks = b.stream([text_block("Hello there."), tool_call_block("c1", "read", '{"path":"x"}')], pieces=lambda i: 3)
    updates = builder.extend(b.session[seq] for seq in range(seen, len(b.session)))
    first = updates[0]
    assert isinstance(first, EntryUpdate) and isinstance(first.entry, StreamEntry)
    stream_key = first.entry.key
    deltas = [u for u in updates if isinstance(u, DeltaUpdate)]
    assert "".join(d.text for d in deltas if d.index == 0) == "Hello there."
    assert "".join(d.text for d in deltas if d.index == 1) == '{"path":"x"}'
    streaming = builder.snapshot().entries[-1]
    assert isinstance(streaming, StreamEntry)
    assert (streaming.key, streaming.seq, streaming.last) == (stream_key, chunks[0], chunks[-1])
    assert (streaming.state, streaming.finish) == ("finished", "tool-calls")
    assert [(x.type, x.text, x.name) for x in streaming.blocks] == [
        ("text", "Hello there.", None),
        ("tool-call", '{"path":"x"}', "read"),
    ]
    message = b.assistant_message([text_block("Hello there."), tool_call_block("c1", "read", '{"path":"x"}')])
    (done,) = builder.add(b.session[message])
    assert isinstance(done, EntryUpdate) and isinstance(done.entry, MessageEntry)
    assert done.entry.replaces == stream_key
    assert not entries_of(builder.snapshot(), StreamEntry)


def test_a_step_that_ends_without_its_message_leaves_a_cut_stream() -> None:
    b = one_step(
        {"type": "block-start", "index": 0, "blockType": "text"}, {"type": "text-delta", "index": 0, "text": "Hel"}
    )
    b.step_end()
    b.turn_end({"kind": "aborted", "reason": {"kind": "user"}})
    (stream,) = entries_of(build_transcript(b.session), StreamEntry)
    assert stream.state == "cut" and stream.blocks[0].text == "Hel"


def test_coalesce_merges_deltas_and_keeps_only_the_last_version_of_an_entry() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Go.")
    b.request_header()
    b.step_start()
    b.stream([text_block("one two three four")], pieces=lambda i: 4)
    builder = TranscriptBuilder()
    updates = builder.extend(b.session)
    merged = coalesce(updates)
    assert len(merged) < len(updates)
    page_a, page_b = Page(), Page()
    page_a.apply(updates)
    page_b.apply(merged)
    assert page_a.normalized() == page_b.normalized() == page_of(builder.snapshot())


def test_a_stream_whose_block_end_differs_from_its_deltas_shows_what_the_auditor_assembles() -> None:
    # The transcript showed the deltas ("Hel") and the audit the block-end block ("Hello"): one rule now, the
    # block-end block once it exists (sessionlog.assembly), live and in the snapshot.
    b = one_step(
        {"type": "block-start", "index": 0, "blockType": "text"},
        {"type": "text-delta", "index": 0, "text": "Hel"},
        {"type": "block-end", "index": 0, "block": {"type": "text", "text": "Hello"}},
    )
    b.step_end()
    b.turn_end({"kind": "aborted", "reason": {"kind": "user"}})
    builder = TranscriptBuilder()
    page = Page()
    page.apply(builder.extend(b.session))
    (stream,) = entries_of(builder.snapshot(), StreamEntry)
    assert stream.blocks[0].text == "Hello" == audit_session(b.session).step_report(1, 1).text
    assert page.normalized() == page_of(builder.snapshot())


def test_a_stream_that_a_retry_splits_between_blocks_pages_as_its_snapshot() -> None:
    # After an llm/retry the next chunk (block 2) opens a new stream holding only that block: its deltas named chunk
    # index 2, which a page took as a third position while the snapshot lists the block first (Hypothesis found it).
    b = one_step(
        {"type": "block-start", "index": 0, "blockType": "text"},
        {"type": "text-delta", "index": 0, "text": "one"},
        {"type": "llm/retry"},
        {"type": "text-delta", "index": 2, "text": "two"},
        {"type": "reasoning-delta", "index": 1, "text": "hmm"},
        {"type": "text-delta", "index": 2, "text": " three"},
    )
    builder = TranscriptBuilder()
    page = Page()
    page.apply(builder.extend(b.session))
    assert page.normalized() == page_of(builder.snapshot())
    streams = entries_of(builder.snapshot(), StreamEntry)
    assert [[x.text for x in s.blocks] for s in streams] == [["one"], ["hmm", "two three"]]
