"""`sessionlog serve NAME|all`, the commands that call services (`repair-session`), and `scripted-provider`, the
offline provider that a gateway can forward to."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated

import typer

from sessionlog import contracts
from sessionlog.cli.logcmds import run_with_log
from sessionlog.micro import ask
from sessionlog.services import RunOptions
from sessionlog.settings import Settings

from ..stack import SERVICES, available, run_until_signalled


def serve(
    name: Annotated[str, typer.Argument(help=f"A service ({', '.join(SERVICES)}) or 'all'.", show_default=False)],
    from_seq: Annotated[
        int | None, typer.Option("--from-seq", help="Start projections at this stream sequence.")
    ] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Rebuild projections from stream seq 1.")] = False,
) -> None:
    """Run one service (or all of them) until Ctrl-C."""
    names = available() if name == "all" else [name]
    if name != "all" and name not in SERVICES:
        raise typer.BadParameter(f"unknown service {name!r}; choose one of {', '.join(SERVICES)} or 'all'")
    if from_seq is not None and from_seq < 1:
        raise typer.BadParameter("--from-seq must be a stream sequence of at least 1")
    options = RunOptions(from_seq=from_seq, rebuild=rebuild)

    def ready(stack: object) -> None:
        typer.echo(f"serving {', '.join(names)} (Ctrl-C stops)", err=True)

    asyncio.run(run_until_signalled(names, Settings(), options, ready))


def repair_session(
    session_id: Annotated[str, typer.Argument(help="The session whose open turn to close.", show_default=False)],
) -> None:
    """Ask the repairer to close a session's open turn now (refused while a live writer holds it)."""

    async def work(log: object) -> object:
        from sessionlog.log import SessionLog

        assert isinstance(log, SessionLog)
        request = contracts.SessionRequest(session_id)
        return await ask(log.nc, contracts.CLOSE, request, timeout=log.settings.request_timeout_s * 2)

    reply = run_with_log(work)
    assert isinstance(reply, contracts.CloseReply)
    for closer in reply.closers:
        sys.stdout.buffer.write(bytes(closer) + b"\n")
    typer.echo(f"{session_id}: {len(reply.closers)} closers appended", err=True)


def scripted_provider(
    script: Annotated[
        Path,
        typer.Option(
            "--script", help="The replies: a JSON array or a JSONL file (one reply object a line).", show_default=False
        ),
    ],
    host: Annotated[str, typer.Option("--host", help="Bind address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port.")] = 8479,
    cycle: Annotated[bool, typer.Option("--cycle", help="Start again from the first reply when used up.")] = False,
) -> None:
    """Serve an offline OpenAI-compatible provider that answers from a script, until Ctrl-C.

    Point the gateway at it with SESSIONLOG_PROVIDER_BASE_URL=http://HOST:PORT/v1. The reply fields (text,
    tool_calls, usage, status, delays, ...) are described in services/gateway/scripted.py.
    """
    from services.gateway.scripted import ScriptError, run

    if not script.is_file():
        raise typer.BadParameter(f"no script file at {script}")
    if not 0 < port < 65536:
        raise typer.BadParameter(f"--port must be 1..65535, got {port}")
    try:
        run(script, host=host, port=port, cycle=cycle)
    except ScriptError as err:
        raise typer.BadParameter(f"{script}: {err}") from None


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command("repair-session")(repair_session)
    app.command("scripted-provider")(scripted_provider)
