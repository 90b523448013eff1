"""The `sessionlog` command line as installed: the library's commands (`sessionlog.cli`) plus the ones that start
services (`serve`, `up`, `demo`, `repair-session`), which only this layer above both may import."""

from __future__ import annotations

import sys

from sessionlog.cli import main as run_command_line
from sessionlog.cli import new_app

from . import servecmds, upcmds

app = new_app([servecmds.register, upcmds.register])


def main(argv: list[str] | None = None) -> int:
    """Console entry point (`sessionlog`); returns the exit code (0 ok, 1 refused, 2 bad arguments)."""
    return run_command_line(argv, app)


def run() -> None:
    sys.exit(main())
