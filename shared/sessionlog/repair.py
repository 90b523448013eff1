"""Closing a turn that a crash left open (SPEC section 7), from the log alone.

`interrupted_turn_closers` is a pure function: the same log always gives the same closers, byte for byte.
The split between the two codes rests on the writer's checkpoint: a `tool/call` is flushed durably before the
tool body starts, so a durable call means the tool may have run (outcome unknown), and no call means it never
started. Only this path ever writes a `turn/end` with reason `interrupted`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from .events import (
    Event,
    Interrupted,
    Message,
    Source,
    StepData,
    TextBlock,
    ToolError,
    ToolResultBlock,
    ToolResultData,
    TurnEndData,
    encode_new_event,
)
from .session import TOOL_NOT_STARTED, TOOL_OUTCOME_UNKNOWN, Session

# 2026-12-02: the texts are this project's own words; changing them changes every future closer's bytes.
OUTCOME_UNKNOWN_TEXT: Final = (
    "This tool call was interrupted after it was recorded, and no result was saved, so whether it ran and "
    "what it did is unknown. Retry it only if it is read-only or idempotent. If it could have side effects, "
    "check the external state or ask the user before doing it again."
)
NOT_STARTED_TEXT: Final = (
    "This tool call was interrupted before it started, so it did not run. Retry it if it is still needed."
)


def interrupted_turn_closers(log: Session | Iterable[bytes | Event]) -> tuple[bytes, ...]:
    """The events that close the log's open turn, in order; empty when no turn is open.

    1. one synthetic tool/result per announced call of the open step that has none (announcement order),
    2. step/end if a step is open, 3. turn/end with reason interrupted. Seqs continue the log (in a log
    without seqs they stay positional), and `time` is the last event's.
    """
    session = log if isinstance(log, Session) else Session(log)
    if session.open_turn is None:
        return ()
    turn = session.open_turn
    time = session.last_time
    with_seq = session.has_seqs
    seq = len(session)
    out: list[bytes] = []

    def emit(event_type: str, data: object, **surface: object) -> None:
        nonlocal seq
        out.append(encode_new_event(event_type, data, seq=seq if with_seq else None, time=time, **surface))
        seq += 1

    step = session.open_step
    if step is not None:
        for call in step.announced.values():
            if call.id in step.results:
                continue
            call_seq = step.calls.get(call.id)
            unknown = call_seq is not None
            message = Message(
                id=f"interrupted-tool-result-{call.id}-{seq}",
                role="user",
                source=Source(kind="tool", call_id=call.id),
                content=(
                    ToolResultBlock(
                        tool_call_id=call.id,
                        is_error=True,
                        content=(TextBlock(OUTCOME_UNKNOWN_TEXT if unknown else NOT_STARTED_TEXT),),
                    ),
                ),
            )
            error = (
                ToolError(name="ToolOutcomeUnknownError", code=TOOL_OUTCOME_UNKNOWN)
                if unknown
                else ToolError(name="ToolNotStartedError", code=TOOL_NOT_STARTED)
            )
            data = ToolResultData(turn=turn, step=step.number, message=message, error=error)
            if unknown:
                emit("tool/result", data, surface_op="append", source_event_seqs=[call_seq])
            else:
                emit("tool/result", data, surface_op="append")
        emit("step/end", StepData(turn=turn, step=step.number))
    emit("turn/end", TurnEndData(turn=turn, reason=Interrupted()))
    return tuple(out)
