"""The structural rules of SPEC section 6: which turn and step are open, their numbering, and the tool calls and
results of the open step. `Structure.check` refuses (`STRUCTURE_INVALID`) without changing anything; `commit`
records an event the session has accepted."""

from __future__ import annotations

from typing import Final

from msgspec import UNSET

from .errors import StructureInvalid
from .events import STEP_SCOPED_TYPES, TURN_SCOPED_TYPES, Event, ToolCallBlock, ToolCallData, ToolResultData
from .toolpairs import result_call_id

TOOL_NOT_STARTED: Final = "TOOL_NOT_STARTED"
TOOL_OUTCOME_UNKNOWN: Final = "TOOL_OUTCOME_UNKNOWN"  # the other synthetic result code (SPEC 7)
# The kinds `Structure.commit` records something of; the session skips the call for every other event.
COMMITTED_KINDS: Final = frozenset(
    {"turn/start", "turn/end", "step/start", "step/end", "tool/call", "assistant/message", "tool/result"}
)


class Step:
    """What the open step has recorded: tool calls, results, and the calls its messages announced."""

    __slots__ = ("announced", "calls", "number", "results")

    def __init__(self, number: int) -> None:
        self.number = number
        self.calls: dict[str, int] = {}  # callId -> seq of its tool/call
        self.results: set[str] = set()
        self.announced: dict[str, ToolCallBlock] = {}  # by call id, in the order first announced

    def copy(self) -> Step:
        other = Step(self.number)
        other.calls = dict(self.calls)
        other.results = set(self.results)
        other.announced = dict(self.announced)
        return other


class Structure:
    """The open turn and step, and the last numbers used (turns rise by one; steps restart at 1 in each turn)."""

    __slots__ = ("last_step", "last_turn", "open_step", "open_turn")

    def __init__(self) -> None:
        self.open_turn: int | None = None
        self.last_turn = 0
        self.open_step: Step | None = None
        self.last_step = 0

    def copy(self) -> Structure:
        other = Structure()
        other.open_turn, other.last_turn, other.last_step = self.open_turn, self.last_turn, self.last_step
        other.open_step = self.open_step.copy() if self.open_step is not None else None
        return other

    def check(self, event: Event, replace: bool) -> None:
        kind = event.type
        seq = event.seq
        if kind == "turn/start":
            if self.open_turn is not None:
                raise StructureInvalid(f"turn/start while turn {self.open_turn} is open", seq=seq)
            if event.data.turn != self.last_turn + 1:
                raise StructureInvalid(
                    f"turn/start: expected turn {self.last_turn + 1}, got {event.data.turn}", seq=seq
                )
        elif kind == "turn/end":
            self._expect_turn(event, event.data.turn)
            if self.open_step is not None:
                raise StructureInvalid(
                    f"turn/end while step {self.open_step.number} of turn {self.open_turn} is open", seq=seq
                )
        elif kind == "step/start":
            self._expect_turn(event, event.data.turn)
            if self.open_step is not None:
                raise StructureInvalid(f"step/start while step {self.open_step.number} is open", seq=seq)
            if event.data.step != self.last_step + 1:
                raise StructureInvalid(
                    f"step/start: expected step {self.last_step + 1} of turn {self.open_turn}, got {event.data.step}",
                    seq=seq,
                )
        elif kind == "step/end":
            self.expect_step(event)
        elif replace:
            if self.open_turn is None:
                raise StructureInvalid(f"{kind} replace outside a turn (a compaction needs an open turn)", seq=seq)
        elif kind in STEP_SCOPED_TYPES:
            self.expect_step(event)
            if kind == "tool/call":
                data: ToolCallData = event.data
                assert self.open_step is not None
                if data.call_id in self.open_step.calls:
                    raise StructureInvalid(
                        f"tool/call {data.call_id!r} already recorded at seq {self.open_step.calls[data.call_id]}",
                        seq=seq,
                    )
            elif kind == "tool/result":
                self._check_tool_result(event)
        elif kind in TURN_SCOPED_TYPES:
            if self.open_turn is None:
                raise StructureInvalid(f"{kind} must be written inside a turn", seq=seq)
        elif kind == "session/end-seed" and self.open_turn is not None:
            raise StructureInvalid(f"session/end-seed inside open turn {self.open_turn}", seq=seq)

    def _check_tool_result(self, event: Event) -> None:
        data: ToolResultData = event.data
        step = self.open_step
        assert step is not None
        call_id = result_call_id(event)
        if call_id in step.results:
            raise StructureInvalid(
                f"tool/result for call {call_id!r} is already recorded in step {step.number}", seq=event.seq
            )
        not_started = data.error is not UNSET and data.error.code == TOOL_NOT_STARTED
        if call_id not in step.calls and not not_started:
            raise StructureInvalid(
                f"tool/result for call {call_id!r} has no earlier tool/call in turn {self.open_turn} "
                f"step {step.number}",
                seq=event.seq,
            )

    def _expect_turn(self, event: Event, turn: int) -> None:
        if self.open_turn is None:
            raise StructureInvalid(f"{event.type} names turn {turn} but no turn is open", seq=event.seq)
        if turn != self.open_turn:
            raise StructureInvalid(f"{event.type} names turn {turn} but turn {self.open_turn} is open", seq=event.seq)

    def expect_step(self, event: Event) -> None:
        """Refuse a step-scoped event that does not name the open turn and step."""
        data = event.data
        self._expect_turn(event, data.turn)
        if self.open_step is None:
            raise StructureInvalid(
                f"{event.type} names step {data.step} but no step of turn {self.open_turn} is open",
                seq=event.seq,
            )
        if data.step != self.open_step.number:
            raise StructureInvalid(
                f"{event.type} names step {data.step} but step {self.open_step.number} is open",
                seq=event.seq,
            )

    def commit(self, event: Event, replace: bool) -> None:
        """Record an accepted event of one of `COMMITTED_KINDS` (`replace`: it replaced surface nodes)."""
        kind = event.type
        step = self.open_step
        if kind == "assistant/message":
            if step is not None:
                # A replacement's calls are announced too (dsh's closers register them); a call announced again
                # keeps its first place, so it is closed once.
                for block in event.data.message.content:
                    if isinstance(block, ToolCallBlock) and block.id not in step.announced:
                        step.announced[block.id] = block
        elif kind == "tool/result":
            if not replace and step is not None:
                step.results.add(result_call_id(event))
        elif kind == "turn/start":
            self.open_turn = self.last_turn = event.data.turn
            self.last_step = 0
        elif kind == "turn/end":
            self.open_turn = None
        elif kind == "step/start":
            self.open_step = Step(event.data.step)
            self.last_step = event.data.step
        elif kind == "step/end":
            self.open_step = None
        elif kind == "tool/call":
            assert step is not None
            step.calls[event.data.call_id] = event.seq
