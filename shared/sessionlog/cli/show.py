"""Text a command prints that came from outside (a client, a provider, a record): shown as it is, never read as Rich
markup (`[bold]`, or `[/x]`, which made Rich raise), and with control characters escaped (`transcript_model`)."""

from __future__ import annotations

from rich.text import Text

from ..transcript_model import terminal_safe


def cell(value: object) -> Text:
    """A table cell or line of `value`'s text, taken literally."""
    return Text(terminal_safe(str(value)))


__all__ = ["cell"]
