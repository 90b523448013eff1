"""Packed chunk rows (SPEC section 9), both ways: a `text-chunks`, `reasoning-chunks` or `tool-call-chunks` row
stands for a run of `assistant/chunk` delta events, and unpacking it gives back exactly their bytes.

This module owns the row form and nothing else: `unpack_row` turns a row into one delta event per element,
`pack_events` finds every maximal run that packs losslessly (`jsonl.py` reads and writes the files).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from itertools import pairwise
from typing import Any, Final, NamedTuple

import msgspec
from msgspec import UNSET, Struct, UnsetType

from .events import encode_new_event

MIN_PACKED_RUN: Final = 3

ROW_CHUNK_TYPES: Final[dict[str, str]] = {
    "text-chunks": "text-delta",
    "reasoning-chunks": "reasoning-delta",
    "tool-call-chunks": "tool-call-delta",
}
_CHUNK_ROW_TYPES: Final = {chunk: row for row, chunk in ROW_CHUNK_TYPES.items()}
_TOOL_DELTA: Final = "tool-call-delta"

# ---------------------------------------------------------------------------------------------- unpacking


class _RowData(Struct, gc=False):
    turn: int
    step: int
    index: int
    dt: list[int]
    texts: list[str] | UnsetType = UNSET
    args: list[str] | UnsetType = UNSET
    id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET


class ChunkRow(Struct, gc=False):
    """A packed row as read (`decode_row` checks that its members and `dt` agree)."""

    type: str
    data: _RowData
    seq0: int | UnsetType = UNSET
    time0: int | UnsetType = UNSET


class MalformedRow(Exception):
    """A line of a row type that is not a well-formed row (a torn write, to the reader)."""


_encoder: Final = msgspec.json.Encoder()
_row_decoder: Final = msgspec.json.Decoder(ChunkRow)


def encode_delta_event(
    chunk_type: str,
    turn: int,
    step: int,
    index: int,
    part: str,
    *,
    call_id: str | None = None,
    name: str | None = None,
    seq: int | None,
    time: int | None,
) -> bytes:
    """The bytes of one unpacked delta: `assistant/chunk` with data {turn, step, chunk} in that order."""
    chunk: dict[str, Any]
    if chunk_type == _TOOL_DELTA:
        chunk = {"type": chunk_type, "index": index, "id": call_id}
        if name is not None:
            chunk["name"] = name
        chunk["argumentsDelta"] = part
    else:
        chunk = {"type": chunk_type, "index": index, "text": part}
    return encode_new_event("assistant/chunk", {"turn": turn, "step": step, "chunk": chunk}, seq=seq, time=time)


def decode_row(line: bytes, row_type: str) -> ChunkRow:
    try:
        row = _row_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise MalformedRow(f"malformed {row_type} row: {exc}") from None
    data = row.data
    if row_type == "tool-call-chunks":
        members = data.args
        if data.id is UNSET:
            raise MalformedRow(f"malformed {row_type} row: no `id`")
    else:
        members = data.texts
    if members is UNSET:
        raise MalformedRow(f"malformed {row_type} row: no `{'args' if row_type == 'tool-call-chunks' else 'texts'}`")
    if not members:
        raise MalformedRow(f"malformed {row_type} row: no chunks")
    if len(data.dt) != len(members) - 1:
        raise MalformedRow(
            f"malformed {row_type} row: `dt` has {len(data.dt)} entries for {len(members)} chunks "
            f"(expected {len(members) - 1})"
        )
    return row


# A placeholder no JSON string of a real chunk equals; delta events are spliced around its encoding.
_PART: Final = "\x00sessionlog-part\x00"
_PART_JSON: Final = msgspec.json.encode(_PART)


@lru_cache(maxsize=1024)
def _delta_template(
    chunk_type: str, turn: int, step: int, index: int, call_id: str | None, name: str | None
) -> tuple[bytes, bytes] | None:
    """The bytes of a delta event before and after its part (without the opening brace), or None.

    The deltas of a row share every byte but seq, time and the part, so the event is encoded once through
    `encode_new_event` around a placeholder and then spliced: this doubles the speed of unpacking.
    """
    template = encode_delta_event(chunk_type, turn, step, index, _PART, call_id=call_id, name=name, seq=None, time=None)
    pieces = template.split(_PART_JSON)
    if len(pieces) != 2 or not template.startswith(b'{"type":'):
        return None
    return pieces[0][1:], pieces[1]


def _envelope(seq: int | None, time: int | None) -> bytes:
    """The opening of an event in `encode_new_event`'s key order: seq, time, then type."""
    if seq is None:
        return b"{" if time is None else b'{"time":%d,' % time
    if time is None:
        return b'{"seq":%d,' % seq
    return b'{"seq":%d,"time":%d,' % (seq, time)


def unpack_row(row: ChunkRow, out: list[bytes]) -> None:
    data = row.data
    chunk_type = ROW_CHUNK_TYPES[row.type]
    members = data.args if chunk_type == _TOOL_DELTA else data.texts
    assert not isinstance(members, UnsetType)  # decode_row checked
    call_id = None if isinstance(data.id, UnsetType) else data.id
    name = None if isinstance(data.name, UnsetType) else data.name
    seq0 = None if isinstance(row.seq0, UnsetType) else row.seq0
    time = None if isinstance(row.time0, UnsetType) else row.time0
    dt = data.dt
    template = _delta_template(chunk_type, data.turn, data.step, data.index, call_id, name)
    append = out.append
    if template is None:
        for k, part in enumerate(members):
            if k and time is not None:
                time += dt[k - 1]
            seq = None if seq0 is None else seq0 + k
            append(
                encode_delta_event(
                    chunk_type, data.turn, data.step, data.index, part, call_id=call_id, name=name, seq=seq, time=time
                )
            )
        return
    body, tail = template
    parts = _encoder.encode_lines(members).split(b"\n")
    for k in range(len(members)):
        if k and time is not None:
            time += dt[k - 1]
        append(b"".join((_envelope(None if seq0 is None else seq0 + k, time), body, parts[k], tail)))


# ---------------------------------------------------------------------------------------------- packing


class _DeltaChunk(Struct, rename="camel", gc=False):
    type: str
    index: int
    text: str | UnsetType = UNSET
    id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    arguments_delta: str | UnsetType = UNSET


class _DeltaData(Struct, gc=False):
    turn: int
    step: int
    chunk: _DeltaChunk


class _DeltaEvent(Struct, gc=False):
    type: str
    data: _DeltaData
    seq: int | UnsetType = UNSET
    time: int | UnsetType = UNSET


_delta_decoder: Final = msgspec.json.Decoder(_DeltaEvent)
_CHUNK_MARK: Final = b'"type":"assistant/chunk"'


class _Member(NamedTuple):
    """A delta event that unpacking would reproduce byte for byte: it may join a packed row."""

    chunk_type: str
    turn: int
    step: int
    block_index: int
    call_id: str | None
    name: str | None
    seq: int | None
    time: int | None
    part: str
    raw: bytes


def _member(raw: bytes) -> _Member | None:
    # Only an event in the canonical layout can pack, and there the type follows seq and time at once:
    # looking at the first bytes keeps big non-chunk events (tool results) from being scanned whole.
    if raw.find(_CHUNK_MARK, 0, 128) < 0:
        return None
    try:
        event = _delta_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    chunk = event.data.chunk
    call_id: str | None = None
    name: str | None = None
    if event.type != "assistant/chunk" or chunk.type not in _CHUNK_ROW_TYPES:
        return None
    if chunk.type == _TOOL_DELTA:
        if isinstance(chunk.id, UnsetType) or isinstance(chunk.arguments_delta, UnsetType):
            return None
        part, call_id = chunk.arguments_delta, chunk.id
        name = None if isinstance(chunk.name, UnsetType) else chunk.name
    elif isinstance(chunk.text, UnsetType):
        return None
    else:
        part = chunk.text
    seq = None if isinstance(event.seq, UnsetType) else event.seq
    time = None if isinstance(event.time, UnsetType) else event.time
    turn, step, index = event.data.turn, event.data.step, chunk.index
    # The one test that makes packing lossless: any extra key, other key order or other spelling differs.
    template = _delta_template(chunk.type, turn, step, index, call_id, name)
    if template is None:
        rebuilt = encode_delta_event(
            chunk.type, turn, step, index, part, call_id=call_id, name=name, seq=seq, time=time
        )
    else:
        rebuilt = b"".join((_envelope(seq, time), template[0], _encoder.encode(part), template[1]))
    if rebuilt != raw:
        return None
    return _Member(chunk.type, turn, step, index, call_id, name, seq, time, part, raw)


def _continues(prev: _Member, cur: _Member) -> bool:
    if prev[:6] != cur[:6]:
        return False
    if (prev.seq is None) != (cur.seq is None) or (prev.time is None) != (cur.time is None):
        return False
    if prev.seq is not None and cur.seq != prev.seq + 1:
        return False
    return prev.time is None or cur.time is None or cur.time >= prev.time


def _encode_row(run: list[_Member]) -> bytes:
    first = run[0]
    # A run has times on all its members or on none (`_continues`).
    times = [m.time for m in run if m.time is not None]
    dt = [cur - prev for prev, cur in pairwise(times)] if times else [0] * (len(run) - 1)
    parts = [m.part for m in run]
    data: dict[str, Any] = {"turn": first.turn, "step": first.step, "index": first.block_index, "dt": dt}
    if first.chunk_type == _TOOL_DELTA:
        data["id"] = first.call_id
        if first.name is not None:
            data["name"] = first.name
        data["args"] = parts
    else:
        data["texts"] = parts
    row: dict[str, Any] = {"type": _CHUNK_ROW_TYPES[first.chunk_type]}
    if first.seq is not None:
        row["seq0"] = first.seq
    if first.time is not None:
        row["time0"] = first.time
    row["data"] = data
    return _encoder.encode(row)


def _flush(run: list[_Member]) -> Iterator[bytes]:
    if len(run) >= MIN_PACKED_RUN:
        yield _encode_row(run)
    else:
        for member in run:
            yield member.raw


def pack_events(events: Iterable[bytes]) -> Iterator[bytes]:
    """The lines that stand for `events`: every maximal run of at least three packable deltas (consecutive
    seqs, same turn, step, block index, and id and name for tool calls) becomes one chunk row; every other
    event is its own bytes. Unpacking the result gives back exactly `events`."""
    run: list[_Member] = []
    for raw in events:
        member = _member(raw)
        if member is not None and run and _continues(run[-1], member):
            run.append(member)
            continue
        yield from _flush(run)
        if member is None:
            run = []
            yield raw
        else:
            run = [member]
    yield from _flush(run)
