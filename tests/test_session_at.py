"""The session as of any seq without a replay: `Session.derive_at` and `fold_request_header_at` equal what a new
session built from the prefix derives, on every dsh fixture at every seq and on generated sessions with
compactions."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from sessiongen import GeneratedSession, generated_sessions
from test_fixtures_corpus import FIXTURE_FILES, load_fixture

from sessionlog.session import Session


def assert_views_match(session: Session) -> None:
    assert session.request_header_seqs == tuple(e.seq for e in session if e.type == "request/header")
    for seq in range(len(session)):
        prefix = session.prefix(seq)
        assert [m.raw for m in session.derive_at(seq)] == [m.raw for m in prefix.derive_messages()], seq
        assert session.fold_request_header_at(seq) == prefix.fold_request_header(), seq


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_a_fixture_derives_at_every_seq_what_its_prefix_derives(path: Path) -> None:
    assert_views_match(load_fixture(path))


@settings(max_examples=60)
@given(generated_sessions())
def test_generated_sessions_with_compactions_derive_at_every_seq_what_their_prefix_derives(
    generated: GeneratedSession,
) -> None:
    assert_views_match(generated.session)


def test_the_view_at_the_last_seq_is_the_live_derivation() -> None:
    session = load_fixture(FIXTURE_FILES[0])
    assert session.derive_at(len(session) - 1) is session.derive_messages()
    assert session.fold_request_header_at(len(session) - 1) == session.fold_request_header()
