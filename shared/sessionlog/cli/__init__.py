"""The `sessionlog` command line's library commands and its runner. Every refusal prints one line,
`error CODE at seq N: message`, never a traceback; bad arguments print one `error: ...` line and exit 2.

The commands that start services (`serve`, `up`, `demo`, `repair-session`) are added above the library, by
`services.cli`, which is what the `sessionlog` console script and `python -m sessionlog` run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import typer
from typer.exceptions import TyperException

from ..errors import SessionLogError
from . import auditcmds, files, logcmds, quarantinecmds

Register = Callable[[typer.Typer], None]


def new_app(more: Sequence[Register] = ()) -> typer.Typer:
    """The command line: the library's commands, with `more` (a layer above adds its own) listed after the log's."""
    app = logcmds.command_group(
        "sessionlog",
        "An event-sourced session log for fleets of LLM agents, on NATS JetStream.",
        pretty_exceptions_enable=False,
    )
    for register in (files.register, logcmds.register, *more, auditcmds.register, quarantinecmds.register):
        register(app)
    return app


app = new_app()


def error_line(err: SessionLogError) -> str:
    where = f" at seq {err.seq}" if err.seq is not None else ""
    return f"error {err.code}{where}: {err.message}"


def main(argv: list[str] | None = None, command_line: typer.Typer | None = None) -> int:
    """Run `command_line` (the library's commands unless given); returns the exit code (0 ok, 1 refused, 2 bad
    arguments)."""
    try:
        result = (command_line or app)(args=argv, standalone_mode=False)
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
