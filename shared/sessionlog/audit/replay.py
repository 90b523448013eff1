"""Replaying one step: its chunks in log order, each with the delay it originally came after."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import InvalidStep
from ..events import Event
from ..session import Session


def parse_step(text: str) -> tuple[int, int]:
    """`T.S` -> (turn, step)."""
    turn, dot, step = text.partition(".")
    if not dot or not turn.isdigit() or not step.isdigit() or int(turn) < 1 or int(step) < 1:
        raise InvalidStep(f"--step must be TURN.STEP (both from 1, for example 2.1), got {text!r}")
    return int(turn), int(step)


def step_chunks(session: Session, turn: int, step: int) -> list[Event]:
    """Every `assistant/chunk` of one step, in the order they were logged."""
    chunks = [e for e in session if e.type == "assistant/chunk" and e.data.turn == turn and e.data.step == step]
    if not chunks and not any(e.type == "step/start" and e.data.turn == turn and e.data.step == step for e in session):
        raise InvalidStep(f"the session has no step {turn}.{step}")
    return chunks


def chunk_delays(chunks: Sequence[Event]) -> Iterator[tuple[float, Event]]:
    """Each chunk with the seconds to wait before it to replay the step at its original pace (0 without times)."""
    previous: int | None = None
    for chunk in chunks:
        delay = 0.0
        if chunk.time is not None and previous is not None:
            delay = max(0.0, (chunk.time - previous) / 1000)
        if chunk.time is not None:
            previous = chunk.time
        yield delay, chunk
