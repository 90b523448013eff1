"""The `sessionlog` command line. Every refusal prints one line, `error CODE at seq N: message`, never a
traceback; bad arguments print one `error: ...` line and exit 2."""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from ..errors import SessionLogError
from . import auditcmds, files, logcmds, quarantinecmds, servecmds, upcmds

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
servecmds.register(app)
upcmds.register(app)
auditcmds.register(app)
quarantinecmds.register(app)


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
    except typer.Exit as done:
        return int(done.exit_code)
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except TyperException as err:
        text = err.format_message() if hasattr(err, "format_message") else str(err)
        if type(err).__name__ == "NoArgsIsHelpError":
            print(text)
            return 2
        print(f"error: {' '.join(text.split())}", file=sys.stderr)
        return int(getattr(err, "exit_code", 2))
    except OSError as err:
        where = f": {err.filename}" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def run() -> None:
    sys.exit(main())
