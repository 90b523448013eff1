"""JSONL session files (SPEC section 9): the header line, packed chunk rows, torn tails, plain and zstd.

This module owns the file form of a log and nothing else. Reading turns a file into its `SessionHeader`
and the list of event bytes, unpacking `text-chunks`, `reasoning-chunks` and `tool-call-chunks` rows into
one `assistant/chunk` event per element and deciding where a torn write began. Writing packs exactly the
runs SPEC section 9 allows, atomically, as plain JSONL or as dsh's zstd framing (the header line alone in
the first frame, then frames of event lines). Each line is parsed only as far as `type` and `seq`; the
events themselves are validated by the session (`events.decode_event`), never here.

Decisions (2026-05):
- A file's first event decides its style: with a `seq` every event must carry its position as `seq`;
  without one (a recorder snapshot) no event may carry one and each event's seq is its position. An event
  that breaks its file's style is a seq gap.
- `good_size` is the offset just past the last good line, in the file for plain files and in the
  decompressed stream for zstd files; `truncate_torn_tail` cuts plain files there and rewrites zstd files.
- A header line without its newline is kept (it parsed), and reported as a torn tail with nothing dropped,
  so that `truncate_torn_tail` mends it before anything is appended.
- `append_jsonl` packs runs inside each appended batch (a run split across batches stays partly unpacked;
  unpacking gives the same events either way) and refuses a plain file whose last line is unfinished.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import suppress
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Final, NamedTuple

import msgspec
import zstandard
from msgspec import UNSET, Meta, Struct, UnsetType

from .errors import Conflict, CorruptLog, EventTooDeep, InvalidEvent, UnsupportedVersion
from .events import MAX_EVENT_DEPTH, encode_new_event

NonNegInt = Annotated[int, Meta(ge=0)]
PathLike = str | os.PathLike[str]

SUPPORTED_VERSION: Final = 0
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
ZSTD_SUFFIXES: Final = (".zstd", ".zst")
MIN_PACKED_RUN: Final = 3
ZSTD_FRAME_LINES: Final = 1000
ZSTD_FRAME_BYTES: Final = 1 << 20

ROW_CHUNK_TYPES: Final[dict[str, str]] = {
    "text-chunks": "text-delta",
    "reasoning-chunks": "reasoning-delta",
    "tool-call-chunks": "tool-call-delta",
}
_CHUNK_ROW_TYPES: Final = {chunk: row for row, chunk in ROW_CHUNK_TYPES.items()}
_TOOL_DELTA: Final = "tool-call-delta"

# ---------------------------------------------------------------------------------------------- header


class SessionHeader(
    Struct,
    frozen=True,
    kw_only=True,
    rename="camel",
    omit_defaults=True,
    tag="session",
    tag_field="type",
):
    """The header line. `type` is the tag ("session"), so it is checked on decode and always encoded."""

    version: int
    id: str
    created_at: int
    cwd: str | UnsetType = UNSET
    parent_session: str | UnsetType = UNSET
    seed_length: NonNegInt | UnsetType = UNSET
    origin: Any = UNSET
    delegation_depth: NonNegInt = 0
    agent_preset: Any = UNSET

    @property
    def type(self) -> str:
        return "session"


class _HeaderOut(Struct, kw_only=True, rename="camel", omit_defaults=True, tag="session", tag_field="type"):
    """The header as this library writes it: SPEC key order, `delegationDepth` always present."""

    version: int
    id: str
    created_at: int
    cwd: str | UnsetType = UNSET
    parent_session: str | UnsetType = UNSET
    seed_length: int | UnsetType = UNSET
    origin: Any = UNSET
    delegation_depth: int
    agent_preset: Any = UNSET


class _HeaderProbe(Struct, gc=False):
    type: Any = UNSET
    version: Any = UNSET


def encode_header(header: SessionHeader) -> bytes:
    """The bytes of a new header line (no newline), in the key order of SPEC section 9."""
    return _encoder.encode(_HeaderOut(**msgspec.structs.asdict(header)))


def decode_header(line: bytes) -> SessionHeader:
    """Validate a header line. Raises `InvalidEvent` (seq None; bytes that are not UTF-8 too), `EventTooDeep`
    (nested past the recursion limit) or `UnsupportedVersion`."""
    if not line.isascii():
        try:
            line.decode()
        except UnicodeDecodeError as exc:
            raise InvalidEvent(f"line 1: the session header is not valid UTF-8 (byte {exc.start})") from None
    try:
        probe = _header_probe_decoder.decode(line)
    except msgspec.DecodeError:
        raise InvalidEvent(
            f'line 1: expected a session header {{"type":"session","version":0,...}}, got {_preview(line)}'
        ) from None
    except RecursionError:  # no header field nests; only a hostile file gets this far
        raise EventTooDeep("line 1: the session header nests deeper than a reader can follow") from None
    if probe.type != "session":
        got = "no type" if probe.type is UNSET else f"type {probe.type!r}"
        raise InvalidEvent(f'line 1: expected a session header (type "session"), got {got}')
    if type(probe.version) is not int:
        raise InvalidEvent(f"line 1: session header version must be an integer, got {probe.version!r}")
    if probe.version != SUPPORTED_VERSION:
        raise UnsupportedVersion(
            f"line 1: session header version {probe.version}; this build reads version {SUPPORTED_VERSION}"
        )
    try:
        return _header_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(f"line 1: session header: {exc}") from None
    except msgspec.DecodeError as exc:  # invalid UTF-8 in a string the probe skipped
        raise InvalidEvent(f"line 1: session header: {exc}") from None
    except RecursionError:
        raise EventTooDeep("line 1: the session header nests deeper than a reader can follow") from None


# ---------------------------------------------------------------------------------------------- results


class TornTail(Struct, frozen=True):
    """What reading dropped: the torn write began at 1-based `line` (the line after the last one when only
    the file's end needs mending), where event `position` would stand; `lines_dropped` lines were cut."""

    line: int
    position: int
    reason: str
    lines_dropped: int


class JsonlLog(Struct, frozen=True):
    """A read file: the header, its original bytes, and each event's bytes in order (rows unpacked).

    `positional` is True when no event carries a `seq` (each event's seq is its index; also for a log with
    no events). `good_size` is the offset just past the last good line (in the decompressed stream when
    `compressed`). Do not mutate `events`.
    """

    header: SessionHeader
    header_raw: bytes
    events: list[bytes]
    positional: bool
    torn: TornTail | None
    good_size: int
    compressed: bool = False


# ---------------------------------------------------------------------------------------------- lines


class _Line(Struct, gc=False):
    """The minimal view of a line: its type and seq (any JSON, checked by the reader)."""

    type: str
    seq: Any = UNSET


class _RowData(Struct, gc=False):
    turn: int
    step: int
    index: int
    dt: list[int]
    texts: list[str] | UnsetType = UNSET
    args: list[str] | UnsetType = UNSET
    id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET


class _Row(Struct, gc=False):
    type: str
    data: _RowData
    seq0: int | UnsetType = UNSET
    time0: int | UnsetType = UNSET


class _Unparsable(Exception):
    pass


_encoder: Final = msgspec.json.Encoder()
_header_probe_decoder: Final = msgspec.json.Decoder(_HeaderProbe)
_header_decoder: Final = msgspec.json.Decoder(SessionHeader)
_line_decoder: Final = msgspec.json.Decoder(_Line)
_row_decoder: Final = msgspec.json.Decoder(_Row)
_TURN_END_RE: Final = re.compile(rb'"type"\s*:\s*"turn/end"')


def _preview(line: bytes, limit: int = 60) -> str:
    if not line:
        return "an empty line"
    text = line[:limit].decode("utf-8", "replace")
    return repr(text + ("..." if len(line) > limit else ""))


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


def _decode_row(line: bytes, row_type: str) -> _Row:
    try:
        row = _row_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise _Unparsable(f"malformed {row_type} row: {exc}") from None
    data = row.data
    if row_type == "tool-call-chunks":
        members = data.args
        if data.id is UNSET:
            raise _Unparsable(f"malformed {row_type} row: no `id`")
    else:
        members = data.texts
    if members is UNSET:
        raise _Unparsable(f"malformed {row_type} row: no `{'args' if row_type == 'tool-call-chunks' else 'texts'}`")
    if not members:
        raise _Unparsable(f"malformed {row_type} row: no chunks")
    if len(data.dt) != len(members) - 1:
        raise _Unparsable(
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


def _unpack_row(row: _Row, out: list[bytes]) -> None:
    data = row.data
    chunk_type = ROW_CHUNK_TYPES[row.type]
    members = data.args if chunk_type == _TOOL_DELTA else data.texts
    assert not isinstance(members, UnsetType)  # _decode_row checked
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


def _holds_turn_end(line: bytes) -> bool:
    try:
        return _line_decoder.decode(line).type == "turn/end"
    except (msgspec.DecodeError, RecursionError):  # not a line the decoder reads: look for the type in its bytes
        return _TURN_END_RE.search(line) is not None


# ---------------------------------------------------------------------------------------------- reading


def parse_jsonl(data: bytes) -> JsonlLog:
    """Read a plain JSONL log from bytes. Raises `InvalidEvent`/`UnsupportedVersion` (header) or
    `CorruptLog` (a bad line or seq gap followed by a turn/end)."""
    return _parse(data, compressed=False, stream_problem=None)


def read_jsonl(path: PathLike) -> JsonlLog:
    """Read a `.jsonl` or zstd-framed `.jsonl.zstd` file (zstd is recognised by its magic bytes)."""
    raw = Path(path).read_bytes()
    if _is_zstd(raw, Path(path)):
        data, problem = _decompress_frames(raw)
        return _parse(data, compressed=True, stream_problem=problem)
    return _parse(raw, compressed=False, stream_problem=None)


def _is_zstd(raw: bytes, path: Path) -> bool:
    # A zstd-named file cut inside its first magic number is zstd too (and then simply has no header).
    return _is_frame_start(raw, 0) or (path.suffix in ZSTD_SUFFIXES and ZSTD_MAGIC.startswith(raw))


def _is_frame_start(raw: bytes, offset: int) -> bool:
    magic = raw[offset : offset + 4]
    # Skippable frames (0x184D2A50..5F) are legal zstd; the decompressor passes over them.
    return magic == ZSTD_MAGIC or (len(magic) == 4 and magic[1:] == b"\x2a\x4d\x18" and magic[0] & 0xF0 == 0x50)


def _decompress_frames(raw: bytes) -> tuple[bytes, str | None]:
    """Decompress frame by frame; return what decoded and, if the stream ended badly, why."""
    dctx = zstandard.ZstdDecompressor()
    view = memoryview(raw)
    out: list[bytes] = []
    offset, size = 0, len(raw)
    while offset < size:
        if not _is_frame_start(raw, offset):
            return b"".join(out), f"the bytes at offset {offset} are not a zstd frame"
        dobj = dctx.decompressobj()
        pos = offset
        # Growing pieces keep `unused_data` (a copy of the unread rest of a piece) small for small frames.
        piece = 4096
        try:
            while not dobj.eof:
                if pos >= size:
                    return b"".join(out), f"the last zstd frame (at offset {offset}) is truncated"
                chunk = view[pos : pos + piece]
                out.append(dobj.decompress(chunk))
                pos += len(chunk)
                piece = min(piece * 2, 1 << 22)
        except zstandard.ZstdError as exc:
            return b"".join(out), f"the zstd frame at offset {offset} is damaged ({exc})"
        offset = pos - len(dobj.unused_data)
    return b"".join(out), None


def _parse(data: bytes, *, compressed: bool, stream_problem: str | None) -> JsonlLog:
    if not data:
        raise InvalidEvent('line 1: expected a session header {"type":"session",...}, the file is empty')
    lines = data.split(b"\n")
    complete = data.endswith(b"\n")
    if complete:
        lines.pop()
    header_raw = lines[0]
    header = decode_header(header_raw)
    count = len(lines)
    partial = -1 if complete else count - 1

    events: list[bytes] = []
    append = events.append
    decode = _line_decoder.decode
    with_seq: bool | None = None
    tear: tuple[int, str] | None = None
    for i in range(1, count):
        line = lines[i]
        if i == partial:
            tear = (i, "the last line has no trailing newline (a write that did not finish)")
            break
        try:
            head = decode(line)
        except msgspec.DecodeError as exc:
            tear = (i, "an empty line" if not line else f"not an event line ({exc})")
            break
        except RecursionError:  # far deeper than any event may nest (events.MAX_EVENT_DEPTH)
            raise EventTooDeep(f"line {i + 1} nests more than {MAX_EVENT_DEPTH} levels of JSON", seq=i - 1) from None
        kind = head.type
        seq: Any = head.seq
        row: _Row | None = None
        if kind in ROW_CHUNK_TYPES:
            try:
                row = _decode_row(line, kind)
            except _Unparsable as exc:
                tear = (i, str(exc))
                break
            seq = row.seq0
        has_seq = seq is not UNSET
        if with_seq is None:
            with_seq = has_seq
        position = len(events)
        if with_seq:
            if not has_seq:
                tear = (i, f"the event has no seq where seq {position} was expected (a gap)")
                break
            if type(seq) is not int or seq != position:
                tear = (i, f"seq {seq!r} where seq {position} was expected (a gap)")
                break
        elif has_seq:
            tear = (i, f"the event carries seq {seq!r} in a log whose events carry none (a gap)")
            break
        if row is None:
            append(line)
        else:
            _unpack_row(row, events)

    torn: TornTail | None = None
    good_size = len(data)
    if tear is not None:
        at, reason = tear
        for later in range(at + 1, count):
            if _holds_turn_end(lines[later]):
                raise CorruptLog(
                    f"line {at + 1}: {reason}; line {later + 1} after it holds a turn/end, so this is "
                    "corruption, not a torn tail",
                    seq=len(events),
                )
        if stream_problem is not None:
            reason = f"{reason}; {stream_problem}"
        torn = TornTail(line=at + 1, position=len(events), reason=reason, lines_dropped=count - at)
        good_size = sum(map(len, lines[:at])) + at
    elif partial == 0 or stream_problem is not None:
        # Nothing is dropped, but the file must be mended before anything is appended to it: a header
        # without its newline, or zstd frames that end badly after complete lines.
        reasons = ["the header line has no trailing newline"] if partial == 0 else []
        reasons += [stream_problem] if stream_problem is not None else []
        torn = TornTail(line=count + 1, position=len(events), reason="; ".join(reasons), lines_dropped=0)
    return JsonlLog(
        header=header,
        header_raw=header_raw,
        events=events,
        positional=not with_seq,
        torn=torn,
        good_size=good_size,
        compressed=compressed,
    )


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


def _checked(events: Iterable[bytes]) -> Iterator[bytes]:
    for index, raw in enumerate(events):
        if b"\n" in raw:
            raise InvalidEvent(f"event at index {index}: its bytes hold a newline, which no JSONL line can")
        yield raw


def _lines(events: Iterable[bytes], pack: bool) -> Iterator[bytes]:
    checked = _checked(events)
    return pack_events(checked) if pack else checked


def _check_header(header_raw: bytes) -> None:
    if b"\n" in header_raw:
        raise InvalidEvent("line 1: the header bytes hold a newline, which no JSONL line can")


# ---------------------------------------------------------------------------------------------- writing


def encode_jsonl(header_raw: bytes, events: Iterable[bytes], *, pack: bool = True) -> bytes:
    """A whole plain JSONL file: the header line, then the (packed) event lines, each ending in a newline."""
    _check_header(header_raw)
    out = [header_raw]
    out.extend(_lines(events, pack))
    out.append(b"")
    return b"\n".join(out)


def _zstd_frames(lines: Iterable[bytes], cctx: zstandard.ZstdCompressor) -> Iterator[bytes]:
    batch: list[bytes] = []
    size = 0
    for line in lines:
        batch.append(line)
        size += len(line) + 1
        if len(batch) >= ZSTD_FRAME_LINES or size >= ZSTD_FRAME_BYTES:
            batch.append(b"")
            yield cctx.compress(b"\n".join(batch))
            batch, size = [], 0
    if batch:
        batch.append(b"")
        yield cctx.compress(b"\n".join(batch))


def _zstd_file(header_raw: bytes, lines: Iterable[bytes]) -> Iterator[bytes]:
    cctx = zstandard.ZstdCompressor()
    yield cctx.compress(header_raw + b"\n")
    yield from _zstd_frames(lines, cctx)


def _plain_file(header_raw: bytes, lines: Iterable[bytes]) -> Iterator[bytes]:
    yield header_raw + b"\n"
    batch: list[bytes] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= ZSTD_FRAME_LINES:
            batch.append(b"")
            yield b"\n".join(batch)
            batch = []
    if batch:
        batch.append(b"")
        yield b"\n".join(batch)


def _wants_zstd(path: Path) -> bool:
    return path.suffix in ZSTD_SUFFIXES


def write_jsonl(
    path: PathLike,
    header_raw: bytes,
    events: Iterable[bytes],
    *,
    compress: bool | None = None,
    pack: bool = True,
) -> None:
    """Write a whole log atomically (temp file in the same directory, fsync, rename). `compress` None
    chooses zstd by the `.zstd`/`.zst` suffix. On any error the target is left as it was."""
    target = Path(path)
    _check_header(header_raw)
    zstd = _wants_zstd(target) if compress is None else compress
    lines = _lines(events, pack)
    _atomic_write(target, _zstd_file(header_raw, lines) if zstd else _plain_file(header_raw, lines))


def _atomic_write(target: Path, chunks: Iterable[bytes]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            for chunk in chunks:
                tmp.write(chunk)
            tmp.flush()
            os.fsync(tmp.fileno())
        try:
            mode = os.stat(target).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; some platforms and filesystems cannot open or fsync a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def append_jsonl(path: PathLike, events: Iterable[bytes], *, pack: bool = True) -> None:
    """Durably append events to an existing log (plain: appended lines; zstd: one new frame per batch of
    lines), then fsync. Truncate a torn tail first (`truncate_torn_tail`); a plain file that ends inside a
    line is refused with `CorruptLog`, since appending would glue a new event to the torn one."""
    target = Path(path)
    lines = list(_lines(events, pack))
    if not lines:
        return
    with open(target, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            raise InvalidEvent(f"line 1: {target.name} is empty; a log starts with its header (write_jsonl)")
        f.seek(0)
        zstd = _is_zstd(f.read(4), target)
        if zstd:
            f.write(b"".join(_zstd_frames(lines, zstandard.ZstdCompressor())))
        else:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                raise CorruptLog(f"{target.name} ends inside a line (a torn tail); truncate_torn_tail before appending")
            lines.append(b"")
            f.write(b"\n".join(lines))
        f.flush()
        os.fsync(f.fileno())


def truncate_torn_tail(path: PathLike, log: JsonlLog | None = None) -> JsonlLog:
    """Read the file and, if it has a torn tail, cut it off durably: a plain file is truncated at
    `good_size`, a zstd file is rewritten atomically with its good lines kept byte for byte. Returns the log
    as read (its `torn` says what was cut).

    `log`, when given, is what the caller read earlier (and planned its appends on): if the file no longer
    reads the same, `Conflict` is raised and nothing is cut. `CorruptLog` (a bad line that is not at the
    tail) also leaves the file alone.
    """
    target = Path(path)
    raw = target.read_bytes()
    compressed = _is_zstd(raw, target)
    if compressed:
        data, problem = _decompress_frames(raw)
    else:
        data, problem = raw, None
    fresh = _parse(data, compressed=compressed, stream_problem=problem)
    if log is not None and (
        fresh.good_size != log.good_size or fresh.torn != log.torn or len(fresh.events) != len(log.events)
    ):
        raise Conflict(f"{target.name} changed since it was read; read it again before truncating its torn tail")
    if fresh.torn is None:
        return fresh
    good = data[: fresh.good_size]
    if compressed:
        lines = good.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        _atomic_write(target, _zstd_file(lines[0], lines[1:]))
        return fresh
    with open(target, "r+b") as f:
        f.truncate(fresh.good_size)
        if not good.endswith(b"\n"):
            f.seek(fresh.good_size)
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return fresh
