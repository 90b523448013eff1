"""Properties of generated valid sessions: the theorem (SPEC 6), the derive cache (SPEC 5), repair (SPEC 7), fork (8).

Every session comes from `sessiongen.generated_sessions()`, which builds it event by event through a live
`Session`; see that module for what the generator covers.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st
from sessiongen import GeneratedSession, derived_pairing, generated_sessions

from sessionlog.errors import OpenTurn, SessionLogError
from sessionlog.events import Interrupted
from sessionlog.fork import END_SEED, plan_fork
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session, messages_canonical, messages_json

NOW_MS = 1_800_000_000_000

sessions = generated_sessions(max_turns=6, max_steps=4)


def _describe(g: GeneratedSession) -> None:
    """Hypothesis statistics (`--hypothesis-show-statistics`): what the examples actually covered."""
    s = g.session
    event(f"generation {min(s.generation, 3)}{'+' if s.generation > 3 else ''}")
    event("ends with an open turn" if s.turn_is_open else "ends closed")
    if any(b'"kind":"interrupted"' in raw for raw in g.events):
        event("has a repaired turn")
    if any(b'"TOOL_NOT_STARTED"' in raw for raw in g.events):
        event("has a not-started tool")


def _derivation(session: Session) -> tuple[bytes, bytes]:
    derived = session.derive_messages()
    return messages_canonical(derived), messages_json(derived)


@given(sessions)
def test_a_session_rebuilt_from_the_prefix_before_a_steps_first_chunk_derives_what_the_live_session_sent(
    g: GeneratedSession,
) -> None:
    _describe(g)
    for cp in g.checkpoints:
        first_chunk = g.session[cp.seq]
        assert first_chunk.type == "assistant/chunk"
        step_start = max(e.seq for e in g.session.events[: cp.seq] if e.type == "step/start")
        assert all(e.type != "assistant/chunk" for e in g.session.events[step_start : cp.seq])
        rebuilt = Session(g.events[: cp.seq])
        assert _derivation(rebuilt) == (cp.canonical, cp.raw)
        header = rebuilt.fold_request_header()
        assert (header.raw if header is not None else None) == cp.header


@given(sessions)
def test_the_incremental_derive_cache_never_disagrees_with_a_derive_from_scratch(g: GeneratedSession) -> None:
    live = Session()
    handed_out: list[tuple[Any, bytes]] = []
    for n, raw in enumerate(g.events, start=1):
        live.append(raw)
        derived = live.derive_messages()
        assert _derivation(Session(g.events[:n])) == (messages_canonical(derived), messages_json(derived))
        handed_out.append((derived, messages_json(derived)))
    assert _derivation(live) == _derivation(g.session)
    # Nothing handed out earlier was changed by the appends and replaces that followed it.
    for derived, raw in handed_out:
        assert messages_json(derived) == raw


def _closers_check(prefix: Session) -> tuple[bytes, ...]:
    """Repair `prefix` on a copy; the repaired log must keep every rule, close the turn and pair every tool call."""
    closers = interrupted_turn_closers(prefix)
    repaired = prefix.copy()
    repaired.extend(closers)
    assert repaired.open_turn is None
    assert repaired.open_step is None
    calls, results = derived_pairing(repaired)
    assert sorted(calls) == sorted(results)
    assert len(set(calls)) == len(calls)
    if prefix.turn_is_open:
        assert repaired[len(repaired) - 1].type == "turn/end"
        assert isinstance(repaired[len(repaired) - 1].data.reason, Interrupted)
    else:
        assert closers == ()
    return closers


@given(sessions)
def test_every_prefix_repairs_to_a_closed_log_whose_derived_tool_calls_and_results_pair_up(
    g: GeneratedSession,
) -> None:
    prefix = Session()
    _closers_check(prefix)
    for raw in g.events:
        prefix.append(raw)
        _closers_check(prefix)


@given(sessions, st.data())
def test_repair_is_deterministic_and_a_closed_turn_needs_no_closers(g: GeneratedSession, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(g.events)), min_size=1, max_size=4), label="prefix lengths")
    for n in cuts:
        from_bytes = interrupted_turn_closers(list(g.events[:n]))
        from_session = interrupted_turn_closers(Session(g.events[:n]))
        assert from_bytes == from_session == interrupted_turn_closers(list(g.events[:n]))
        if Session(g.events[:n]).turn_is_open:
            assert from_bytes
        else:
            assert from_bytes == ()
    repaired = list(g.events) + list(interrupted_turn_closers(g.session))
    assert interrupted_turn_closers(repaired) == ()


@given(sessions)
def test_a_fork_at_a_turn_boundary_derives_the_parents_prefix_and_inside_a_turn_is_refused(
    g: GeneratedSession,
) -> None:
    prefix = Session()
    forks = 0
    for boundary, raw in enumerate(g.events):
        prefix.append(raw)
        if prefix.turn_is_open:
            with pytest.raises(OpenTurn) as refused:
                plan_fork(g.session, boundary, now_ms=NOW_MS)
            assert refused.value.code == "OPEN_TURN"
            continue
        plan = plan_fork(g.session, boundary, now_ms=NOW_MS)
        forks += 1
        assert plan.seed_length == boundary + 1
        assert plan.events[: boundary + 1] == g.events[: boundary + 1]
        child = Session(plan.events)
        assert child[len(child) - 1].type == END_SEED
        assert len(child) == boundary + 1 + (0 if prefix[boundary].type == END_SEED else 1)
        assert _derivation(child) == _derivation(prefix)
        assert child.fold_request_header() == prefix.fold_request_header()
    event(f"{min(forks, 5)}{'+' if forks > 5 else ''} fork boundaries")


CHUNK_BREAKS = ("step", "turn", "seq", "surfaceOp", "sourceEventSeqs", "no seq", "data")


@given(sessions, st.data())
def test_loading_a_log_refuses_a_broken_chunk_exactly_as_appending_it_alone_does(
    g: GeneratedSession, data: Any
) -> None:
    """`Session(events)` checks chunks on a fast path of its own; it must refuse what `append` refuses, the same way."""
    chunks = [e.seq for e in g.session if e.type == "assistant/chunk"]
    assume(chunks)
    seq = data.draw(st.sampled_from(chunks))
    broken: dict[str, Any] = msgspec.json.decode(g.events[seq])
    how = data.draw(st.sampled_from(CHUNK_BREAKS))
    event(f"chunk broken by {how}")
    if how in ("step", "turn"):
        broken["data"][how] += 1
    elif how == "seq":
        broken["seq"] += 1
    elif how == "surfaceOp":
        broken["surfaceOp"] = "append"
    elif how == "sourceEventSeqs":
        broken["sourceEventSeqs"] = [0]
    elif how == "no seq":
        del broken["seq"]
    else:
        broken["data"]["chunk"] = {"type": "text-delta", "index": "zero", "text": "x"}
    bad = msgspec.json.encode(broken)

    alone = Session()
    for raw in g.events[:seq]:
        alone.append(raw)
    with pytest.raises(SessionLogError) as single:
        alone.append(bad)
    with pytest.raises(SessionLogError) as loaded:
        Session([*g.events[:seq], bad, *g.events[seq + 1 :]])
    assert (type(loaded.value), loaded.value.seq, str(loaded.value)) == (
        type(single.value),
        single.value.seq,
        str(single.value),
    )
