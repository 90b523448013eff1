"""The 81 real dsh logs in FIXTURES_DIR: every projection runs on them, and the theorem and repair hold on them.

Fixtures are recorder snapshots: no `seq`, no `time`, packed chunk rows, and the `"{{tools}}"` placeholder in
`request/header` (normalized to `[]` as the fixtures' README asks).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import msgspec
import pytest
from conftest import FIXTURES_DIR, normalize_fixture
from natsfixtures import new_session_id
from sessiongen import derived_pairing

from sessionlog.events import SURFACE_TYPES, Interrupted
from sessionlog.jsonl import JsonlLog, parse_jsonl
from sessionlog.log import SessionLog
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session, messages_canonical, messages_json

FIXTURE_FILES = sorted(FIXTURES_DIR.glob("*.jsonl"))


@cache
def read_fixture(path: Path) -> JsonlLog:
    return parse_jsonl(normalize_fixture(path.read_bytes()))


@cache
def load_fixture(path: Path) -> Session:
    return Session(read_fixture(path).events)


async def import_corpus(log: SessionLog, prefix: str) -> dict[str, str]:
    """Every fixture imported into `log` under an id of its own: file name -> session id."""
    ids: dict[str, str] = {}
    for index, path in enumerate(FIXTURE_FILES):
        session_id = f"dsh-{index:02d}-{new_session_id(prefix)}"
        await log.import_log(read_fixture(path), session_id)
        ids[path.name] = session_id
    return ids


def test_the_corpus_holds_all_81_dsh_logs() -> None:
    assert len(FIXTURE_FILES) == 81


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_a_fixture_loads_and_every_projection_runs_on_it(path: Path) -> None:
    log = read_fixture(path)
    assert log.torn is None
    assert log.positional
    session = load_fixture(path)
    assert [e.raw for e in session] == log.events
    assert all(not e.has_seq for e in session)

    derived = session.derive_messages()
    surface = [session[seq] for seq in session.surface.nodes]
    assert [m.seq for m in derived] == [
        e.seq for e in surface if e.type != "assistant/message" or e.data.message.content
    ]
    assert all(m.role in ("user", "assistant") for m in derived)
    assert messages_canonical(derived).startswith(b"[")
    assert msgspec.json.decode(messages_json(derived)) == [m.to_builtins() for m in derived]

    transcript = session.transcript()
    assert all(e.type in SURFACE_TYPES and e.surface_op == "append" for e in transcript)
    assert len(transcript) == sum(1 for e in session if e.type in SURFACE_TYPES) - sum(
        1 for e in session if e.is_replace
    )

    headers = [e for e in session if e.type == "request/header"]
    folded = session.fold_request_header()
    if headers:
        assert folded is not None and folded.seq == headers[-1].seq
        assert folded.to_builtins()["config"]["provider"]
        logged = msgspec.json.decode(headers[-1].raw)["data"]["header"]
        expected = {k: v for k, v in logged.items() if not (k in ("system", "tools") and not v)}
        assert folded.to_builtins() == expected  # the normalized "{{tools}}" is empty, which counts as absent
    else:
        assert folded is None


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_every_prefix_of_a_fixture_repairs_to_a_closed_log_whose_tool_calls_pair_up(path: Path) -> None:
    prefix = Session()
    for raw in [*read_fixture(path).events, None]:
        closers = interrupted_turn_closers(prefix)
        assert closers == interrupted_turn_closers(prefix)
        if prefix.turn_is_open:
            repaired = prefix.copy()
            repaired.extend(closers)
            assert repaired.open_turn is None
            assert isinstance(repaired[len(repaired) - 1].data.reason, Interrupted)
        else:
            assert closers == ()
            repaired = prefix
        calls, results = derived_pairing(repaired)
        assert sorted(calls) == sorted(results)
        if raw is not None:
            prefix.append(raw)


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.removesuffix(".jsonl"))
def test_a_fixture_prefix_before_each_steps_first_chunk_derives_what_the_live_session_had(path: Path) -> None:
    events = read_fixture(path).events
    live = Session()
    chunked_steps: set[tuple[int, int]] = set()
    for raw in events:
        event = live.check(raw)
        if event.type == "assistant/chunk" and (event.data.turn, event.data.step) not in chunked_steps:
            chunked_steps.add((event.data.turn, event.data.step))
            rebuilt = Session(events[: event.seq])
            assert messages_canonical(rebuilt.derive_messages()) == messages_canonical(live.derive_messages())
            assert messages_json(rebuilt.derive_messages()) == messages_json(live.derive_messages())
            assert rebuilt.fold_request_header() == live.fold_request_header()
        live.append(event)
