"""The rules of SPEC sections 4, 6 and 10, one behaviour at a time.

Every refusal is checked by `assert_refused`: the typed error carries the expected code, the seq and a message
naming the rule, `Session.check` refuses the same way, and the session is left exactly as it was.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sessiongen import (
    SessionBuilder,
    event_bytes,
    rewritten_result_data,
    text_block,
    tool_call_block,
    tool_result_data,
    user_message_data,
)

from sessionlog.errors import ERRORS_BY_CODE, SessionLogError
from sessionlog.events import MAX_EVENT_DEPTH, nests_deeper_than
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session, messages_canonical, messages_json

# ---------------------------------------------------------------------------------------------- helpers


def snapshot(session: Session) -> dict[str, Any]:
    """Everything a caller can observe about a session."""
    step = session.open_step
    derived = session.derive_messages()
    return {
        "len": len(session),
        "raw": tuple(e.raw for e in session),
        "nodes": session.surface.nodes,
        "generation": session.generation,
        "derived": messages_json(derived),
        "canonical": messages_canonical(derived),
        "header": session.fold_request_header(),
        "transcript": tuple(e.seq for e in session.transcript()),
        "open_turn": session.open_turn,
        "last_turn": session.last_turn,
        "last_step": session.last_step,
        "open_step": None
        if step is None
        else (step.number, dict(step.calls), frozenset(step.results), tuple(step.announced.values())),
        "closers": interrupted_turn_closers(session),
    }


def assert_refused(
    session: Session,
    event: bytes,
    code: str,
    *,
    seq: int | None = None,
    mentions: tuple[str, ...] = (),
) -> SessionLogError:
    """`event` is refused with `code` at `seq` (default: the log length), naming the rule, and nothing changed."""
    before = snapshot(session)
    with pytest.raises(SessionLogError) as checked:
        session.check(event)
    with pytest.raises(SessionLogError) as appended:
        session.append(event)
    err = appended.value
    assert err.code == code, f"expected {code}, got {err}"
    assert type(err) is ERRORS_BY_CODE[code]
    assert err.seq == (len(session) if seq is None else seq)
    assert str(err).startswith(f"{code} at seq {err.seq}: ")
    for word in mentions:
        assert word in err.message, f"{word!r} not in {err.message!r}"
    assert (checked.value.code, checked.value.seq, checked.value.message) == (err.code, err.seq, err.message)
    assert snapshot(session) == before
    return err


def ev(b: SessionBuilder, kind: str, data: Any, **envelope: Any) -> bytes:
    """The next event of `b`'s log (right seq and time) with the given type, data and envelope keys."""
    return event_bytes(b.next_seq, kind, data, time=b.time, **envelope)


def user_ev(b: SessionBuilder, text: str = "Hi", **envelope: Any) -> bytes:
    envelope.setdefault("surfaceOp", "append")
    return ev(b, "user/message", user_message_data(text, f"u-{b.next_seq}"), **envelope)


def summary_ev(b: SessionBuilder, start: int, end: int, sources: Any = None, **envelope: Any) -> bytes:
    """A compaction summary replacing `start`..`end`; `sources` defaults to the shadowed nodes."""
    if sources is None:
        nodes = b.session.surface.nodes
        sources = list(nodes[nodes.index(start) : nodes.index(end) + 1])
    return user_ev(
        b, "Summary.", surfaceOp={"op": "replace", "start": start, "end": end}, sourceEventSeqs=sources, **envelope
    )


def assistant_data(b: SessionBuilder, blocks: list[dict[str, Any]], *, turn: int = 0, step: int = 0) -> dict[str, Any]:
    return {
        "turn": turn or b.turn,
        "step": step or b.step,
        "message": {"id": f"a-{b.next_seq}", "role": "assistant", "content": blocks, "source": {"kind": "model"}},
    }


def chunk_data(turn: int, step: int) -> dict[str, Any]:
    return {"turn": turn, "step": step, "chunk": {"type": "text-delta", "index": 0, "text": "x"}}


def tool_pair_turn(call_ids: tuple[str, ...] = ("call-a",)) -> tuple[SessionBuilder, dict[str, int]]:
    """Turn 1 open: user message (seq 1), header, step 1 announcing, calling and answering `call_ids`; no step open."""
    b = SessionBuilder()
    b.turn_start()
    user = b.user_message("Read a.txt")
    b.request_header(system="You are careful.")
    seqs = b.tool_step(call_ids, text="Reading.")
    return b, {"user": user, **seqs}


def open_step() -> SessionBuilder:
    """Turn 1, step 1 open, one user message on the surface."""
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hello")
    b.step_start()
    return b


# ---------------------------------------------------------------------------------------------- INVALID_EVENT


@pytest.mark.parametrize(
    ("data", "mentions"),
    [
        pytest.param({}, ("missing required field `turn`",), id="missing-field"),
        pytest.param({"turn": "2"}, ("Expected `int`", "$.data.turn"), id="mistyped-field"),
        pytest.param({"turn": 0}, ("$.data.turn",), id="turn-below-one"),
    ],
)
def test_a_turn_start_that_does_not_match_its_schema_is_refused_and_changes_nothing(
    data: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    b, _ = tool_pair_turn()
    b.turn_end()
    assert_refused(b.session, ev(b, "turn/start", data), "INVALID_EVENT", mentions=("turn/start", *mentions))


def test_an_unknown_envelope_key_is_refused_and_changes_nothing() -> None:
    b = open_step()
    raw = user_ev(b, comment="not an envelope key")
    assert_refused(b.session, raw, "INVALID_EVENT", mentions=("envelope", "comment"))


@pytest.mark.parametrize(
    ("raw", "mentions"),
    [
        pytest.param(b"[1, 2]", ("envelope", "array"), id="array"),
        pytest.param(b'"turn/start"', ("envelope", "str"), id="string"),
        pytest.param(b"null", ("envelope",), id="null"),
        pytest.param(b'{"seq": 3, "type": "turn/st', ("not a JSON object",), id="truncated-json"),
        pytest.param(b'{"seq": 3, "data": {}}', ("envelope", "type"), id="no-type"),
    ],
)
def test_bytes_that_are_not_an_event_object_are_refused_at_their_position(
    raw: bytes, mentions: tuple[str, ...]
) -> None:
    b = open_step()
    assert_refused(b.session, raw, "INVALID_EVENT", mentions=mentions)


def test_a_core_event_without_data_is_refused() -> None:
    b = open_step()
    raw = b'{"seq":%d,"type":"step/end"}' % b.next_seq
    assert_refused(b.session, raw, "INVALID_EVENT", mentions=("step/end", "`data`"))


def test_a_plugin_event_whose_data_is_not_an_object_is_refused() -> None:
    b = open_step()
    assert_refused(b.session, ev(b, "session/title", "A title"), "INVALID_EVENT", mentions=("session/title", "object"))


def test_a_message_with_an_unknown_block_type_is_refused() -> None:
    b = open_step()
    data = user_message_data("x", "u-9")
    data["content"] = [{"type": "video", "url": "https://example.test/v"}]
    assert_refused(b.session, ev(b, "user/message", data, surfaceOp="append"), "INVALID_EVENT", mentions=("content",))


def test_a_tool_call_block_missing_its_arguments_is_refused() -> None:
    b = open_step()
    block = tool_call_block("call-x")
    del block["arguments"]
    raw = ev(b, "assistant/message", assistant_data(b, [block]), surfaceOp="append")
    assert_refused(b.session, raw, "INVALID_EVENT", mentions=("arguments",))


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(
            [
                {"type": "tool-result", "toolCallId": "call-a", "content": []},
                {"type": "tool-result", "toolCallId": "call-a", "content": []},
            ],
            id="two-result-blocks",
        ),
        pytest.param(
            [{"type": "tool-result", "toolCallId": "call-a", "content": []}, text_block("and text")],
            id="result-and-text",
        ),
        pytest.param([text_block("just text")], id="text-only"),
        pytest.param([], id="empty"),
    ],
)
def test_a_tool_result_must_hold_exactly_one_tool_result_block(content: list[dict[str, Any]]) -> None:
    b = open_step()
    b.tool_call("call-a")
    data = tool_result_data(1, 1, "call-a")
    data["message"]["content"] = content
    raw = ev(b, "tool/result", data, surfaceOp="append")
    assert_refused(b.session, raw, "INVALID_EVENT", mentions=("exactly one tool-result block",))


@pytest.mark.parametrize("role", ["assistant", "system", "tool"])
def test_a_user_message_whose_role_is_not_user_is_refused(role: str) -> None:
    b = open_step()
    data = user_message_data("x", "u-9")
    data["role"] = role
    assert_refused(b.session, ev(b, "user/message", data, surfaceOp="append"), "INVALID_EVENT", mentions=("role",))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"seq":%d,"type":"vendor/x","type":"step/end","data":{"turn":1,"step":1}}', id="type-twice"),
        pytest.param(b'{"seq":%d,"type":"step/end","data":{"turn":"1"},"data":{"turn":1,"step":1}}', id="data-twice"),
    ],
)
def test_an_envelope_with_a_duplicated_key_is_refused_as_invalid(raw: bytes) -> None:
    b = open_step()
    assert_refused(b.session, raw % b.next_seq, "INVALID_EVENT")


# ---------------------------------------------------------------------------------------------- UNKNOWN_EVENT_TYPE


def test_an_unknown_type_without_ignorable_is_refused_naming_the_type_and_seq() -> None:
    b = open_step()
    err = assert_refused(
        b.session, ev(b, "vendor/mystery", {"x": 1}), "UNKNOWN_EVENT_TYPE", mentions=("vendor/mystery",)
    )
    assert "ignorable" in err.message
    assert f"at seq {len(b.session)}" in str(err)


@pytest.mark.parametrize("ignorable", [False, "true", 1])
def test_an_unknown_type_whose_ignorable_is_not_exactly_true_is_refused(ignorable: Any) -> None:
    b = open_step()
    raw = ev(b, "vendor/mystery", {"x": 1}, ignorable=ignorable)
    assert_refused(b.session, raw, "UNKNOWN_EVENT_TYPE" if ignorable is False else "INVALID_EVENT")


def test_an_unknown_type_marked_ignorable_is_kept_byte_for_byte_and_never_model_visible() -> None:
    b = open_step()
    before = messages_json(b.session.derive_messages())
    raw = (
        b'{ "time": 5, "seq": %d, "type": "vendor/mystery", "ignorable": true,\n'
        b'  "data": {"z": [3, 2, 1], "a": {"\\u00e9": null}, "unicode": "\xc3\xa9"} }' % b.next_seq
    )
    event = b.session.append(raw)
    assert event.raw == raw
    assert b.session[event.seq].raw == raw
    assert event.ignorable
    assert event.seq not in b.session.surface
    assert event not in b.session.transcript()
    assert messages_json(b.session.derive_messages()) == before


@pytest.mark.parametrize("kind", ["session/title", "compaction/summary", "tool-workflow/agent-end", "team/handoff"])
def test_a_plugin_event_is_kept_byte_for_byte_and_never_model_visible(kind: str) -> None:
    b = open_step()
    before = snapshot(b.session)
    raw = b'{"seq":%d,"type":"%s","data":{"b":2,"a":1,"extra":{"deep":[1]}}}' % (b.next_seq, kind.encode())
    event = b.session.append(raw)
    assert event.raw == raw
    assert b.session.surface.nodes == before["nodes"]
    assert messages_json(b.session.derive_messages()) == before["derived"]


# ---------------------------------------------------------------------------------------------- SEQ_NOT_CONTIGUOUS


@pytest.mark.parametrize("offset", [1, 5, -1, -4], ids=["gap", "wide-gap", "reuse", "reuse-older"])
def test_an_event_whose_seq_is_not_the_log_length_is_refused(offset: int) -> None:
    b = open_step()
    claimed = b.next_seq + offset
    raw = event_bytes(claimed, "assistant/chunk", chunk_data(1, 1))
    assert_refused(b.session, raw, "SEQ_NOT_CONTIGUOUS", seq=claimed, mentions=(f"seq {claimed}", "log length"))


def test_the_first_event_must_have_seq_zero() -> None:
    assert_refused(Session(), event_bytes(1, "turn/start", {"turn": 1}), "SEQ_NOT_CONTIGUOUS", seq=1)


def test_an_event_without_seq_is_refused_in_a_log_whose_events_carry_seqs() -> None:
    b = open_step()
    raw = b'{"type":"assistant/chunk","data":%s}' % msgspec.json.encode(chunk_data(1, 1))
    assert_refused(b.session, raw, "SEQ_NOT_CONTIGUOUS")


# ---------------------------------------------------------------------------------------------- surface markers


@pytest.mark.parametrize("kind", ["user/message", "assistant/message", "tool/result"])
def test_a_surface_event_without_surface_op_is_refused(kind: str) -> None:
    b = open_step()
    b.tool_call("call-a")
    data: Any = {
        "user/message": user_message_data("x", "u-9"),
        "assistant/message": assistant_data(b, [text_block("x")]),
        "tool/result": tool_result_data(1, 1, "call-a"),
    }[kind]
    raw = ev(b, kind, data, sourceEventSeqs=[3])
    assert_refused(b.session, raw, "SURFACE_MARKER_REQUIRED", mentions=(kind, "surfaceOp"))


@pytest.mark.parametrize(
    ("kind", "data", "envelope", "marker"),
    [
        pytest.param("turn/start", {"turn": 2}, {"surfaceOp": "append"}, "surfaceOp", id="surfaceOp-on-turn-start"),
        pytest.param(
            "tool/call",
            {"turn": 2, "step": 1, "callId": "c", "name": "read", "arguments": "{}"},
            {"sourceEventSeqs": [1]},
            "sourceEventSeqs",
            id="sourceEventSeqs-on-tool-call",
        ),
        pytest.param("session/title", {"title": "t"}, {"surfaceOp": "append"}, "surfaceOp", id="surfaceOp-on-plugin"),
        pytest.param(
            "assistant/chunk", chunk_data(2, 1), {"sourceEventSeqs": [1]}, "sourceEventSeqs", id="provenance-on-chunk"
        ),
        pytest.param(
            "vendor/x", {}, {"ignorable": True, "surfaceOp": "append"}, "surfaceOp", id="surfaceOp-on-ignorable"
        ),
    ],
)
def test_a_non_surface_event_carrying_a_surface_marker_is_refused(
    kind: str, data: dict[str, Any], envelope: dict[str, Any], marker: str
) -> None:
    b, _ = tool_pair_turn()
    b.turn_end()
    if kind != "turn/start":
        b.turn_start()
        b.step_start()
    assert_refused(b.session, ev(b, kind, data, **envelope), "SURFACE_MARKER_FORBIDDEN", mentions=(kind, marker))


# ---------------------------------------------------------------------------------------------- INVALID_SURFACE_OP


@pytest.mark.parametrize(
    "op",
    [
        pytest.param("prepend", id="prepend"),
        pytest.param("Append", id="wrong-case"),
        pytest.param(None, id="null"),
        pytest.param(1, id="number"),
        pytest.param(["append"], id="array"),
        pytest.param({"op": "replace", "start": 1}, id="no-end"),
        pytest.param({"op": "replace", "end": 1}, id="no-start"),
        pytest.param({"start": 1, "end": 1}, id="no-op"),
        pytest.param({"op": "replace", "start": 1, "end": 1, "reason": "compact"}, id="extra-key"),
        pytest.param({"op": "delete", "start": 1, "end": 1}, id="other-op"),
        pytest.param({"op": "replace", "start": -1, "end": 1}, id="negative-start"),
        pytest.param({"op": "replace", "start": 1, "end": -1}, id="negative-end"),
        pytest.param({"op": "replace", "start": True, "end": 1}, id="bool-start"),
        pytest.param({"op": "replace", "start": 1, "end": False}, id="bool-end"),
        pytest.param({"op": "replace", "start": 1.0, "end": 1}, id="float"),
        pytest.param({"op": "replace", "start": "1", "end": "1"}, id="strings"),
    ],
)
def test_a_surface_op_that_is_neither_append_nor_an_exact_replace_is_refused(op: Any) -> None:
    b, _ = tool_pair_turn()
    raw = user_ev(b, surfaceOp=op, sourceEventSeqs=[1])
    assert_refused(b.session, raw, "INVALID_SURFACE_OP", mentions=("surfaceOp must be",))


# ---------------------------------------------------------------------------------------------- replace ranges


@pytest.mark.parametrize("which", ["start", "end"])
@pytest.mark.parametrize("what", ["turn/start", "chunk", "tool/call", "past-the-log"])
def test_a_replace_naming_a_seq_that_is_not_a_surface_node_is_refused(which: str, what: str) -> None:
    b, seqs = tool_pair_turn()
    missing = {"turn/start": 0, "chunk": seqs["message"] - 1, "tool/call": seqs["call:call-a"], "past-the-log": 999}[
        what
    ]
    bounds = {"start": seqs["user"], "end": seqs["result:call-a"], which: missing}
    raw = summary_ev(b, bounds["start"], bounds["end"], sources=[seqs["user"], seqs["message"], seqs["result:call-a"]])
    assert_refused(b.session, raw, "REPLACE_RANGE_NOT_FOUND", mentions=(f"{which} seq {missing} not found in surface",))


def test_a_replace_naming_a_node_an_earlier_replace_shadowed_is_refused() -> None:
    b, seqs = tool_pair_turn()
    summary = b.replace(seqs["user"], seqs["result:call-a"])
    assert b.session.surface.nodes == (summary,)
    # The user message is still in the log, but no longer a surface node: a replace cannot name it.
    raw = summary_ev(b, seqs["user"], summary, sources=[seqs["user"], summary])
    assert_refused(b.session, raw, "REPLACE_RANGE_NOT_FOUND", mentions=(f"start seq {seqs['user']} not found",))
    raw = summary_ev(b, summary, seqs["message"], sources=[summary, seqs["message"]])
    assert_refused(b.session, raw, "REPLACE_RANGE_NOT_FOUND", mentions=(f"end seq {seqs['message']} not found",))


def test_a_replace_whose_start_comes_after_its_end_is_refused() -> None:
    b, seqs = tool_pair_turn()
    raw = summary_ev(b, seqs["result:call-a"], seqs["user"], sources=[seqs["user"], seqs["message"]])
    assert_refused(b.session, raw, "REPLACE_RANGE_INVERTED", mentions=("comes after",))


def test_replace_order_is_surface_order_not_seq_order() -> None:
    b, seqs = tool_pair_turn()
    summary = b.replace(seqs["user"], seqs["user"])  # a high seq now stands first on the surface
    assert b.session.surface.nodes == (summary, seqs["message"], seqs["result:call-a"])
    raw = summary_ev(b, seqs["message"], summary, sources=[summary, seqs["message"]])
    assert_refused(b.session, raw, "REPLACE_RANGE_INVERTED")
    outer = b.replace(summary, seqs["result:call-a"])
    assert b.session.surface.nodes == (outer,)


# ---------------------------------------------------------------------------------------------- PROVENANCE_INVALID


@pytest.mark.parametrize(
    ("sources", "mentions"),
    [
        pytest.param(3, ("must be an array",), id="number"),
        pytest.param("1", ("must be an array",), id="string"),
        pytest.param({"seq": 1}, ("must be an array",), id="object"),
        pytest.param(None, ("must be an array",), id="null"),
        pytest.param(["1"], ("non-negative integers",), id="string-member"),
        pytest.param([1.0], ("non-negative integers",), id="float-member"),
        pytest.param([True], ("non-negative integers",), id="bool-member"),
        pytest.param([-1], ("non-negative integers",), id="negative-member"),
        pytest.param([1, 9, 1], ("seq 1 twice",), id="duplicate"),
    ],
)
def test_malformed_provenance_is_refused(sources: Any, mentions: tuple[str, ...]) -> None:
    b, _ = tool_pair_turn()
    assert_refused(b.session, user_ev(b, sourceEventSeqs=sources), "PROVENANCE_INVALID", mentions=mentions)


@pytest.mark.parametrize("ahead", [0, 1, 50])
def test_provenance_naming_the_event_itself_or_a_later_seq_is_refused(ahead: int) -> None:
    b, _ = tool_pair_turn()
    raw = user_ev(b, sourceEventSeqs=[1, b.next_seq + ahead])
    assert_refused(b.session, raw, "PROVENANCE_INVALID", mentions=("not earlier than the event",))


@pytest.mark.parametrize("replace", [False, True])
def test_empty_provenance_is_refused_on_a_user_message(replace: bool) -> None:
    b, seqs = tool_pair_turn()
    op: Any = {"op": "replace", "start": seqs["user"], "end": seqs["user"]} if replace else "append"
    raw = user_ev(b, surfaceOp=op, sourceEventSeqs=[])
    assert_refused(b.session, raw, "PROVENANCE_INVALID", mentions=("must not be empty",))


def test_empty_provenance_is_refused_on_a_tool_result() -> None:
    b = open_step()
    b.tool_call("call-a")
    raw = ev(b, "tool/result", tool_result_data(1, 1, "call-a"), surfaceOp="append", sourceEventSeqs=[])
    assert_refused(b.session, raw, "PROVENANCE_INVALID", mentions=("must not be empty",))


def test_empty_provenance_is_allowed_on_an_assistant_message() -> None:
    b = open_step()
    event = b.session.append(
        ev(b, "assistant/message", assistant_data(b, [text_block("hi")]), surfaceOp="append", sourceEventSeqs=[])
    )
    assert event.source_event_seqs == []
    assert b.session.surface.nodes[-1] == event.seq


# ---------------------------------------------------------------------------------------------- PROVENANCE_INCOMPLETE


def test_a_replace_that_misses_a_shadowed_node_is_refused_and_changes_nothing() -> None:
    b, seqs = tool_pair_turn()
    raw = summary_ev(b, seqs["user"], seqs["result:call-a"], sources=[seqs["user"], 3, 4])
    err = assert_refused(b.session, raw, "PROVENANCE_INCOMPLETE")
    assert f"missing [{seqs['message']}, {seqs['result:call-a']}]" in err.message


def test_a_replace_without_provenance_is_refused_listing_every_shadowed_node() -> None:
    b, seqs = tool_pair_turn()
    raw = user_ev(b, surfaceOp={"op": "replace", "start": seqs["user"], "end": seqs["result:call-a"]})
    err = assert_refused(b.session, raw, "PROVENANCE_INCOMPLETE")
    assert f"missing [{seqs['user']}, {seqs['message']}, {seqs['result:call-a']}]" in err.message


def test_a_nested_compaction_must_name_the_earlier_summary_not_only_its_originals() -> None:
    b, seqs = tool_pair_turn()
    inner = b.replace(seqs["user"], seqs["user"])
    raw = summary_ev(b, inner, seqs["result:call-a"], sources=[seqs["user"], seqs["message"], seqs["result:call-a"]])
    err = assert_refused(b.session, raw, "PROVENANCE_INCOMPLETE")
    assert f"missing [{inner}]" in err.message


# ------------------------------------------------------------------------------------- TOOL_RESULT_REPLACE_INVALID


def _rewrite_ev(b: SessionBuilder, target: int, data: dict[str, Any], *, end: int | None = None) -> bytes:
    end = target if end is None else end
    nodes = b.session.surface.nodes
    sources = list(nodes[nodes.index(target) : nodes.index(end) + 1])
    return ev(b, "tool/result", data, surfaceOp={"op": "replace", "start": target, "end": end}, sourceEventSeqs=sources)


def test_a_tool_result_replace_spanning_two_nodes_is_refused() -> None:
    b, seqs = tool_pair_turn(("call-a", "call-b"))
    first, second = seqs["result:call-a"], seqs["result:call-b"]
    raw = _rewrite_ev(b, first, rewritten_result_data(b.session, first, "both"), end=second)
    assert_refused(b.session, raw, "TOOL_RESULT_REPLACE_INVALID", mentions=("exactly one node", "got 2"))


@pytest.mark.parametrize("target", ["user", "message"])
def test_a_tool_result_replace_targeting_another_type_is_refused(target: str) -> None:
    b, seqs = tool_pair_turn()
    data = rewritten_result_data(b.session, seqs["result:call-a"], "x")
    raw = _rewrite_ev(b, seqs[target], data)
    assert_refused(b.session, raw, "TOOL_RESULT_REPLACE_INVALID", mentions=("must target a tool/result node",))


def _change_call_id(data: dict[str, Any]) -> None:
    data["message"]["content"][0]["toolCallId"] = "call-z"


def _change_is_error(data: dict[str, Any]) -> None:
    data["message"]["content"][0]["isError"] = True


def _change_error(data: dict[str, Any]) -> None:
    data["error"] = {"name": "ToolError", "code": "E_TOOL"}


def _change_meta(data: dict[str, Any]) -> None:
    data["meta"] = {"truncated": True}


def _change_turn(data: dict[str, Any]) -> None:
    data["turn"] = 2


def _change_step(data: dict[str, Any]) -> None:
    data["step"] = 2


def _change_message_id(data: dict[str, Any]) -> None:
    data["message"]["id"] = "another-id"


def _change_source(data: dict[str, Any]) -> None:
    data["message"]["source"] = {"kind": "plugin", "plugin": "prune"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (_change_call_id, "message"),
        (_change_is_error, "message"),
        (_change_error, "error"),
        (_change_meta, "meta"),
        (_change_turn, "turn"),
        (_change_step, "step"),
        (_change_message_id, "message"),
        (_change_source, "message"),
    ],
    ids=lambda v: v.__name__.removeprefix("_change_") if callable(v) else v,
)
def test_a_tool_result_replace_that_changes_more_than_content_is_refused(change: Any, field: str) -> None:
    b, seqs = tool_pair_turn()
    b.step_start()
    target = seqs["result:call-a"]
    data = rewritten_result_data(b.session, target, "[pruned]")
    change(data)
    err = assert_refused(b.session, _rewrite_ev(b, target, data), "TOOL_RESULT_REPLACE_INVALID")
    assert "may change only the content" in err.message
    assert f"'{field}'" in err.message


def test_a_tool_result_content_rewrite_is_accepted_and_keeps_the_transcript() -> None:
    b, seqs = tool_pair_turn()
    target = seqs["result:call-a"]
    transcript = b.session.transcript()
    rewrite = b.rewrite_result(target, "[output pruned]")
    assert b.session.generation == 1
    assert b.session.surface.nodes == (seqs["user"], seqs["message"], rewrite)
    derived = b.session.derive_messages()
    assert derived[-1].seq == rewrite
    assert b"[output pruned]" in derived[-1].raw
    assert b.session.transcript() == transcript
    # A second rewrite targets the current node: the first rewrite.
    again = b.rewrite_result(rewrite, "")
    assert b.session.surface.nodes[-1] == again
    assert_refused(b.session, _stale(b, target), "REPLACE_RANGE_NOT_FOUND", mentions=(f"start seq {target} not found",))


def _stale(b: SessionBuilder, target: int) -> bytes:
    """A rewrite naming `target` directly (it has been rewritten, so it is no longer a node)."""
    data = rewritten_result_data(b.session, target, "x")
    return ev(
        b, "tool/result", data, surfaceOp={"op": "replace", "start": target, "end": target}, sourceEventSeqs=[target]
    )


# ---------------------------------------------------------------------------------------- REPLACE_SPLITS_TOOL_PAIR


def test_shadowing_a_tool_call_but_not_its_result_is_refused() -> None:
    b, seqs = tool_pair_turn()
    raw = summary_ev(b, seqs["user"], seqs["message"])
    assert_refused(b.session, raw, "REPLACE_SPLITS_TOOL_PAIR", mentions=("'call-a'", "but not its result"))


def test_shadowing_a_tool_result_but_not_its_call_is_refused() -> None:
    b, seqs = tool_pair_turn()
    raw = summary_ev(b, seqs["result:call-a"], seqs["result:call-a"])
    assert_refused(b.session, raw, "REPLACE_SPLITS_TOOL_PAIR", mentions=("'call-a'", "but not the call"))


def test_shadowing_one_of_two_parallel_results_with_their_call_message_is_refused() -> None:
    b, seqs = tool_pair_turn(("call-a", "call-b"))
    raw = summary_ev(b, seqs["message"], seqs["result:call-a"])
    assert_refused(b.session, raw, "REPLACE_SPLITS_TOOL_PAIR", mentions=("'call-b'",))


def test_shadowing_a_tool_call_together_with_its_result_is_accepted() -> None:
    b, seqs = tool_pair_turn(("call-a", "call-b"))
    summary = b.replace(seqs["message"], seqs["result:call-b"])
    assert b.session.surface.nodes == (seqs["user"], summary)
    assert b.session.generation == 1


def test_a_summary_that_announces_a_call_whose_result_it_shadows_is_refused() -> None:
    b, seqs = tool_pair_turn()
    data = assistant_data(b, [tool_call_block("call-a")], step=1)
    sources = [seqs["message"], seqs["result:call-a"]]
    op = {"op": "replace", "start": seqs["message"], "end": seqs["result:call-a"]}
    raw = ev(b, "assistant/message", data, surfaceOp=op, sourceEventSeqs=sources)
    assert_refused(b.session, raw, "REPLACE_SPLITS_TOOL_PAIR", mentions=("announces tool call 'call-a'",))


def test_a_call_id_reused_in_a_later_turn_does_not_block_compacting_the_earlier_pair() -> None:
    b, first = tool_pair_turn(("call-0",))
    b.turn_end()
    b.turn_start()
    b.user_message("Again")
    second = b.tool_step(["call-0"])  # providers such as local servers number calls per response
    assert second["message"] != first["message"]
    summary = b.replace(first["user"], first["result:call-0"])  # the whole first turn, pair included
    assert b.session.surface.nodes[0] == summary


# ---------------------------------------------------------------------------------------------- STRUCTURE_INVALID


def test_a_turn_start_inside_an_open_turn_is_refused() -> None:
    b = open_step()
    b.step_end()
    assert_refused(b.session, ev(b, "turn/start", {"turn": 2}), "STRUCTURE_INVALID", mentions=("turn 1 is open",))


@pytest.mark.parametrize("turn", [1, 3, 7])
def test_turn_numbers_rise_by_one(turn: int) -> None:
    b, _ = tool_pair_turn()
    b.turn_end()
    assert_refused(b.session, ev(b, "turn/start", {"turn": turn}), "STRUCTURE_INVALID", mentions=("expected turn 2",))


def test_the_first_turn_is_turn_one() -> None:
    s = Session()
    assert_refused(s, event_bytes(0, "turn/start", {"turn": 2}), "STRUCTURE_INVALID", mentions=("expected turn 1",))


@pytest.mark.parametrize("step", [2, 3])
def test_a_turns_first_step_is_step_one(step: int) -> None:
    b = SessionBuilder()
    b.turn_start()
    raw = ev(b, "step/start", {"turn": 1, "step": step})
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("expected step 1",))


def test_step_numbers_rise_by_one_and_restart_in_each_turn() -> None:
    b, _ = tool_pair_turn()
    assert_refused(b.session, ev(b, "step/start", {"turn": 1, "step": 3}), "STRUCTURE_INVALID", mentions=("step 2",))
    b.text_step()
    b.turn_end()
    b.turn_start()
    assert_refused(b.session, ev(b, "step/start", {"turn": 2, "step": 3}), "STRUCTURE_INVALID", mentions=("step 1",))
    b.session.append(ev(b, "step/start", {"turn": 2, "step": 1}))
    assert b.session.open_step is not None and b.session.open_step.number == 1


def test_a_step_start_inside_an_open_step_is_refused() -> None:
    b = open_step()
    raw = ev(b, "step/start", {"turn": 1, "step": 2})
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("step 1 is open",))


def test_a_step_outside_a_turn_is_refused() -> None:
    b, _ = tool_pair_turn()
    b.turn_end()
    raw = ev(b, "step/start", {"turn": 1, "step": 2})
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("no turn is open",))


def test_a_turn_end_while_a_step_is_open_or_naming_another_turn_is_refused() -> None:
    b = open_step()
    completed = {"kind": "completed"}
    assert_refused(
        b.session, ev(b, "turn/end", {"turn": 1, "reason": completed}), "STRUCTURE_INVALID", mentions=("step 1",)
    )
    b.step_end()
    assert_refused(
        b.session, ev(b, "turn/end", {"turn": 2, "reason": completed}), "STRUCTURE_INVALID", mentions=("turn 2",)
    )
    b.turn_end()
    assert_refused(
        b.session, ev(b, "turn/end", {"turn": 1, "reason": completed}), "STRUCTURE_INVALID", mentions=("no turn",)
    )
    assert_refused(b.session, ev(b, "step/end", {"turn": 1, "step": 1}), "STRUCTURE_INVALID")


@pytest.mark.parametrize(
    "kind",
    ["assistant/chunk", "assistant/message", "tool/call", "tool/result"],
)
@pytest.mark.parametrize(
    ("turn", "step", "mentions"),
    [
        pytest.param(2, 1, "turn 1 is open", id="wrong-turn"),
        pytest.param(1, 2, "step 1 is open", id="wrong-step"),
    ],
)
def test_a_step_scoped_event_naming_another_turn_or_step_is_refused(
    kind: str, turn: int, step: int, mentions: str
) -> None:
    b = open_step()
    b.tool_call("call-a")
    data: Any = {
        "assistant/chunk": chunk_data(turn, step),
        "assistant/message": assistant_data(b, [text_block("x")], turn=turn, step=step),
        "tool/call": {"turn": turn, "step": step, "callId": "call-b", "name": "read", "arguments": "{}"},
        "tool/result": tool_result_data(turn, step, "call-a"),
    }[kind]
    envelope = {} if kind in ("assistant/chunk", "tool/call") else {"surfaceOp": "append"}
    assert_refused(b.session, ev(b, kind, data, **envelope), "STRUCTURE_INVALID", mentions=(kind, mentions))


@pytest.mark.parametrize("kind", ["assistant/chunk", "assistant/message", "tool/call"])
def test_a_step_scoped_event_outside_a_step_is_refused(kind: str) -> None:
    b, _ = tool_pair_turn()
    data: Any = {
        "assistant/chunk": chunk_data(1, 1),
        "assistant/message": assistant_data(b, [text_block("x")], step=1),
        "tool/call": {"turn": 1, "step": 1, "callId": "call-b", "name": "read", "arguments": "{}"},
    }[kind]
    envelope = {"surfaceOp": "append"} if kind == "assistant/message" else {}
    assert_refused(b.session, ev(b, kind, data, **envelope), "STRUCTURE_INVALID", mentions=("no step",))


def test_a_tool_result_without_a_tool_call_in_the_same_step_is_refused() -> None:
    b, seqs = tool_pair_turn()
    b.step_start()  # call-a was called in step 1; this is step 2
    raw = ev(
        b, "tool/result", tool_result_data(1, 2, "call-a"), surfaceOp="append", sourceEventSeqs=[seqs["call:call-a"]]
    )
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("no earlier tool/call",))
    raw = ev(b, "tool/result", tool_result_data(1, 2, "call-new"), surfaceOp="append")
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("'call-new'",))


def test_a_second_result_for_the_same_call_in_a_step_is_refused() -> None:
    b = open_step()
    b.tool_call("call-a")
    b.tool_result("call-a")
    raw = ev(b, "tool/result", tool_result_data(1, 1, "call-a", "again"), surfaceOp="append")
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("already recorded",))


def test_a_synthetic_not_started_result_needs_no_tool_call() -> None:
    b = open_step()
    blocks = [tool_call_block("call-never")]
    b.assistant_message(blocks, source_seqs=b.stream(blocks))
    seq = b.not_started_result("call-never")
    assert b.session.surface.nodes[-1] == seq
    # Any other error code still needs the call.
    b.assistant_message([tool_call_block("call-other")], source_seqs=[])
    data = tool_result_data(1, 1, "call-other", is_error=True, error={"name": "X", "code": "TOOL_OUTCOME_UNKNOWN"})
    assert_refused(b.session, ev(b, "tool/result", data, surfaceOp="append"), "STRUCTURE_INVALID")


def test_a_compaction_rewriting_an_earlier_steps_result_in_a_later_step_is_accepted() -> None:
    b, seqs = tool_pair_turn()
    b.step_start()  # step 2 open; the rewrite still says step 1, as the result it rewrites does
    rewrite = b.rewrite_result(seqs["result:call-a"])
    assert b.session[rewrite].data.step == 1
    b.step_end()
    summary = b.replace(seqs["user"], rewrite, kind="assistant/message")  # between steps: only the turn is open
    assert b.session.surface.nodes == (summary,)


@pytest.mark.parametrize("kind", ["user/message", "tool/result"])
def test_a_replace_outside_a_turn_is_refused(kind: str) -> None:
    b, seqs = tool_pair_turn()
    b.turn_end()
    if kind == "user/message":
        raw = summary_ev(b, seqs["user"], seqs["result:call-a"])
    else:
        raw = _stale(b, seqs["result:call-a"])
    assert_refused(b.session, raw, "STRUCTURE_INVALID", mentions=("outside a turn",))


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        ("request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"}),
        ("request/context", {"provider": "p", "model": "m"}),
        ("todo/write", {"todos": [{"content": "x", "status": "pending"}]}),
    ],
)
def test_turn_scoped_events_are_refused_outside_a_turn(kind: str, data: dict[str, Any]) -> None:
    s = Session()
    assert_refused(s, event_bytes(0, kind, data), "STRUCTURE_INVALID", mentions=(kind, "inside a turn"))
    b, _ = tool_pair_turn()
    b.turn_end()
    assert_refused(b.session, ev(b, kind, data), "STRUCTURE_INVALID", mentions=("inside a turn",))
    b.turn_start()
    b.session.append(ev(b, kind, data))


# ---------------------------------------------------------------------------------------------- order of checks


def test_decoding_comes_before_contiguity() -> None:
    b = open_step()
    assert_refused(b.session, event_bytes(99, "turn/start", {"turn": "x"}), "INVALID_EVENT", seq=99)
    assert_refused(b.session, event_bytes(99, "vendor/mystery", {}), "UNKNOWN_EVENT_TYPE", seq=99)


def test_a_bad_seq_is_reported_before_a_missing_surface_op() -> None:
    b = open_step()
    raw = event_bytes(b.next_seq + 1, "user/message", user_message_data("x", "u"))
    assert_refused(b.session, raw, "SEQ_NOT_CONTIGUOUS", seq=b.next_seq + 1)


def test_a_forbidden_marker_is_reported_before_a_structure_error() -> None:
    b = open_step()
    raw = ev(b, "turn/start", {"turn": 2}, surfaceOp="append")  # also nested
    assert_refused(b.session, raw, "SURFACE_MARKER_FORBIDDEN")


def test_a_bad_surface_op_is_reported_before_bad_provenance() -> None:
    b = open_step()
    assert_refused(b.session, user_ev(b, surfaceOp="prepend", sourceEventSeqs="x"), "INVALID_SURFACE_OP")


def test_a_missing_range_is_reported_before_bad_provenance() -> None:
    b = open_step()
    raw = user_ev(b, surfaceOp={"op": "replace", "start": 0, "end": 1}, sourceEventSeqs=[1, 1])
    assert_refused(b.session, raw, "REPLACE_RANGE_NOT_FOUND")


def test_an_inverted_range_is_reported_before_bad_provenance() -> None:
    b, seqs = tool_pair_turn()
    raw = user_ev(b, surfaceOp={"op": "replace", "start": seqs["message"], "end": seqs["user"]}, sourceEventSeqs=[])
    assert_refused(b.session, raw, "REPLACE_RANGE_INVERTED")


def test_bad_provenance_is_reported_before_incomplete_provenance() -> None:
    b, seqs = tool_pair_turn()
    raw = summary_ev(b, seqs["user"], seqs["result:call-a"], sources=[1, 1])
    assert_refused(b.session, raw, "PROVENANCE_INVALID")


def test_incomplete_provenance_is_reported_before_an_invalid_tool_result_replace() -> None:
    b, seqs = tool_pair_turn()
    data = rewritten_result_data(b.session, seqs["result:call-a"], "x")
    data["turn"] = 5
    op = {"op": "replace", "start": seqs["result:call-a"], "end": seqs["result:call-a"]}
    raw = ev(b, "tool/result", data, surfaceOp=op, sourceEventSeqs=[seqs["call:call-a"]])
    assert_refused(b.session, raw, "PROVENANCE_INCOMPLETE")


def test_an_invalid_tool_result_replace_is_reported_before_a_structure_error() -> None:
    b, seqs = tool_pair_turn()
    b.turn_end()
    data = rewritten_result_data(b.session, seqs["result:call-a"], "x")
    data["meta"] = {"x": 1}
    assert_refused(b.session, _rewrite_ev(b, seqs["result:call-a"], data), "TOOL_RESULT_REPLACE_INVALID")


def test_bad_provenance_on_an_append_is_reported_before_a_structure_error() -> None:
    b = open_step()
    raw = ev(b, "tool/result", tool_result_data(1, 1, "call-none"), surfaceOp="append", sourceEventSeqs=[1, 1])
    assert_refused(b.session, raw, "PROVENANCE_INVALID")


def test_a_replace_outside_a_turn_that_also_splits_a_pair_reports_the_tool_pair_first() -> None:
    """Decision (2026-12-02): issue 2 orders the checks "..., tool/result replacement, tool pairs, structure";
    SPEC 10's table lists REPLACE_SPLITS_TOOL_PAIR last, after codes (UNKNOWN_EVENT_TYPE, CORRUPT_LOG) that are
    not ordered by it either. We follow the issue's explicit order; docs/decisions.md records it."""
    b, seqs = tool_pair_turn()
    b.turn_end()
    raw = summary_ev(b, seqs["user"], seqs["message"])  # outside a turn AND shadows call-a without its result
    assert_refused(b.session, raw, "REPLACE_SPLITS_TOOL_PAIR")


# ---------------------------------------------------------------------------------------------- bytes and derivation


def test_the_bytes_an_event_arrived_as_are_kept_and_derived_exactly() -> None:
    b = open_step()
    user = (
        b'{"type":"user/message","seq":%d,"surfaceOp":"append","data":{"source":{"kind":"plugin","plugin":"ctx",'
        b'"form":"snapshot","sections":[{"name":"s","text":"t"}]},"role":"user","content":[{"text":"caf\xc3\xa9 '
        b'\\u00e9","type":"text","cache":true}],"id":"u-x","unknownKey":{"z":1,"a":2}}}' % b.next_seq
    )
    event = b.session.append(user)
    assert event.raw == user
    assert b.session.derive_messages()[-1].raw == user[user.index(b'"data":') + len(b'"data":') : -1]
    message = (
        b'{  "content" : [ {"type":"text","text":"hi","z":0} ] , "source":{"model":"m","kind":"model"},'
        b' "role":"assistant", "id":"a-x", "x-vendor": [1, 2] }'
    )
    raw = (
        b'{"seq":%d,"time":1,"type":"assistant/message","data":{"step":1,"turn":1,"message":%s,"trace":"t"},'
        b'"sourceEventSeqs":[],"surfaceOp":"append"}' % (b.next_seq, message)
    )
    b.session.append(raw)
    derived = b.session.derive_messages()[-1]
    assert derived.raw == message
    assert derived.to_builtins()["x-vendor"] == [1, 2]
    assert derived.canonical == msgspec.json.encode(msgspec.json.decode(message), order="sorted")


def test_an_assistant_message_with_empty_content_is_left_out_of_the_derived_messages() -> None:
    b = open_step()
    chunks = b.stream([])
    seq = b.assistant_message([], source_seqs=chunks)
    assert seq in b.session.surface
    assert [m.seq for m in b.session.derive_messages()] == [1]
    assert seq in [e.seq for e in b.session.transcript()]


def test_a_replace_bumps_the_generation_and_the_summary_stands_in_place_of_the_range() -> None:
    b, seqs = tool_pair_turn()
    b.step_start()
    after = b.user_message("Later")
    assert b.session.surface.nodes == (seqs["user"], seqs["message"], seqs["result:call-a"], after)
    summary = b.replace(seqs["message"], seqs["result:call-a"])
    assert b.session.generation == 1
    assert b.session.surface.nodes == (seqs["user"], summary, after)
    assert [m.seq for m in b.session.derive_messages()] == [seqs["user"], summary, after]
    nested = b.replace(seqs["user"], summary)
    assert b.session.generation == 2
    assert b.session.surface.nodes == (nested, after)
    # The log keeps every byte of what the summaries shadow.
    assert len(b.session) == nested + 1
    assert b.session[seqs["message"]].type == "assistant/message"


def test_derived_messages_handed_out_earlier_never_change() -> None:
    b, seqs = tool_pair_turn()
    first = b.session.derive_messages()
    first_seqs, first_bytes = [m.seq for m in first], messages_json(first)
    b.step_start()
    b.user_message("More")
    second = b.session.derive_messages()
    second_seqs, second_bytes = [m.seq for m in second], messages_json(second)
    b.replace(seqs["user"], seqs["result:call-a"])
    third = b.session.derive_messages()
    b.user_message("Even more")
    b.replace(b.session.surface.nodes[0], b.session.surface.nodes[-1])
    b.user_message("And more")
    assert [m.seq for m in first] == first_seqs and messages_json(first) == first_bytes
    assert [m.seq for m in second] == second_seqs and messages_json(second) == second_bytes
    assert (len(first), len(second), len(third)) == (3, 4, 2)
    assert first[-1].seq == seqs["result:call-a"] and first[0:2] == tuple(first)[0:2]
    with pytest.raises(IndexError):
        first[3]  # an old view does not see messages appended after it


def test_the_folded_header_is_the_latest_and_drops_empty_system_and_tools() -> None:
    b = SessionBuilder()
    assert b.session.fold_request_header() is None
    b.turn_start()
    first = b.request_header(system="Be careful.", tools=[{"name": "read"}], temperature=0.2)
    b.user_message("between the headers")
    latest = b.request_header(model="deepseek-v4-pro", system="", tools=[])
    folded = b.session.fold_request_header()
    assert folded is not None
    assert folded.seq == latest
    assert folded.reason == "change"
    assert folded.header.config.model == "deepseek-v4-pro"
    assert folded.raw in b.events[latest]
    assert msgspec.json.decode(folded.raw) == msgspec.json.decode(b.events[latest])["data"]["header"]
    earlier = Session(b.events[:latest]).fold_request_header()
    assert earlier is not None and earlier.seq == first
    assert earlier.to_builtins() == {
        "config": {"provider": "deepseek-official", "model": "deepseek-v4-flash", "temperature": 0.2},
        "system": "Be careful.",
        "tools": [{"name": "read"}],
    }
    assert folded.to_builtins() == {"config": {"provider": "deepseek-official", "model": "deepseek-v4-pro"}}
    b.request_header(system="Again.", tools=[{"name": "bash", "description": "Run"}])
    assert b.session.fold_request_header().to_builtins() == {
        "config": {"provider": "deepseek-official", "model": "deepseek-v4-flash"},
        "system": "Again.",
        "tools": [{"name": "bash", "description": "Run"}],
    }


def test_the_transcript_holds_append_origin_events_only() -> None:
    b, seqs = tool_pair_turn()
    originals = (seqs["user"], seqs["message"], seqs["result:call-a"])
    rewrite = b.rewrite_result(seqs["result:call-a"])
    summary = b.replace(seqs["user"], rewrite)
    b.step_start()
    later = b.user_message("after the compaction")
    transcript = [e.seq for e in b.session.transcript()]
    assert transcript == [*originals, later]
    assert summary not in transcript and rewrite not in transcript
    assert b.session.surface.nodes == (summary, later)


def test_a_loaded_log_leaves_its_event_data_out_of_the_garbage_collectors_walks() -> None:
    # A session holder keeps every event; tracked data made each full collection walk the whole log.
    import gc

    from sessiongen import event_bytes, tool_result_data, user_message_data

    events = [
        event_bytes(0, "turn/start", {"turn": 1}),
        event_bytes(1, "user/message", user_message_data("hi", "u1"), surfaceOp="append"),
        event_bytes(2, "step/start", {"turn": 1, "step": 1}),
        event_bytes(
            3, "assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "index": 0, "text": "a"}}
        ),
        event_bytes(4, "tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "read", "arguments": "{}"}),
        event_bytes(5, "tool/result", tool_result_data(1, 1, "c1", "ok"), surfaceOp="append", sourceEventSeqs=[4]),
    ]
    session = Session(events)
    assert [e.type for e in session][-1] == "tool/result"
    for event in session:
        assert not gc.is_tracked(event) and not gc.is_tracked(event.data), event.type


# ---------------------------------------------------------------------------------------------- nesting depth

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\\n', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k[{"\\', max_size=3), inner, max_size=3)
    ),
    max_leaves=60,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(value=_json_values, limit=st.integers(min_value=0, max_value=8))
def test_the_depth_scan_agrees_with_walking_the_decoded_value(value: Any, limit: int) -> None:
    """Brackets inside strings (escaped quotes and backslashes included) never count; objects and arrays do."""
    raw = msgspec.json.encode(value)
    assert nests_deeper_than(raw, limit) == (_depth(value) > limit)


@pytest.mark.parametrize("depth", [MAX_EVENT_DEPTH - 1, MAX_EVENT_DEPTH - 2])
def test_an_event_at_the_nesting_limit_is_accepted_and_one_level_more_is_event_too_deep(depth: int) -> None:
    nested = "[" * depth + "]" * depth  # the event object and `data` are two more levels
    raw = ('{"seq":0,"type":"session/title","data":{"t":' + nested + "}}").encode()
    if depth + 2 <= MAX_EVENT_DEPTH:
        assert Session([raw])[0].type == "session/title"
    else:
        with pytest.raises(SessionLogError) as refused:
            Session([raw])
        assert refused.value.code == "EVENT_TOO_DEEP" and refused.value.seq == 0
