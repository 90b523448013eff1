"""Closing a turn a crash left open (SPEC section 7), fork and resume (SPEC section 8)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from conftest import FIXTURES_DIR, dsh_header_problem, normalize_fixture
from sessiongen import SessionBuilder, derived_pairing, text_block, tool_call_block

from sessionlog.errors import InvalidBoundary, OpenTurn
from sessionlog.fork import END_SEED, ForkPlan, check_boundary, next_header_reason, plan_fork, resume_events
from sessionlog.header import decode_header
from sessionlog.jsonl import parse_jsonl
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session, messages_json

NOW_MS = 1_800_000_000_000
DSH_CLOSERS_FIXTURE = (
    FIXTURES_DIR / "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl"
)


def decoded(raws: tuple[bytes, ...] | list[bytes]) -> list[dict[str, Any]]:
    return [msgspec.json.decode(raw) for raw in raws]


def announced_step(call_ids: tuple[str, ...] = ("call-a", "call-b", "call-c")) -> SessionBuilder:
    """Turn 1, step 1 open; one assistant/message announced `call_ids` and nothing was called yet."""
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Do three things.")
    b.request_header()
    b.step_start()
    blocks = [text_block("On it."), *(tool_call_block(c) for c in call_ids)]
    b.assistant_message(blocks, source_seqs=b.stream(blocks))
    return b


def closed_session() -> SessionBuilder:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi")
    b.request_header()
    b.text_step("Hello.")
    b.turn_end()
    return b


def apply(session: Session, events: tuple[bytes, ...]) -> Session:
    repaired = session.copy()
    repaired.extend(events)
    return repaired


# ---------------------------------------------------------------------------------------------- repair


def test_a_durable_tool_call_without_a_result_gets_an_outcome_unknown_result_pointing_at_the_call() -> None:
    b = announced_step(("call-a",))
    call = b.tool_call("call-a")
    result, step_end, turn_end = decoded(interrupted_turn_closers(b.session))
    assert result["type"] == "tool/result"
    assert result["surfaceOp"] == "append"
    assert result["sourceEventSeqs"] == [call]
    assert result["data"]["error"] == {"name": "ToolOutcomeUnknownError", "code": "TOOL_OUTCOME_UNKNOWN"}
    text = result["data"]["message"]["content"][0]["content"][0]["text"]
    assert "unknown" in text
    assert "read-only or idempotent" in text
    assert "side effects" in text and "ask the user" in text
    assert step_end["type"] == "step/end" and turn_end["type"] == "turn/end"


def test_an_announced_call_that_never_started_gets_a_not_started_result_without_provenance() -> None:
    b = announced_step(("call-a",))
    result = decoded(interrupted_turn_closers(b.session))[0]
    assert "sourceEventSeqs" not in result
    assert result["surfaceOp"] == "append"
    assert result["data"]["error"] == {"name": "ToolNotStartedError", "code": "TOOL_NOT_STARTED"}
    text = result["data"]["message"]["content"][0]["content"][0]["text"]
    assert "did not run" in text or "not start" in text
    assert "retry" in text.lower()


def test_synthetic_results_follow_announcement_order_and_skip_answered_calls() -> None:
    b = announced_step(("call-a", "call-b", "call-c", "call-d"))
    call_d = b.tool_call("call-d")  # calls recorded out of announcement order
    call_a = b.tool_call("call-a")
    b.tool_result("call-a", call_seq=call_a)
    b.plugin("llm/retry", {"attempt": 1})
    closers = decoded(interrupted_turn_closers(b.session))
    results = [c for c in closers if c["type"] == "tool/result"]
    assert [r["data"]["message"]["content"][0]["toolCallId"] for r in results] == ["call-b", "call-c", "call-d"]
    assert [r["data"]["error"]["code"] for r in results] == [
        "TOOL_NOT_STARTED",
        "TOOL_NOT_STARTED",
        "TOOL_OUTCOME_UNKNOWN",
    ]
    assert results[2]["sourceEventSeqs"] == [call_d]


def test_calls_announced_by_two_messages_of_the_step_are_closed_in_announcement_order() -> None:
    b = announced_step(("call-b",))
    b.assistant_message([tool_call_block("call-a")], source_seqs=[])
    ids = [c["data"]["message"]["content"][0]["toolCallId"] for c in decoded(interrupted_turn_closers(b.session))[:-2]]
    assert ids == ["call-b", "call-a"]


def replace_assistant(b: SessionBuilder, node: int, blocks: list[dict[str, Any]]) -> int:
    """An assistant/message replacing surface node `node` in the open step, carrying `blocks`."""
    data = {"turn": b.turn, "step": b.step, "message": {"id": b.fresh_id("rewritten"), "role": "assistant",
            "content": blocks, "source": {"kind": "plugin", "plugin": "rewrite"}}}  # fmt: skip
    return b.emit("assistant/message", data, surfaceOp={"op": "replace", "start": node, "end": node},
                  sourceEventSeqs=[node])  # fmt: skip


def test_a_call_carried_by_an_assistant_replacement_in_the_open_step_is_closed_too() -> None:
    """dsh's closers register the tool calls of every assistant/message of the open step, a replacement's too;
    a call left dangling would make the provider refuse the repaired context."""
    b = announced_step(("call-a",))
    node = b.session.surface.nodes[-1]
    replace_assistant(b, node, [text_block("On it, differently."), tool_call_block("call-a"),
                                tool_call_block("call-r"), tool_call_block("call-s")])  # fmt: skip
    call_s = b.tool_call("call-s")
    closers = decoded(interrupted_turn_closers(b.session))
    results = [c for c in closers if c["type"] == "tool/result"]
    # call-a, announced twice, is closed once; the replacement's own calls follow in their order.
    assert [r["data"]["message"]["content"][0]["toolCallId"] for r in results] == ["call-a", "call-r", "call-s"]
    assert [r["data"]["error"]["code"] for r in results] == ["TOOL_NOT_STARTED", "TOOL_NOT_STARTED",
                                                             "TOOL_OUTCOME_UNKNOWN"]  # fmt: skip
    assert results[2]["sourceEventSeqs"] == [call_s]
    repaired = apply(b.session, interrupted_turn_closers(b.session))
    assert repaired.open_turn is None
    wire = msgspec.json.decode(messages_json(repaired.derive_messages()))
    called = [c["id"] for m in wire for c in m.get("content", []) if c.get("type") == "tool-call"]
    answered = [c["toolCallId"] for m in wire for c in m.get("content", []) if c.get("type") == "tool-result"]
    assert called == ["call-a", "call-r", "call-s"] and answered == called, "every call on the surface is answered"


def test_a_synthetic_result_has_the_spec_shape() -> None:
    b = announced_step(("call-a", "call-b"))
    b.tool_call("call-b")
    first_seq = len(b.session)
    closers = decoded(interrupted_turn_closers(b.session))
    for offset, (closer, call_id) in enumerate(zip(closers[:2], ["call-a", "call-b"], strict=True)):
        seq = first_seq + offset
        assert closer["seq"] == seq
        assert closer["data"]["turn"] == 1 and closer["data"]["step"] == 1
        message = closer["data"]["message"]
        assert message["id"] == f"interrupted-tool-result-{call_id}-{seq}"
        assert message["role"] == "user"
        assert message["source"] == {"kind": "tool", "callId": call_id}
        [block] = message["content"]
        assert block["type"] == "tool-result"
        assert block["toolCallId"] == call_id
        assert block["isError"] is True
        assert [part["type"] for part in block["content"]] == ["text"]


def test_closers_end_the_open_step_then_the_turn_as_interrupted_with_continuing_seqs_and_the_last_time() -> None:
    b = announced_step(("call-a",))
    b.tool_call("call-a")
    b.plugin("session/title", {"title": "t"})
    last_time = msgspec.json.decode(b.events[-1])["time"]
    closers = decoded(interrupted_turn_closers(b.session))
    assert [c["type"] for c in closers] == ["tool/result", "step/end", "turn/end"]
    assert [c["seq"] for c in closers] == list(range(len(b.session), len(b.session) + 3))
    assert {c["time"] for c in closers} == {last_time}
    assert closers[1]["data"] == {"turn": 1, "step": 1}
    assert closers[2]["data"] == {"turn": 1, "reason": {"kind": "interrupted"}}


def test_a_turn_open_between_steps_gets_only_its_turn_end() -> None:
    b = announced_step(("call-a",))
    b.tool_result("call-a", call_seq=b.tool_call("call-a"))
    b.step_end()
    closers = decoded(interrupted_turn_closers(b.session))
    assert [c["type"] for c in closers] == ["turn/end"]
    assert closers[0]["data"]["reason"] == {"kind": "interrupted"}


def test_a_turn_open_before_its_first_step_gets_only_its_turn_end() -> None:
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi")
    assert [c["type"] for c in decoded(interrupted_turn_closers(b.session))] == ["turn/end"]


def test_closers_keep_every_rule_close_the_turn_and_pair_every_call() -> None:
    b = announced_step(("call-a", "call-b", "call-c"))
    b.tool_call("call-c")
    b.not_started_result("call-b")  # the writer already answered this one
    repaired = apply(b.session, interrupted_turn_closers(b.session))
    assert repaired.open_turn is None and repaired.open_step is None
    calls, results = derived_pairing(repaired)
    assert sorted(calls) == sorted(results) == ["call-a", "call-b", "call-c"]


def test_repair_is_byte_identical_across_runs_and_inputs() -> None:
    b = announced_step(("call-a", "call-b"))
    b.tool_call("call-a")
    runs = {
        interrupted_turn_closers(b.session),
        interrupted_turn_closers(b.session.copy()),
        interrupted_turn_closers(list(b.events)),
        interrupted_turn_closers(Session(b.events)),
    }
    assert len(runs) == 1
    assert runs.pop()


@pytest.mark.parametrize("session", [Session(), closed_session().session], ids=["empty", "closed"])
def test_a_log_without_an_open_turn_needs_no_closers(session: Session) -> None:
    assert interrupted_turn_closers(session) == ()


def test_after_repair_and_a_seed_the_log_continues_with_the_next_turn() -> None:
    b = announced_step(("call-a",))
    b.close_interrupted()
    b.end_seed()
    b.turn_start()
    b.user_message("Continue safely.")
    b.text_step("Checking first.")
    b.turn_end()
    assert b.session.last_turn == 2 and interrupted_turn_closers(b.session) == ()


def test_a_recorder_style_log_gets_closers_without_seq_or_time() -> None:
    b = SessionBuilder(seqs=False)
    b.turn_start()
    b.user_message("Go")
    b.step_start()
    b.assistant_message([tool_call_block("call-a")], source_seqs=[])
    b.tool_call("call-a")
    closers = decoded(interrupted_turn_closers(b.session))
    assert [c["type"] for c in closers] == ["tool/result", "step/end", "turn/end"]
    assert all("seq" not in c and "time" not in c for c in closers)
    # Positional seqs still name the closer and its call.
    assert closers[0]["data"]["message"]["id"] == f"interrupted-tool-result-call-a-{len(b.session)}"
    assert closers[0]["sourceEventSeqs"] == [len(b.session) - 1]
    assert apply(b.session, interrupted_turn_closers(b.session)).open_turn is None


def _without_texts(value: Any) -> Any:
    """`value` with every text block's text blanked: the texts are each project's own words."""
    if isinstance(value, dict):
        return {
            k: ("<text>" if k == "text" and value.get("type") == "text" else _without_texts(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_without_texts(v) for v in value]
    return value


def test_our_closers_have_the_shape_of_the_closers_dsh_wrote() -> None:
    log = parse_jsonl(normalize_fixture(DSH_CLOSERS_FIXTURE.read_bytes()))
    events = log.events
    first_closer = next(i for i, raw in enumerate(events) if b'"interrupted-tool-result-' in raw)
    dsh = events[first_closer : first_closer + 3]
    assert [msgspec.json.decode(raw)["type"] for raw in dsh] == ["tool/result", "step/end", "turn/end"]
    ours = interrupted_turn_closers(events[:first_closer])
    assert [_without_texts(e) for e in decoded(ours)] == [_without_texts(e) for e in decoded(dsh)]
    # The bytes differ only in texts and key order: both logs still load and derive alike, text aside.
    assert (
        apply(Session(events[:first_closer]), ours).surface.nodes == Session(events[: first_closer + 3]).surface.nodes
    )


# ---------------------------------------------------------------------------------------------- fork


@pytest.mark.parametrize("boundary", [-1, -100, "3", 2.0, True, False, [1]], ids=repr)
def test_a_fork_boundary_that_is_not_a_non_negative_integer_is_refused(boundary: Any) -> None:
    b = closed_session()
    with pytest.raises(InvalidBoundary) as refused:
        plan_fork(b.session, boundary, now_ms=NOW_MS)
    assert refused.value.code == "INVALID_BOUNDARY"
    assert "non-negative integer" in refused.value.message


@pytest.mark.parametrize("past", [0, 1, 50])
def test_a_fork_boundary_past_the_end_is_refused(past: int) -> None:
    b = closed_session()
    with pytest.raises(InvalidBoundary) as refused:
        plan_fork(b.session, len(b.session) + past, now_ms=NOW_MS)
    assert refused.value.code == "INVALID_BOUNDARY"
    assert "past the end" in refused.value.message


def test_a_fork_boundary_inside_a_turn_is_refused_as_open_turn() -> None:
    b = closed_session()
    b.turn_start()
    turn_start = len(b.session) - 1
    b.user_message("More")
    b.text_step()
    b.turn_end()
    for boundary in range(turn_start, len(b.session) - 1):
        with pytest.raises(OpenTurn) as refused:
            check_boundary(b.session, boundary)
        assert refused.value.code == "OPEN_TURN"
        assert refused.value.seq == boundary
        assert "turn 2" in refused.value.message
    assert check_boundary(b.session, len(b.session) - 1) == len(b.session) - 1


def test_a_fork_of_an_open_turn_at_the_default_boundary_is_refused() -> None:
    b = announced_step()
    with pytest.raises(OpenTurn):
        plan_fork(b.session, now_ms=NOW_MS)


def test_an_empty_source_with_no_boundary_forks_an_empty_child() -> None:
    plan = plan_fork(Session(), now_ms=NOW_MS)
    assert plan.events == ()
    assert plan.seed_length == 0
    assert plan.boundary is None
    with pytest.raises(InvalidBoundary):
        plan_fork(Session(), 0, now_ms=NOW_MS)


def test_a_fork_copies_the_prefix_bytes_then_adds_an_end_seed_and_leaves_the_parent_alone() -> None:
    b = closed_session()
    boundary = len(b.session) - 1
    b.plugin("session/title", {"title": "after the fork point"})
    parent_before = tuple(e.raw for e in b.session)
    plan = plan_fork(b.session, boundary, now_ms=NOW_MS)
    assert plan.events[: boundary + 1] == tuple(b.events[: boundary + 1])
    seed = msgspec.json.decode(plan.events[-1])
    # The seed takes the last copied event's time, so the same fork always gives the same bytes (2026-12-02).
    last_time = msgspec.json.decode(b.events[boundary])["time"]
    assert seed == {"seq": boundary + 1, "time": last_time, "type": END_SEED, "data": {}}
    assert plan.seed_length == boundary + 1
    assert plan.boundary == boundary
    assert tuple(e.raw for e in b.session) == parent_before
    child = Session(plan.events)
    assert messages_json(child.derive_messages()) == messages_json(Session(b.events[: boundary + 1]).derive_messages())
    assert child.fold_request_header() == b.session.fold_request_header()


def test_a_fork_at_the_default_boundary_copies_the_whole_log() -> None:
    b = closed_session()
    plan = plan_fork(b.session, now_ms=NOW_MS)
    assert plan.boundary == len(b.session) - 1
    assert len(plan.events) == len(b.session) + 1


def test_a_prefix_that_already_ends_with_an_end_seed_gets_no_second_one() -> None:
    b = closed_session()
    seed = b.end_seed()
    plan = plan_fork(b.session, seed, now_ms=NOW_MS)
    assert plan.events == tuple(b.events)
    assert plan.seed_length == seed + 1
    assert sum(1 for raw in plan.events if b'"session/end-seed"' in raw) == 1


def test_a_fork_of_a_recorder_style_log_adds_a_seed_without_seq() -> None:
    b = SessionBuilder(seqs=False)
    b.turn_start()
    b.user_message("Hi")
    b.turn_end()
    plan = plan_fork(b.session, now_ms=NOW_MS)
    assert "seq" not in msgspec.json.decode(plan.events[-1])
    assert len(Session(plan.events)) == 4


def child_header(plan: ForkPlan, child_id: str, parent: dict[str, Any]) -> dict[str, Any]:
    """The child's header as its bytes decode (the parent given as the JSON its header line holds)."""
    made = plan.child_header(child_id=child_id, parent=decode_header(msgspec.json.encode(parent)), created_at=NOW_MS)
    decoded: dict[str, Any] = msgspec.json.decode(made.encode())
    return decoded


def test_a_fork_childs_header_records_its_lineage() -> None:
    b = closed_session()
    plan = plan_fork(b.session, now_ms=NOW_MS)
    parent = {"type": "session", "version": 0, "id": "parent-1", "createdAt": 1, "cwd": "/work", "delegationDepth": 0}
    header = child_header(plan, "child-1", parent)
    assert header["type"] == "session" and header["version"] == 0
    assert header["id"] == "child-1" and header["createdAt"] == NOW_MS
    assert header["parentSession"] == "parent-1"
    assert header["seedLength"] == len(b.session)
    assert header["cwd"] == "/work"
    without_cwd = child_header(plan, "child-2", {"type": "session", "version": 0, "id": "parent-1", "createdAt": 1})
    assert "cwd" not in without_cwd and without_cwd["parentSession"] == "parent-1"


def test_a_fork_childs_header_is_one_dsh_loads_even_from_a_subagent_parent() -> None:
    """dsh refuses a header whose `origin` is not "subagent" ("first line is not a session header"), and its own
    fork writes no `origin` and leaves `delegationDepth` at 0 whatever the parent's."""
    plan = plan_fork(closed_session().session, now_ms=NOW_MS)
    parent = {"type": "session", "version": 0, "id": "sub-1", "createdAt": 1, "cwd": "/work",
              "parentSession": "top-1", "origin": "subagent", "delegationDepth": 2}  # fmt: skip
    header = child_header(plan, "child-1", parent)
    assert dsh_header_problem(header) is None, header
    assert "origin" not in header and header["delegationDepth"] == 0
    assert header["parentSession"] == "sub-1" and header["cwd"] == "/work"
    # The checker is dsh's rule, not a formality: the header this project used to write fails it, the
    # children dsh wrote itself pass it.
    assert dsh_header_problem({**header, "origin": "fork"}) == "origin must be \"subagent\", got 'fork'"
    children = sorted(FIXTURES_DIR.glob("*.[0-9].jsonl"))
    assert len(children) >= 10
    for path in children:
        line = path.read_bytes().split(b"\n", 1)[0].replace(b"{{cwd}}", b"/cwd")
        child = msgspec.json.decode(line)
        assert child.get("origin") == "subagent" and dsh_header_problem(child) is None, path.name


# ---------------------------------------------------------------------------------------------- resume


def test_resume_of_an_open_turn_appends_the_closers_then_an_end_seed() -> None:
    b = announced_step(("call-a",))
    b.tool_call("call-a")
    closers = interrupted_turn_closers(b.session)
    events = resume_events(b.session, now_ms=NOW_MS)
    assert events[:-1] == closers
    seed = msgspec.json.decode(events[-1])
    assert seed == {"seq": len(b.session) + len(closers), "time": NOW_MS, "type": END_SEED, "data": {}}
    resumed = apply(b.session, events)
    assert resumed.open_turn is None
    assert resume_events(resumed, now_ms=NOW_MS + 1) == ()


def test_resume_of_a_closed_log_appends_only_an_end_seed() -> None:
    b = closed_session()
    events = resume_events(b.session, now_ms=NOW_MS)
    assert [msgspec.json.decode(raw)["type"] for raw in events] == [END_SEED]
    assert msgspec.json.decode(events[0])["seq"] == len(b.session)


def test_resume_of_a_log_that_already_ends_with_a_seed_appends_nothing() -> None:
    b = closed_session()
    b.end_seed()
    assert resume_events(b.session, now_ms=NOW_MS) == ()


def test_resume_of_a_turn_opened_after_a_seed_still_closes_it() -> None:
    b = closed_session()
    b.end_seed()
    b.turn_start()
    events = resume_events(b.session, now_ms=NOW_MS)
    assert [msgspec.json.decode(raw)["type"] for raw in events] == ["turn/end", END_SEED]


def test_resume_of_a_recorder_style_log_writes_no_seqs() -> None:
    b = SessionBuilder(seqs=False)
    b.turn_start()
    events = resume_events(b.session, now_ms=NOW_MS)
    assert all("seq" not in msgspec.json.decode(raw) for raw in events)
    assert apply(b.session, events).open_turn is None


def test_the_next_header_after_resume_is_resume_when_the_log_has_one_else_initial() -> None:
    """The rule the agent follows (`next_header_reason`), applied to logs a resume has just ended."""
    with_header = closed_session()
    assert next_header_reason(with_header.session) is None  # no resume since the header: it still holds
    assert next_header_reason(apply(with_header.session, resume_events(with_header.session, now_ms=NOW_MS))) == "resume"
    b = SessionBuilder()
    b.turn_start()
    b.user_message("no header yet")
    b.turn_end()
    assert next_header_reason(b.session) == "initial"
    assert next_header_reason(apply(b.session, resume_events(b.session, now_ms=NOW_MS))) == "initial"
    assert next_header_reason(Session()) == "initial"
