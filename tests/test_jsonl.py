"""JSONL files (SPEC section 9): header, packed chunk rows, torn tails, zstd framing, append and truncate."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zstandard
from conftest import FIXTURES_DIR
from conftest import normalize_fixture as normalize
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionlog.errors import Conflict, CorruptLog, InvalidEvent, UnsupportedVersion
from sessionlog.events import decode_event, encode_new_event
from sessionlog.jsonl import (
    JsonlLog,
    SessionHeader,
    append_jsonl,
    decode_header,
    encode_header,
    encode_jsonl,
    pack_events,
    parse_jsonl,
    read_jsonl,
    truncate_torn_tail,
    write_jsonl,
)

FIXTURES = FIXTURES_DIR
FIXTURE_FILES = sorted(FIXTURES.glob("*.jsonl"))

HEADER = b'{"type":"session","version":0,"id":"s-1","createdAt":1784973850000,"delegationDepth":0}'


# ---------------------------------------------------------------------------------------------- helpers


def event(kind: str, data: Any, seq: int | None = None, time: int | None = None) -> bytes:
    return encode_new_event(kind, data, seq=seq, time=time)


def delta(
    seq: int | None,
    time: int | None = None,
    *,
    kind: str = "text-delta",
    part: str = "x",
    turn: int = 1,
    step: int = 1,
    index: int = 0,
    call_id: str = "call-1",
    name: str | None = None,
) -> bytes:
    """A plain delta event, built the way SPEC section 9 spells it."""
    chunk: dict[str, Any]
    if kind == "tool-call-delta":
        chunk = {"type": kind, "index": index, "id": call_id}
        if name is not None:
            chunk["name"] = name
        chunk["argumentsDelta"] = part
    else:
        chunk = {"type": kind, "index": index, "text": part}
    return event("assistant/chunk", {"turn": turn, "step": step, "chunk": chunk}, seq, time)


def jsonl(*lines: bytes, header: bytes = HEADER, newline: bool = True) -> bytes:
    return b"\n".join((header, *lines)) + (b"\n" if newline else b"")


def turn_end(seq: int | None, turn: int = 1) -> bytes:
    return event("turn/end", {"turn": turn, "reason": {"kind": "completed"}}, seq)


def rows(data: bytes) -> list[dict[str, Any]]:
    return [msgspec.json.decode(line) for line in data.split(b"\n")[1:-1]]


# ---------------------------------------------------------------------------------------------- unpacking


def test_a_text_row_unpacks_to_one_chunk_per_text_with_seq_and_time_arithmetic() -> None:
    row = (
        b'{"type":"text-chunks","seq0":3,"time0":100,"data":{"turn":2,"step":1,"index":1,'
        b'"dt":[5,0,7],"texts":["a","b","c","d"]}}'
    )
    log = parse_jsonl(jsonl(*(event("x/y", {}, seq) for seq in range(3)), row))
    assert log.events[3:] == [
        b'{"seq":3,"time":100,"type":"assistant/chunk","data":{"turn":2,"step":1,'
        b'"chunk":{"type":"text-delta","index":1,"text":"a"}}}',
        b'{"seq":4,"time":105,"type":"assistant/chunk","data":{"turn":2,"step":1,'
        b'"chunk":{"type":"text-delta","index":1,"text":"b"}}}',
        b'{"seq":5,"time":105,"type":"assistant/chunk","data":{"turn":2,"step":1,'
        b'"chunk":{"type":"text-delta","index":1,"text":"c"}}}',
        b'{"seq":6,"time":112,"type":"assistant/chunk","data":{"turn":2,"step":1,'
        b'"chunk":{"type":"text-delta","index":1,"text":"d"}}}',
    ]
    assert not log.positional and log.torn is None


def test_a_reasoning_row_unpacks_to_reasoning_deltas() -> None:
    row = (
        b'{"type":"reasoning-chunks","seq0":0,"time0":7,"data":{"turn":1,"step":1,"index":0,"dt":[1],'
        b'"texts":["hm","m"]}}'
    )
    log = parse_jsonl(jsonl(row))
    assert [msgspec.json.decode(e)["data"]["chunk"] for e in log.events] == [
        {"type": "reasoning-delta", "index": 0, "text": "hm"},
        {"type": "reasoning-delta", "index": 0, "text": "m"},
    ]
    assert [msgspec.json.decode(e)["time"] for e in log.events] == [7, 8]


def test_every_chunk_of_a_tool_call_row_carries_its_id_and_name() -> None:
    row = (
        b'{"type":"tool-call-chunks","seq0":0,"time0":50,"data":{"turn":1,"step":2,"index":1,"dt":[0,3],'
        b'"id":"call_00","name":"bash","args":["","{\\"a\\"","}"]}}'
    )
    log = parse_jsonl(jsonl(row))
    assert log.events == [
        b'{"seq":0,"time":50,"type":"assistant/chunk","data":{"turn":1,"step":2,"chunk":{"type":"tool-call-delta",'
        b'"index":1,"id":"call_00","name":"bash","argumentsDelta":""}}}',
        b'{"seq":1,"time":50,"type":"assistant/chunk","data":{"turn":1,"step":2,"chunk":{"type":"tool-call-delta",'
        b'"index":1,"id":"call_00","name":"bash","argumentsDelta":"{\\"a\\""}}}',
        b'{"seq":2,"time":53,"type":"assistant/chunk","data":{"turn":1,"step":2,"chunk":{"type":"tool-call-delta",'
        b'"index":1,"id":"call_00","name":"bash","argumentsDelta":"}"}}}',
    ]
    for seq, raw in enumerate(log.events):
        assert decode_event(raw, seq).data.chunk.id == "call_00"


def test_a_tool_call_row_without_a_name_gives_chunks_without_a_name() -> None:
    row = (
        b'{"type":"tool-call-chunks","seq0":0,"data":{"turn":1,"step":1,"index":0,"dt":[2],"id":"c","args":["{","}"]}}'
    )
    log = parse_jsonl(jsonl(row))
    assert [msgspec.json.decode(e)["data"]["chunk"] for e in log.events] == [
        {"type": "tool-call-delta", "index": 0, "id": "c", "argumentsDelta": "{"},
        {"type": "tool-call-delta", "index": 0, "id": "c", "argumentsDelta": "}"},
    ]
    # No time0: the chunks have no time either.
    assert all(b'"time"' not in e for e in log.events)


def test_a_recorder_snapshot_is_positional_and_a_row_covers_as_many_positions_as_chunks() -> None:
    row = b'{"type":"text-chunks","data":{"turn":1,"step":1,"index":0,"dt":[4,9],"texts":["a","b","c"]}}'
    data = jsonl(event("turn/start", {"turn": 1}), row, turn_end(None))
    log = parse_jsonl(data)
    assert log.positional and log.torn is None
    assert len(log.events) == 5
    assert log.events[1] == (
        b'{"type":"assistant/chunk","data":{"turn":1,"step":1,"chunk":{"type":"text-delta","index":0,"text":"a"}}}'
    )
    assert decode_event(log.events[4], 4).type == "turn/end"


def test_the_header_is_kept_as_its_original_bytes_and_decoded() -> None:
    header = (
        b'{"type":"session","version":0,"id":"c","createdAt":5,"cwd":"/w","parentSession":"p",'
        b'"seedLength":4,"origin":{"kind":"fork"},"agentPreset":{"name":"x"},"extra":1}'
    )
    log = parse_jsonl(jsonl(header=header))
    assert log.header_raw == header
    assert log.header == SessionHeader(
        version=0,
        id="c",
        created_at=5,
        cwd="/w",
        parent_session="p",
        seed_length=4,
        origin={"kind": "fork"},
        agent_preset={"name": "x"},
    )
    assert log.header.delegation_depth == 0 and log.header.type == "session"
    assert log.events == [] and log.positional


def test_encode_header_writes_the_spec_key_order_with_delegation_depth() -> None:
    header = SessionHeader(version=0, id="a", created_at=9, cwd="/w", parent_session="p", seed_length=0)
    raw = encode_header(header)
    assert raw == (
        b'{"type":"session","version":0,"id":"a","createdAt":9,"cwd":"/w","parentSession":"p",'
        b'"seedLength":0,"delegationDepth":0}'
    )
    assert decode_header(raw) == header


# ---------------------------------------------------------------------------------------------- header errors


def test_an_empty_file_has_no_header() -> None:
    with pytest.raises(InvalidEvent, match="line 1: expected a session header") as err:
        parse_jsonl(b"")
    assert err.value.seq is None


def test_a_file_that_starts_with_an_event_has_no_header() -> None:
    with pytest.raises(InvalidEvent, match=r"line 1: expected a session header.*type 'turn/start'") as err:
        parse_jsonl(jsonl(header=event("turn/start", {"turn": 1})))
    assert err.value.seq is None


@pytest.mark.parametrize("line", [b"", b"not json", b"[1,2]", b'{"version":0}'])
def test_a_line_one_that_is_no_header_object_is_refused(line: bytes) -> None:
    with pytest.raises(InvalidEvent, match="line 1"):
        parse_jsonl(line + b"\n")


def test_a_header_version_other_than_zero_is_unsupported() -> None:
    with pytest.raises(UnsupportedVersion, match="version 1"):
        parse_jsonl(jsonl(header=b'{"type":"session","version":1,"id":"s","createdAt":1,"new":{}}'))


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b'{"type":"session","version":"0","id":"s","createdAt":1}', "version must be an integer"),
        (b'{"type":"session","version":0,"createdAt":1}', "`id`"),
        (b'{"type":"session","version":0,"id":"s","createdAt":1,"seedLength":-1}', "seedLength"),
        (b'{"type":"session","version":0,"id":"s","createdAt":"yesterday"}', "createdAt"),
    ],
)
def test_a_malformed_header_is_an_invalid_event(header: bytes, match: str) -> None:
    with pytest.raises(InvalidEvent, match=match) as err:
        parse_jsonl(jsonl(header=header))
    assert err.value.seq is None


# ---------------------------------------------------------------------------------------------- torn tails


def test_a_torn_last_line_is_dropped_and_reported() -> None:
    data = jsonl(event("turn/start", {"turn": 1}, 0), b'{"seq":1,"type":"step/st', newline=False)
    log = parse_jsonl(data)
    assert len(log.events) == 1
    assert log.torn is not None
    assert (log.torn.line, log.torn.position, log.torn.lines_dropped) == (3, 1, 1)
    assert "no trailing newline" in log.torn.reason
    assert data[: log.good_size] == jsonl(event("turn/start", {"turn": 1}, 0))


def test_a_complete_last_line_without_its_newline_is_still_torn() -> None:
    data = jsonl(event("turn/start", {"turn": 1}, 0), turn_end(1), newline=False)
    log = parse_jsonl(data)
    assert len(log.events) == 1 and log.torn is not None and log.torn.line == 3


def test_the_newline_after_the_last_line_is_not_an_empty_line() -> None:
    log = parse_jsonl(jsonl(event("turn/start", {"turn": 1}, 0)))
    assert log.torn is None and log.good_size == len(jsonl(event("turn/start", {"turn": 1}, 0)))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (b'{"seq":2,"type":"step/start","da', "not an event line"),
        (b"", "an empty line"),
        (b'["seq",2]', "not an event line"),
        (b'{"seq":2,"type":7}', "not an event line"),
        (b'{"seq":2,"type":"text-chunks","data":{"turn":1,"step":1,"index":0,"dt":[],"texts":["a","b"]}}', "dt"),
        (event("step/start", {"turn": 1, "step": 1}, 3), "seq 3 where seq 2 was expected"),
        (event("step/start", {"turn": 1, "step": 1}, None), "no seq where seq 2 was expected"),
        (b'{"seq":"2","type":"step/start","data":{"turn":1,"step":1}}', "seq '2' where seq 2"),
    ],
)
def test_the_first_bad_line_or_gap_is_where_the_tear_began(bad: bytes, reason: str) -> None:
    good = [event("turn/start", {"turn": 1}, 0), event("user/message", {}, 1)]
    after = event("step/start", {"turn": 1, "step": 1}, 3)
    data = jsonl(*good, bad, after)
    log = parse_jsonl(data)
    assert log.events == good
    assert log.torn is not None
    assert (log.torn.line, log.torn.position, log.torn.lines_dropped) == (4, 2, 2)
    assert reason in log.torn.reason
    assert data[: log.good_size] == jsonl(*good)


@pytest.mark.parametrize(
    "bad",
    [
        b'{"seq":2,"type":"step/st',
        b"",
        event("step/start", {"turn": 1, "step": 1}, 5),
        event("step/start", {"turn": 1, "step": 1}, None),
        b'{"seq":2,"type":"tool-call-chunks","data":{"turn":1,"step":1,"index":0,"dt":[1],"args":["a","b"]}}',
    ],
)
@pytest.mark.parametrize(
    "closer", [turn_end(3), b'{"seq":3,"type":"turn/end","data":{"tu', b'{"type": "turn/end", "da']
)
def test_a_bad_line_followed_by_a_turn_end_is_corruption(bad: bytes, closer: bytes) -> None:
    data = jsonl(event("turn/start", {"turn": 1}, 0), event("user/message", {}, 1), bad, closer)
    with pytest.raises(CorruptLog, match=r"line 4: .*line 5 after it holds a turn/end") as err:
        parse_jsonl(data)
    assert err.value.seq == 2


def test_a_later_line_that_only_mentions_turn_end_is_not_a_turn_end() -> None:
    mention = event("user/message", {"text": '{"type":"turn/end"}'}, 3)
    log = parse_jsonl(jsonl(event("turn/start", {"turn": 1}, 0), b"garbage", mention))
    assert log.torn is not None and log.torn.line == 3 and log.torn.lines_dropped == 2


def test_an_event_with_a_seq_in_a_positional_log_is_a_gap() -> None:
    log = parse_jsonl(jsonl(event("turn/start", {"turn": 1}), event("step/start", {"turn": 1, "step": 1}, 1)))
    assert log.positional and len(log.events) == 1
    assert log.torn is not None and "carries seq 1 in a log whose events carry none" in log.torn.reason


def test_a_row_with_seq0_in_a_positional_log_is_a_gap() -> None:
    row = b'{"type":"text-chunks","seq0":1,"data":{"turn":1,"step":1,"index":0,"dt":[0],"texts":["a","b"]}}'
    log = parse_jsonl(jsonl(event("turn/start", {"turn": 1}), row))
    assert log.torn is not None and log.torn.line == 3


def test_a_row_whose_seq0_is_not_its_position_is_a_gap() -> None:
    row = b'{"type":"text-chunks","seq0":2,"data":{"turn":1,"step":1,"index":0,"dt":[0],"texts":["a","b"]}}'
    log = parse_jsonl(jsonl(event("turn/start", {"turn": 1}, 0), row))
    assert log.torn is not None and "seq 2 where seq 1 was expected" in log.torn.reason


def test_a_header_without_its_newline_is_kept_and_marked_for_mending() -> None:
    log = parse_jsonl(HEADER)
    assert log.events == [] and log.torn is not None and log.torn.lines_dropped == 0


# ---------------------------------------------------------------------------------------------- packing


def test_a_run_of_three_deltas_is_packed_into_one_row() -> None:
    events = [delta(0, 10, part="a"), delta(1, 12, part="b"), delta(2, 12, part="c")]
    data = encode_jsonl(HEADER, events)
    assert data == jsonl(
        b'{"type":"text-chunks","seq0":0,"time0":10,"data":{"turn":1,"step":1,"index":0,"dt":[2,0],'
        b'"texts":["a","b","c"]}}'
    )
    assert parse_jsonl(data).events == events


def test_a_tool_call_row_has_the_key_order_of_dsh_files() -> None:
    events = [delta(s, 5, kind="tool-call-delta", part=p, index=1, name="bash") for s, p in enumerate("{x}")]
    data = encode_jsonl(HEADER, events)
    assert data == jsonl(
        b'{"type":"tool-call-chunks","seq0":0,"time0":5,"data":{"turn":1,"step":1,"index":1,"dt":[0,0],'
        b'"id":"call-1","name":"bash","args":["{","x","}"]}}'
    )
    assert parse_jsonl(data).events == events


def test_a_run_of_two_is_not_packed() -> None:
    events = [delta(0, 1), delta(1, 2), event("x/y", {}, 2), delta(3, 3), delta(4, 4)]
    assert encode_jsonl(HEADER, events) == jsonl(*events)


@pytest.mark.parametrize(
    "breaker",
    [
        delta(2, 3, index=1),
        delta(2, 3, step=2),
        delta(2, 3, turn=2),
        delta(2, 3, kind="reasoning-delta"),
        delta(3, 3),
        delta(2, 1),
        delta(2, None),
    ],
    ids=["index", "step", "turn", "kind", "seq-skip", "time-backwards", "no-time"],
)
def test_a_delta_that_does_not_continue_the_run_breaks_it(breaker: bytes) -> None:
    events = [delta(0, 1), delta(1, 2), breaker]
    assert encode_jsonl(HEADER, events) == jsonl(*events)


def test_tool_call_deltas_with_different_names_or_ids_break_the_run() -> None:
    def tool(seq: int, name: str | None, call_id: str = "c1") -> bytes:
        return delta(seq, seq, kind="tool-call-delta", name=name, call_id=call_id)

    by_name = [tool(0, "bash"), tool(1, "bash"), tool(2, "read"), tool(3, "read")]
    assert encode_jsonl(HEADER, by_name) == jsonl(*by_name)
    named_then_not = [tool(0, "bash"), tool(1, None), tool(2, None), tool(3, None)]
    assert rows(encode_jsonl(HEADER, named_then_not))[1]["data"] == {
        "turn": 1,
        "step": 1,
        "index": 0,
        "dt": [1, 1],
        "id": "c1",
        "args": ["x", "x", "x"],
    }
    by_id = [tool(0, None, "a"), tool(1, None, "a"), tool(2, None, "b")]
    assert encode_jsonl(HEADER, by_id) == jsonl(*by_id)


@pytest.mark.parametrize(
    "odd",
    [
        b'{"seq":1,"time":2,"type":"assistant/chunk","data":{"turn":1,"step":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"x","extra":true}}}',
        b'{"seq":1,"time":2,"type":"assistant/chunk","data":{"turn":1,"step":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"x"},"note":1}}',
        b'{"seq":1,"time":2,"type":"assistant/chunk","data":{"step":1,"turn":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"x"}}}',
        b'{"type":"assistant/chunk","seq":1,"time":2,"data":{"turn":1,"step":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"x"}}}',
        b'{"seq":1,"time":2,"type":"assistant/chunk","data":{"turn":1,"step":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"\\u0078"}}}',
        b'{"seq":1,"time":2,"type":"assistant/chunk","ignorable":true,"data":{"turn":1,"step":1,'
        b'"chunk":{"type":"text-delta","index":0,"text":"x"}}}',
        b'{"seq":1, "time":2,"type":"assistant/chunk","data":{"turn":1,"step":1,"chunk":{"type":"text-delta",'
        b'"index":0,"text":"x"}}}',
    ],
    ids=["chunk-key", "data-key", "key-order", "envelope-order", "escape", "envelope-key", "whitespace"],
)
def test_an_event_that_is_not_exactly_a_plain_delta_is_not_packed(odd: bytes) -> None:
    events = [delta(0, 1), odd, delta(2, 3)]
    assert encode_jsonl(HEADER, events) == jsonl(*events)
    assert parse_jsonl(encode_jsonl(HEADER, events)).events == events


def test_positional_deltas_pack_without_seq0_time0_and_with_zero_dt() -> None:
    events = [delta(None, part=p) for p in "abcd"]
    data = encode_jsonl(HEADER, events)
    assert data == jsonl(
        b'{"type":"text-chunks","data":{"turn":1,"step":1,"index":0,"dt":[0,0,0],"texts":["a","b","c","d"]}}'
    )
    assert parse_jsonl(data).events == events


def test_a_long_stream_packs_into_maximal_runs() -> None:
    events = [
        event("turn/start", {"turn": 1}, 0),
        *(delta(s, 100 + s, index=0, kind="reasoning-delta") for s in range(1, 6)),
        *(delta(s, 100 + s, index=1) for s in range(6, 9)),
        event("turn/end", {"turn": 1, "reason": {"kind": "completed"}}, 9),
    ]
    data = encode_jsonl(HEADER, events)
    assert [r["type"] for r in rows(data)] == ["turn/start", "reasoning-chunks", "text-chunks", "turn/end"]
    assert list(pack_events(events)) == data.split(b"\n")[1:-1]
    assert parse_jsonl(data).events == events


def test_pack_false_writes_every_event_as_its_own_line() -> None:
    events = [delta(s, s) for s in range(4)]
    assert encode_jsonl(HEADER, events, pack=False) == jsonl(*events)


def test_an_event_with_a_newline_in_its_bytes_is_refused() -> None:
    with pytest.raises(InvalidEvent, match="index 1: its bytes hold a newline"):
        encode_jsonl(HEADER, [delta(0, 0), b'{"seq":1,\n"type":"x/y"}'])


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=4)


@st.composite
def chunk_streams(draw: st.DrawFn) -> tuple[list[bytes], bool]:
    """A stream of delta runs (of any length) and other events, with seqs or positional."""
    with_seq = draw(st.booleans())
    events: list[bytes] = []
    time = 1_700_000_000_000
    for _ in range(draw(st.integers(0, 6))):
        seq = len(events) if with_seq else None
        if draw(st.integers(0, 3)) == 0:
            events.append(event("step/start", {"turn": 1, "step": 1}, seq, time if with_seq else None))
            continue
        kind = draw(st.sampled_from(["text-delta", "reasoning-delta", "tool-call-delta"]))
        index = draw(st.integers(0, 1))
        name = draw(st.sampled_from([None, "bash"]))
        for _ in range(draw(st.integers(1, 6))):
            time += draw(st.integers(-1 if draw(st.booleans()) else 0, 50))
            seq = len(events) if with_seq else None
            events.append(
                delta(
                    seq,
                    time if with_seq else None,
                    kind=kind,
                    index=index,
                    name=name,
                    part=draw(_TEXT),
                )
            )
    return events, with_seq


@settings(max_examples=60)
@given(chunk_streams())
def test_packing_then_unpacking_gives_back_the_same_events_and_bytes(stream: tuple[list[bytes], bool]) -> None:
    events, with_seq = stream
    data = encode_jsonl(HEADER, events)
    log = parse_jsonl(data)
    assert log.events == events
    assert log.torn is None and log.positional == (not with_seq or not events)
    assert encode_jsonl(log.header_raw, log.events) == data


# ---------------------------------------------------------------------------------------------- files


def seq_log(n: int) -> list[bytes]:
    events = [event("turn/start", {"turn": 1}, 0, 10)]
    events += [delta(s, 10 + s, part=f"t{s}") for s in range(1, n)]
    return events


def test_a_plain_file_round_trips_through_write_and_read(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    events = seq_log(10)
    write_jsonl(path, HEADER, events)
    assert path.read_bytes() == encode_jsonl(HEADER, events)
    log = read_jsonl(path)
    assert log.events == events and not log.compressed and log.header_raw == HEADER
    assert [p.name for p in tmp_path.iterdir()] == ["s.jsonl"]


def test_a_zstd_file_round_trips_and_holds_the_header_alone_in_its_first_frame(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl.zstd"
    events = seq_log(2500)
    write_jsonl(path, HEADER, events)
    raw = path.read_bytes()
    assert raw[:4] == b"\x28\xb5\x2f\xfd"
    first = zstandard.ZstdDecompressor().decompressobj()
    assert first.decompress(raw) == HEADER + b"\n"
    log = read_jsonl(path)
    assert log.compressed and log.torn is None and log.events == events
    assert zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(raw) == encode_jsonl(
        HEADER, events
    )


def test_compress_overrides_the_suffix_and_reading_goes_by_magic_bytes(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    write_jsonl(path, HEADER, seq_log(4), compress=True)
    assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    assert read_jsonl(path).events == seq_log(4)
    zpath = tmp_path / "p.zst"
    write_jsonl(zpath, HEADER, seq_log(4), compress=False)
    assert zpath.read_bytes().startswith(HEADER)
    assert read_jsonl(zpath).events == seq_log(4)


def _zstd_bytes(*chunks: bytes) -> bytes:
    cctx = zstandard.ZstdCompressor()
    return b"".join(cctx.compress(c) for c in chunks)


def test_a_truncated_zstd_file_still_yields_the_complete_lines_of_its_torn_frame(tmp_path: Path) -> None:
    rng = random.Random(7)
    events = [event("turn/start", {"turn": 1}, 0)]
    events += [event("x/y", {"noise": rng.randbytes(300).hex()}, s) for s in range(1, 1200)]
    frame2 = b"".join(e + b"\n" for e in events[:200])
    frame3 = b"".join(e + b"\n" for e in events[200:])
    raw = _zstd_bytes(HEADER + b"\n", frame2, frame3)
    path = tmp_path / "s.jsonl.zstd"
    path.write_bytes(raw[: len(raw) - len(raw) // 4])
    log = read_jsonl(path)
    assert 200 < len(log.events) < 1200
    assert log.events == events[: len(log.events)]
    assert log.torn is not None and "truncated" in log.torn.reason


def test_a_zstd_file_cut_at_a_frame_boundary_is_torn_without_dropping_lines(tmp_path: Path) -> None:
    lines = b"".join(e + b"\n" for e in seq_log(3))
    raw = _zstd_bytes(HEADER + b"\n", lines, lines)
    path = tmp_path / "s.jsonl.zstd"
    path.write_bytes(raw[: len(raw) - 1])
    log = read_jsonl(path)
    assert log.events == seq_log(3)
    assert log.torn is not None and log.torn.lines_dropped == 0 and "truncated" in log.torn.reason


def test_garbage_after_the_zstd_frames_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl.zstd"
    write_jsonl(path, HEADER, seq_log(5))
    with open(path, "ab") as f:
        f.write(b"\x00garbage")
    log = read_jsonl(path)
    assert log.events == seq_log(5)
    assert log.torn is not None and "not a zstd frame" in log.torn.reason


def test_skippable_zstd_frames_are_passed_over(tmp_path: Path) -> None:
    skippable = b"\x5a\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    lines = b"".join(e + b"\n" for e in seq_log(3))
    path = tmp_path / "s.jsonl.zstd"
    path.write_bytes(skippable + _zstd_bytes(HEADER + b"\n") + skippable + _zstd_bytes(lines))
    log = read_jsonl(path)
    assert log.events == seq_log(3) and log.torn is None


def test_an_empty_zstd_file_has_no_header(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl.zstd"
    path.write_bytes(b"")
    with pytest.raises(InvalidEvent, match="line 1"):
        read_jsonl(path)


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    write_jsonl(path, HEADER, seq_log(3))
    before = path.read_bytes()
    with pytest.raises(InvalidEvent):
        write_jsonl(path, HEADER, [*seq_log(3), b"{\n}"])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.jsonl"]


# ---------------------------------------------------------------------------------------------- append


@pytest.mark.parametrize("name", ["s.jsonl", "s.jsonl.zstd"])
def test_appended_events_are_read_back_after_the_old_ones(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    events = seq_log(6)
    write_jsonl(path, HEADER, events[:2])
    append_jsonl(path, events[2:4])
    append_jsonl(path, events[4:])
    append_jsonl(path, [])
    log = read_jsonl(path)
    assert log.events == events and log.torn is None


def test_appending_to_a_plain_file_with_a_torn_last_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(jsonl(event("turn/start", {"turn": 1}, 0)) + b'{"seq":1,"ty')
    before = path.read_bytes()
    with pytest.raises(CorruptLog, match="truncate_torn_tail"):
        append_jsonl(path, [turn_end(1)])
    assert path.read_bytes() == before


def test_a_torn_plain_file_is_truncated_to_its_last_good_line_then_appended(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    good = [event("turn/start", {"turn": 1}, 0), event("x/y", {}, 1)]
    path.write_bytes(jsonl(*good, b"{broken", b'{"seq":3,"ty', newline=False))
    log = read_jsonl(path)
    cut = truncate_torn_tail(path, log)
    assert cut.torn is not None and cut.torn.line == 4 and cut.torn.lines_dropped == 2
    assert path.read_bytes() == jsonl(*good)
    append_jsonl(path, [turn_end(2)])
    assert read_jsonl(path).events == [*good, turn_end(2)]
    assert truncate_torn_tail(path).torn is None


def test_a_torn_zstd_file_is_rewritten_without_its_torn_part_then_appended(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl.zstd"
    good = seq_log(5)
    path.write_bytes(_zstd_bytes(HEADER + b"\n", b"".join(e + b"\n" for e in good) + b'{"seq":5,"ty') + b"junk")
    log = truncate_torn_tail(path)
    assert log.torn is not None and log.torn.line == 7
    fresh = read_jsonl(path)
    assert fresh.torn is None and fresh.events == good and fresh.compressed
    append_jsonl(path, [turn_end(5)])
    assert read_jsonl(path).events == [*good, turn_end(5)]


def test_a_header_without_its_newline_is_mended_by_truncation(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(HEADER)
    truncate_torn_tail(path)
    assert path.read_bytes() == HEADER + b"\n"
    append_jsonl(path, [event("turn/start", {"turn": 1}, 0)])
    assert read_jsonl(path).events == [event("turn/start", {"turn": 1}, 0)]


def test_a_corrupt_file_is_never_truncated(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(jsonl(event("turn/start", {"turn": 1}, 0), b"{broken", turn_end(2)))
    before = path.read_bytes()
    with pytest.raises(CorruptLog):
        truncate_torn_tail(path)
    assert path.read_bytes() == before


def test_truncating_a_file_that_changed_since_it_was_read_is_a_conflict(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(jsonl(event("turn/start", {"turn": 1}, 0), b"{torn", newline=False))
    log = read_jsonl(path)
    path.write_bytes(jsonl(event("turn/start", {"turn": 1}, 0), event("x/y", {}, 1), b"{torn", newline=False))
    with pytest.raises(Conflict):
        truncate_torn_tail(path, log)
    assert b"{torn" in path.read_bytes()


# ---------------------------------------------------------------------------------------------- fixtures


def test_all_81_fixtures_are_there_and_read_from_disk_unchanged() -> None:
    assert len(FIXTURE_FILES) == 81
    log = read_jsonl(FIXTURE_FILES[0])
    assert log.torn is None and log.positional and not log.compressed and log.events


@pytest.fixture(scope="module")
def fixture_logs() -> dict[str, tuple[bytes, JsonlLog]]:
    out = {}
    for path in FIXTURE_FILES:
        data = normalize(path.read_bytes())
        out[path.name] = (data, parse_jsonl(data))
    return out


@pytest.mark.parametrize("name", [p.name for p in FIXTURE_FILES])
def test_a_dsh_fixture_reads_as_a_positional_log_of_valid_events(
    name: str, fixture_logs: dict[str, tuple[bytes, JsonlLog]]
) -> None:
    data, log = fixture_logs[name]
    assert log.torn is None and log.positional and log.header.version == 0
    assert log.header_raw == data.split(b"\n", 1)[0]
    for position, raw in enumerate(log.events):
        decode_event(raw, position)


@pytest.mark.parametrize("name", [p.name for p in FIXTURE_FILES])
def test_a_dsh_fixture_repacks_to_the_same_events(name: str, fixture_logs: dict[str, tuple[bytes, JsonlLog]]) -> None:
    data, log = fixture_logs[name]
    repacked = encode_jsonl(log.header_raw, log.events)
    assert parse_jsonl(repacked).events == log.events
    # dsh packs the same runs: only the recorder's dt values (lost with the times) differ.
    assert repacked.count(b"\n") == data.count(b"\n")


def test_the_fixtures_survive_a_zstd_round_trip(
    tmp_path: Path, fixture_logs: dict[str, tuple[bytes, JsonlLog]]
) -> None:
    for name, (_, log) in fixture_logs.items():
        path = tmp_path / f"{name}.zstd"
        write_jsonl(path, log.header_raw, log.events)
        assert read_jsonl(path).events == log.events
        os.unlink(path)
