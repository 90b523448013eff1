"""What the auditor holds per step: its `Attempt`s (a request and the chunks that answered it, assembled by
`sessionlog.assembly`) and the messages that took them."""

from __future__ import annotations

from typing import Final

from ..assembly import StreamAssembly
from ..events import Event
from ..session import DerivedMessages, FoldedHeader

_PARTIAL_FINISHES: Final = frozenset({"max-tokens", "error"})


class Attempt(StreamAssembly):
    """One request of a step and the chunks that answered it."""

    __slots__ = (
        "accounted",
        "chunk_seqs",
        "closed",
        "first_seq",
        "header",
        "matched",
        "message",
        "messages",
        "step",
        "turn",
        "whole",
    )

    def __init__(self, event: Event, messages: DerivedMessages, header: FoldedHeader | None) -> None:
        super().__init__()
        self.first_seq = event.seq
        self.turn: int = event.data.turn
        self.step: int = event.data.step
        self.chunk_seqs: list[int] = []
        self.closed = False
        self.message: Event | None = None  # the assistant/message that took it
        self.messages = messages  # what the prefix before the first chunk derives (the request, per the theorem)
        self.header = header
        self.matched = False  # a raw exchange was compared with it
        self.accounted = False
        self.whole = False  # a message that was not streamed: no chunks, its blocks as the message gives them

    @property
    def cut_short(self) -> bool:
        interrupted = self.message is not None and self.message.data.interrupted is True
        if self.whole:
            return interrupted
        return interrupted or self.finish is None or self.finish in _PARTIAL_FINISHES

    @property
    def model(self) -> tuple[str, str]:
        if self.header is not None:
            config = self.header.header.config
            return config.provider, config.model
        if self.message is not None:
            return source_model(self.message)
        return "unknown", "unknown"


def source_model(event: Event) -> tuple[str, str]:
    """The provider and model an assistant/message names as its source ("unknown" for what it leaves out)."""
    source = event.data.message.source
    provider = source.provider if isinstance(source.provider, str) else "unknown"
    model = source.model if isinstance(source.model, str) else "unknown"
    return provider, model


class Step:
    """One step: where it starts and ends, its attempts, and the seqs of its assistant messages."""

    __slots__ = ("attempts", "end_seq", "messages", "start_seq", "step", "turn")

    def __init__(self, turn: int, step: int, start_seq: int) -> None:
        self.turn = turn
        self.step = step
        self.start_seq = start_seq
        self.end_seq: int | None = None
        self.attempts: list[Attempt] = []
        self.messages: list[int] = []

    def untaken(self) -> Attempt | None:
        for attempt in reversed(self.attempts):
            if attempt.message is None:
                return attempt
        return None
