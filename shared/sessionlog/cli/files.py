"""Offline commands on JSONL files: check, derive, transcript, repair, fork. No server is involved."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from ..errors import InvalidBoundary, SessionAlreadyExists, SessionNotFound
from ..fork import plan_fork
from ..ids import check_session_id
from ..jsonl import JsonlLog, append_jsonl, read_jsonl, truncate_torn_tail, write_jsonl
from ..repair import interrupted_turn_closers
from ..session import Session, messages_json
from ..transcript import build_transcript, logged_entries, transcript_plain

FileArg = Annotated[Path, typer.Argument(help="A session log: .jsonl or .jsonl.zstd", show_default=False)]
AtOpt = Annotated[
    int | None, typer.Option("--at", help="Use the prefix ending at this seq (inclusive).", show_default=False)
]


def load(path: Path, at: int | None = None) -> tuple[JsonlLog, Session]:
    """Read a file and validate every event; the prefix up to `at` (inclusive) when given."""
    if not path.exists():
        raise SessionNotFound(f"no session log at {path}")
    log = read_jsonl(path)
    events = log.events
    if at is not None:
        if at < 0 or at >= len(events):
            raise InvalidBoundary(
                f"--at {at} is outside the log (seqs 0..{len(events) - 1})" if events else f"--at {at}: log is empty"
            )
        events = events[: at + 1]
    return log, Session(events)


def _write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def check(file: FileArg) -> None:
    """Validate a log; print a one-line summary, or the first violation on stderr (exit 1)."""
    log, session = load(file)
    turns = session.last_turn
    state = f"turn {session.open_turn} open" if session.open_turn is not None else "no open turn"
    torn = f"torn tail dropped at line {log.torn.line} ({log.torn.reason})" if log.torn is not None else "no torn tail"
    typer.echo(f"ok: {len(session)} events, {turns} turns, {state}, {torn}")


def derive(file: FileArg, at: AtOpt = None) -> None:
    """Print the derived messages (what the model sees) as one JSON array."""
    _, session = load(file, at)
    _write(messages_json(session.derive_messages()) + b"\n")


def transcript(
    file: FileArg,
    at: AtOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="A JSON array; each entry carries its seq.")] = False,
) -> None:
    """Print the transcript as the user saw it (the UI's transcript as text; compaction never removes a line)."""
    log, session = load(file, at)
    if as_json:
        _write(msgspec.json.encode(logged_entries(session)) + b"\n")
    else:
        typer.echo(transcript_plain(build_transcript(session, log.header_raw)), nl=False)


def repair(
    file: FileArg,
    at: AtOpt = None,
    write: Annotated[bool, typer.Option("--write", help="Append the closers to the file, durably.")] = False,
) -> None:
    """Print the closers of a turn a crash left open (SPEC section 7) as JSONL; nothing when none is open."""
    if write and at is not None:
        raise typer.BadParameter("--write works on the whole file only; drop --at")
    log, session = load(file, at)
    closers = interrupted_turn_closers(session)
    for closer in closers:
        session.append(closer)  # our own closers pass the same gate as any event
    if write:
        if log.torn is not None:
            truncate_torn_tail(file, log)
        if closers:
            append_jsonl(file, closers)
    _write(b"".join(c + b"\n" for c in closers))


def fork(
    file: FileArg,
    at: AtOpt = None,
    new_id: Annotated[str, typer.Option("--id", help="The child session's id.", show_default=False)] = "",
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Where to write the child's JSONL.")] = None,
) -> None:
    """Write a child session: the prefix up to --at (inclusive) and a session/end-seed (SPEC section 8)."""
    if not new_id:
        raise typer.BadParameter("--id is required")
    if out is None:
        raise typer.BadParameter("-o/--out is required")
    check_session_id(new_id)
    log, session = load(file)
    if out.exists():
        raise SessionAlreadyExists(f"{out} already exists; a fork never overwrites a session")
    now = int(time.time() * 1000)
    plan = plan_fork(session, at, now_ms=now)
    header = plan.child_header(child_id=new_id, parent=log.header, created_at=now)
    write_jsonl(out, header.encode(), plan.events)
    typer.echo(f"forked {log.header.id} at seq {plan.boundary} into {new_id}: {len(plan.events)} events -> {out}")


def register(app: typer.Typer) -> None:
    for command in (check, derive, transcript, repair, fork):
        app.command()(command)
