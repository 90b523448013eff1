"""Commands that talk to the log on NATS: import, export, sessions, tail."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ..log import SessionLog
from ..settings import Settings
from .show import cell

T = TypeVar("T")


def command_group(name: str, help: str, **options: Any) -> typer.Typer:
    """A Typer as every command group of this command line is built: help when called without a command, no shell
    completion, plain help text (no rich markup)."""
    return typer.Typer(
        name=name, help=help, no_args_is_help=True, add_completion=False, rich_markup_mode=None, **options
    )


def run_with_log(work: Callable[[SessionLog], Awaitable[T]]) -> T:
    async def main() -> T:
        log = await SessionLog.connect(Settings())
        try:
            return await work(log)
        finally:
            await log.close()

    return asyncio.run(main())


def import_(
    file: Annotated[Path, typer.Argument(help="A .jsonl or .jsonl.zstd session log.", show_default=False)],
    session_id: Annotated[str | None, typer.Option("--id", help="Import under this id instead of the file's.")] = None,
) -> None:
    """Copy a JSONL log into the stream, lossless (no closers are appended)."""

    async def work(log: SessionLog) -> tuple[str, int]:
        return await log.import_file(file, session_id)

    sid, count = run_with_log(work)
    typer.echo(f"imported {sid}: {count} events")


def export(
    session_id: Annotated[str, typer.Argument(help="The session to export.", show_default=False)],
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Output file (.jsonl or .jsonl.zstd).")] = None,
) -> None:
    """Write a session from the stream as JSONL (stdout without -o)."""

    async def work(log: SessionLog) -> int:
        if out is not None:
            return await log.export_file(session_id, out)
        from ..jsonl import encode_jsonl

        header, session, _ = await log.load(session_id)
        sys.stdout.buffer.write(encode_jsonl(header, [e.raw for e in session]))
        sys.stdout.buffer.flush()
        return len(session)

    count = run_with_log(work)
    if out is not None:
        typer.echo(f"exported {session_id}: {count} events -> {out}")


def sessions(
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """List sessions: id, events, open turn, parent; newest first. A session that does not read is listed with
    its error (see `sessionlog quarantine check ID`)."""
    infos = run_with_log(lambda log: log.sessions())
    if as_json:
        import msgspec

        for info in infos:
            typer.echo(msgspec.json.encode(info).decode())
        return
    table = Table("session", "events", "open turn", "parent", "created", "error")
    table.columns[-1].no_wrap = True
    table.columns[-1].min_width = 18  # the longest code a listing shows (INVALID_SESSION_ID)
    for info in infos:
        events = "?" if info.error else str(info.events)  # a corrupt session: its last record did not read
        code = info.error.split(":", 1)[0] if info.error else ""  # the whole message: --json, or quarantine check
        table.add_row(cell(info.id), events, str(info.open_turn or ""), cell(info.parent or ""), _when(info.created_at),
                      cell(code))  # fmt: skip
    Console().print(table)


def _when(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def tail(
    session_id: Annotated[str, typer.Argument(help="The session to follow.", show_default=False)],
    from_seq: Annotated[int, typer.Option("--from-seq", help="Print events from this session seq on.")] = 0,
    limit: Annotated[int | None, typer.Option("--limit", help="Stop after this many events.")] = None,
) -> None:
    """Follow one session live: print its events (as logged, one per line) as they are appended."""

    async def work(log: SessionLog) -> None:
        if await log.header(session_id) is None:
            from ..errors import SessionNotFound

            raise SessionNotFound(f"session {session_id} not found")
        printed = 0
        async for record in log.reader.subscribe(session_id=session_id):
            for offset, raw in enumerate(record.events):
                if record.first_seq + offset < from_seq:
                    continue
                sys.stdout.buffer.write(raw + b"\n")
                sys.stdout.buffer.flush()
                printed += 1
                if limit is not None and printed >= limit:
                    return

    run_with_log(work)


def purge(
    session_id: Annotated[str, typer.Argument(help="The session to erase.", show_default=False)],
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: this erases the session for good.")] = False,
) -> None:
    """Admin only: erase one session (records, raw gateway bytes, header); every projection forgets it."""
    if not yes:
        raise typer.BadParameter("purge erases a session for good; add --yes to confirm")
    run_with_log(lambda log: log.purge(session_id))
    typer.echo(f"purged {session_id}")


def provision() -> None:
    """Create or verify the streams, buckets and object store (admin); a mismatch is reported, never changed."""

    async def work(log: SessionLog) -> str:
        from ..provision import provision as provision_stores

        return str(await provision_stores(log.js, log.settings))

    typer.echo(run_with_log(work))


def register(app: typer.Typer) -> None:
    app.command()(provision)
    app.command()(purge)
    app.command("import")(import_)
    app.command()(export)
    app.command()(sessions)
    app.command()(tail)
