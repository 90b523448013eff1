"""The `sessionlog` command line. Every refusal prints one line, `error CODE at seq N: message`, never a
traceback; bad arguments print one `error: ...` line and exit 2."""

from __future__ import annotations

import sys

import click
import typer

from ..errors import SessionLogError
from . import files, logcmds

app = typer.Typer(
    name="sessionlog",
    help="An event-sourced session log for fleets of LLM agents, on NATS JetStream.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
files.register(app)
logcmds.register(app)


def error_line(err: SessionLogError) -> str:
    where = f" at seq {err.seq}" if err.seq is not None else ""
    return f"error {err.code}{where}: {err.message}"


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (0 ok, 1 refused, 2 bad arguments)."""
    try:
        result = app(args=argv, standalone_mode=False)
    except SessionLogError as err:
        print(error_line(err), file=sys.stderr)
        return 1
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.exceptions.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except click.UsageError as err:
        print(f"error: {err.format_message()}", file=sys.stderr)
        return 2
    except click.ClickException as err:
        print(f"error: {err.format_message()}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"error: {err.strerror or err}: {err.filename}" if err.filename else f"error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def run() -> None:
    sys.exit(main())
