"""JSONL session files (SPEC section 9): the header line, torn tails, plain and zstd.

This module owns the file form of a log and nothing else. Reading turns a file into its `SessionHeader`
(`header.py`) and the list of event bytes, unpacking `text-chunks`, `reasoning-chunks` and `tool-call-chunks`
rows (`chunkrows.py`) into one `assistant/chunk` event per element and deciding where a torn write began.
Writing packs exactly the runs SPEC section 9 allows, atomically, as plain JSONL or as dsh's zstd framing (the
header line alone in the first frame, then frames of event lines). Each line is parsed only as far as `type` and
`seq`; the events themselves are validated by the session (`events.decode_event`), never here.

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
from pathlib import Path
from typing import Any, Final

import msgspec
import zstandard
from msgspec import UNSET, Struct

from .chunkrows import ROW_CHUNK_TYPES, ChunkRow, MalformedRow, decode_row, pack_events, unpack_row
from .errors import Conflict, CorruptLog, EventTooDeep, InvalidEvent
from .events import MAX_EVENT_DEPTH
from .header import SessionHeader, decode_header, encode_header

PathLike = str | os.PathLike[str]

ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
ZSTD_SUFFIXES: Final = (".zstd", ".zst")
ZSTD_FRAME_LINES: Final = 1000
ZSTD_FRAME_BYTES: Final = 1 << 20


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


_line_decoder: Final = msgspec.json.Decoder(_Line)
_TURN_END_RE: Final = re.compile(rb'"type"\s*:\s*"turn/end"')


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
        row: ChunkRow | None = None
        if kind in ROW_CHUNK_TYPES:
            try:
                row = decode_row(line, kind)
            except MalformedRow as exc:
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
            unpack_row(row, events)

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


__all__ = [
    "JsonlLog",
    "PathLike",
    "SessionHeader",
    "TornTail",
    "append_jsonl",
    "decode_header",
    "encode_header",
    "encode_jsonl",
    "pack_events",
    "parse_jsonl",
    "read_jsonl",
    "truncate_torn_tail",
    "write_jsonl",
]
