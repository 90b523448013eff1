"""Message headers parsed by `sessionlog.natsheaders` exactly as nats-py parses them: on any block of header lines
(hypothesis), on the wire through a real nats-server, and only where the connection's own parser agrees."""

from __future__ import annotations

import logging
from typing import Any

import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from natsfixtures import log_settings

from sessionlog import natsheaders
from sessionlog.connection import connect
from sessionlog.embedded import EmbeddedServer
from sessionlog.natsheaders import SAMPLES, parse_header_lines

pytest_plugins = ["natsfixtures"]

# Bytes that meet every rule: whitespace of every kind (ASCII and not), the colon, CR/LF pieces, non-ASCII, bad UTF-8.
_PIECES = st.sampled_from(
    [b"A", b"z", b"-", b"_", b"0", b" ", b"\t", b"\x0b", b"\x0c", b"\x1c", b"\x1f", b":", b"\r", b"\n", b"\xc3\xa9",
     b"\xc2\xa0", b"\xff", b"\x00"]
)  # fmt: skip
_FIELD = st.lists(_PIECES, max_size=12).map(b"".join)
_LINE = st.one_of(st.tuples(_FIELD, _FIELD).map(lambda kv: kv[0] + b":" + kv[1]), _FIELD)


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINE, max_size=8), st.booleans())
def test_any_block_parses_as_nats_py_parses_it(lines: list[bytes], blank_end: bool) -> None:
    block = b"\r\n".join(lines) + (b"\r\n\r\n" if blank_end else b"")
    assert parse_header_lines(block) == Client._parse_header_lines(block)


def test_the_samples_agree_with_nats_py_and_cover_the_rules() -> None:
    parsed = [parse_header_lines(block) for block in SAMPLES]
    assert parsed == [Client._parse_header_lines(block) for block in SAMPLES]
    assert parsed[1] == {"A": "b", "B": "c", "C": "d"}  # names with whitespace inside, and not ASCII, are skipped
    assert parsed[2]["Url"] == "http://x:1/y" and parsed[2]["A"] == "again" and parsed[2]["Bad"] == "\ufffd\ufffd"


class _Other:
    """A connection whose parser answers otherwise (a future nats-py that changed its rules)."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        return {"Parsed": "differently"}


def test_a_connection_whose_parser_answers_otherwise_keeps_it(caplog: pytest.LogCaptureFixture) -> None:
    other: Any = _Other()
    with caplog.at_level(logging.WARNING, logger="sessionlog.natsheaders"):
        assert natsheaders.install(other) is False
    assert other._parse_header_lines(b"A: b\r\n") == {"Parsed": "differently"}
    assert "keeping nats-py's" in caplog.text
    assert natsheaders.install(object()) is False  # no parser to replace


@pytest.mark.asyncio
@pytest.mark.integration
async def test_headers_arrive_through_a_server_as_a_plain_nats_py_connection_reads_them(
    nats_server: EmbeddedServer,
) -> None:
    ours = await connect(log_settings(nats_server.url))
    plain = await nats.connect(nats_server.url)
    try:
        assert ours._parse_header_lines is parse_header_lines  # every connection sessionlog makes
        assert plain._parse_header_lines is not parse_header_lines
        headers = {"Sessionlog-First-Seq": "7", "Nats-Msg-Id": "s:1:7", "Odd": "  spaced : value  ", "Utf": "été"}
        subs = [await nc.subscribe("natsheaders.test", max_msgs=1) for nc in (ours, plain)]
        await ours.flush()
        await plain.flush()
        await plain.publish("natsheaders.test", b"x", headers=headers)
        got = [await sub.next_msg(timeout=5) for sub in subs]
        assert got[0].headers == got[1].headers == {**headers, "Odd": "spaced : value"}
    finally:
        await ours.close()
        await plain.close()
