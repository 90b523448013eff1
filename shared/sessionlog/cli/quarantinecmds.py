"""`sessionlog quarantine`: the records projections set aside, and why one session does not read."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from ..log import SessionLog
from ..quarantine import Diagnosis, Quarantined, check_session, entries
from .logcmds import command_group, run_with_log
from .show import cell

quarantine = command_group("quarantine", "Records the projections quarantined, and why a session does not read.")


@quarantine.command("list")
def list_(
    projection: Annotated[
        str | None, typer.Option("--projection", help="Only this projection's (context-deriver, ui-replayer, ...).")
    ] = None,
    session: Annotated[str | None, typer.Option("--session", help="Only records of this session.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
) -> None:
    """Every quarantined record (projection, stream seq, session, reason), as the projections stored them."""

    async def work(log: SessionLog) -> list[Quarantined]:
        return await entries(
            log.nc, log.settings.kv_checkpoints, projection=projection, timeout=log.settings.request_timeout_s
        )

    found = [q for q in run_with_log(work) if session is None or q.session_id == session]
    if as_json:
        for entry in found:
            typer.echo(msgspec.json.encode(entry.to_dict()).decode())
        return
    Console(width=200).print(quarantine_table(found))


def quarantine_table(found: list[Quarantined]) -> Table:
    """The listing's table: a reason may quote the record it is about, so every cell is shown literally."""
    table = Table("projection", "stream seq", "session", "reason")
    for entry in found:
        table.add_row(cell(entry.projection), str(entry.stream_seq), cell(entry.session_id), cell(entry.reason))
    return table


@quarantine.command("check")
def check(
    session_id: Annotated[str, typer.Argument(help="The session (any id the stream holds).", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of text.")] = False,
) -> None:
    """Read one session from the stream, validating every event, and name the first record that does not read.
    Exits 1 when one does not."""

    async def work(log: SessionLog) -> Diagnosis:
        return await check_session(log.reader, session_id)

    found = run_with_log(work)
    if as_json:
        typer.echo(msgspec.json.encode(found.to_dict()).decode())
    elif found.error is None:
        typer.echo(f"{session_id}: readable, {found.events} events in {found.records} records")
    else:
        typer.echo(
            f"{session_id}: stream seq {found.stream_seq} ({found.subject}) does not read: {found.error}\n"
            f"  {found.events} events in {found.records} records read before it; projections quarantine this "
            "record and the session's later ones"
        )
    if found.error is not None:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(quarantine)
