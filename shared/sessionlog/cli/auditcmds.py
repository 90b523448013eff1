"""`sessionlog replay` (a step's chunk stream exactly as it arrived) and `sessionlog audit` (ledger and findings)."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..audit import audit_session, chunk_delays, parse_step, step_chunks
from ..contracts import REPORT
from ..errors import LogUnavailable
from ..events import BlockEndChunk, ReasoningDeltaChunk, TextDeltaChunk, ToolCallDeltaChunk
from ..log import SessionLog
from ..micro import call
from ..reader import read_raw_exchanges
from .logcmds import run_with_log
from .show import cell

REPORT_SUBJECT = REPORT.subject


def replay(
    session_id: Annotated[str, typer.Argument(help="The session.", show_default=False)],
    step: Annotated[str, typer.Option("--step", help="The step, as TURN.STEP (for example 2.1).", show_default=False)],
    realtime: Annotated[
        bool, typer.Option("--realtime", help="Wait between chunks as long as they took when they arrived.")
    ] = False,
    text: Annotated[
        bool,
        typer.Option("--text", help="Print what the chunks say (text, reasoning, tool arguments), not the events."),
    ] = False,
) -> None:
    """Print a step's chunk stream exactly as it arrived: one `assistant/chunk` event per line, as logged."""
    turn, number = parse_step(step)

    async def work(log: SessionLog) -> None:
        _, session, _ = await log.load(session_id)
        chunks = step_chunks(session, turn, number)
        if realtime and chunks and all(c.time is None for c in chunks):
            typer.echo("note: these chunks carry no times (a recorder snapshot); replaying without pauses", err=True)
        out = sys.stdout.buffer
        for delay, chunk in chunk_delays(chunks):
            if realtime and delay:
                await asyncio.sleep(delay)
            if text:
                piece = _chunk_text(chunk.data.chunk)
                if piece:
                    out.write(piece.encode())
            else:
                out.write(chunk.raw + b"\n")
            out.flush()
        if text:
            out.write(b"\n")
            out.flush()
        auditor = audit_session(session, session_id=session_id)
        report = auditor.step_report(turn, number)
        if report.delta_mismatches:
            typer.echo(
                f"note: the block-end chunks at {list(report.delta_mismatches)} differ from their deltas", err=True
            )

    run_with_log(work)


def _chunk_text(chunk: Any) -> str:
    if isinstance(chunk, (TextDeltaChunk, ReasoningDeltaChunk)):
        return str(chunk.text)
    if isinstance(chunk, ToolCallDeltaChunk):
        return str(chunk.arguments_delta)
    if isinstance(chunk, BlockEndChunk):
        return "\n"
    return ""


async def _local_report(log: SessionLog, session_id: str) -> dict[str, Any]:
    """The same report the service gives, computed here from the log and the raw stream."""
    _, session, _ = await log.load(session_id)
    raw = await read_raw_exchanges(log.nc, log.settings.raw_stream, session_id, timeout=log.settings.request_timeout_s)
    auditor = audit_session(session, raw, session_id=session_id, model_aliases=dict(log.settings.provider_model_map))
    report: dict[str, Any] = msgspec.to_builtins(auditor.report())
    return report


def audit(
    session_id: Annotated[str, typer.Argument(help="The session.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    local: Annotated[
        bool, typer.Option("--local", help="Compute the report here instead of asking the token-auditor.")
    ] = False,
) -> None:
    """Print a session's token ledger (per model), the provider's (from the raw tee) and the auditor's findings;
    exit with status 1 when there are findings."""

    async def work(log: SessionLog) -> dict[str, Any]:
        if not local:
            try:
                reply = await call(
                    log.nc, REPORT_SUBJECT, {"session": session_id}, timeout=log.settings.request_timeout_s * 2
                )
                assert isinstance(reply, dict)
                return reply
            except LogUnavailable as err:
                if "no service answers" not in err.message:
                    raise
                typer.echo("note: no token-auditor answers; computing the report locally", err=True)
        return await _local_report(log, session_id)

    report = run_with_log(work)
    if as_json:
        sys.stdout.buffer.write(msgspec.json.encode(report) + b"\n")
        sys.stdout.buffer.flush()
    else:
        print_report(report, Console())
    if report.get("findings"):
        raise typer.Exit(1)


def print_report(report: dict[str, Any], console: Console) -> None:
    ledger = report.get("ledger") or {}
    table = Table(title=f"token ledger of {report.get('session')}")
    for column in ("provider", "model", "requests", "input", "output", "cache read", "cache write", "reasoning"):
        numeric = column not in ("provider", "model")
        table.add_column(column, justify="right" if numeric else "left", overflow="fold")

    def row(provider: str, model: str, tokens: dict[str, int]) -> list[Text | str]:
        keys = (
            "requests",
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
        )
        return [cell(provider), cell(model), *(f"{tokens.get(k, 0):,}" for k in keys)]

    for entry in ledger.get("by_model", []):
        table.add_row(*row(entry["provider"], entry["model"], entry["tokens"]))
    table.add_row(*row("total", "", ledger.get("total", {})), style="bold")
    provider = report.get("provider_ledger")
    if provider:  # every exchange the provider answered, from the raw tee
        for entry in provider.get("by_model", []):
            table.add_row(*row("provider (raw tee)", entry["model"], entry["tokens"]), style="dim")
        table.add_row(*row("provider total", "", provider.get("total", {})), style="dim")
    console.print(table)
    for difference in report.get("ledger_difference") or ():
        console.print(Text("ledger difference: ") + cell(difference))
    findings = report.get("findings") or []
    if not findings:
        console.print(
            f"no findings ({report.get('events', 0)} events, {report.get('chunks', 0)} chunks, "
            f"{report.get('raw_exchanges', 0)} raw exchanges)"
        )
        return
    found = Table(title=f"{len(findings)} findings")
    for column in ("code", "seq", "step", "what"):
        found.add_column(column, overflow="fold")
    for finding in findings:
        where = f"{finding['turn']}.{finding['step']}" if finding.get("turn") is not None else ""
        found.add_row(cell(finding["code"]), str(finding.get("seq", "")), where, cell(finding["message"]))
    console.print(found)


def register(app: typer.Typer) -> None:
    app.command()(replay)
    app.command()(audit)


__all__ = ["audit", "print_report", "register", "replay"]
