"""A session: the append-only event list, its surface, its structure, and what is derived from them.

`Session.append` is the one gate every event passes. It decodes (`INVALID_EVENT`, `UNKNOWN_EVENT_TYPE`), then
checks the rules in the order of SPEC section 10 (contiguity, surface markers, surface op, replace range,
provenance, tool/result replacement, tool pairs, structure) without touching any state, and only then commits.
A refused append changes nothing.

Derived messages (SPEC section 5) are cached and extended as nodes are appended; a replace (a new generation)
drops the cache, which is rebuilt from the stored per-node messages on the next call, never by re-decoding.
Everything handed out is immutable: bytes, tuples and frozen Structs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, overload

import msgspec
from msgspec import UNSET

from .errors import (
    InvalidSurfaceOp,
    ProvenanceIncomplete,
    ProvenanceInvalid,
    ReplaceSplitsToolPair,
    SeqNotContiguous,
    StructureInvalid,
    SurfaceMarkerForbidden,
    SurfaceMarkerRequired,
    ToolResultReplaceInvalid,
)
from .events import (
    STEP_SCOPED_TYPES,
    SURFACE_TYPES,
    TURN_SCOPED_TYPES,
    AssistantMessageData,
    Event,
    Message,
    RequestHeader,
    RequestHeaderData,
    ToolCallBlock,
    ToolCallData,
    ToolResultBlock,
    ToolResultData,
    canonical_json,
    data_bytes,
    decode_event,
    message_bytes,
)
from .surface import ReplaceOp, ReplacePlan, Surface

TOOL_NOT_STARTED: Final = "TOOL_NOT_STARTED"
TOOL_OUTCOME_UNKNOWN: Final = "TOOL_OUTCOME_UNKNOWN"


class DerivedMessage:
    """One model-visible message: the surface node's seq and the message bytes exactly as logged.

    `canonical` (sorted keys, compact) is computed once, on first use, and kept: the gateway compares
    requests against it without re-encoding the whole context each time.
    """

    __slots__ = ("_canonical", "_message", "raw", "seq")

    def __init__(self, seq: int, raw: bytes, message: Message) -> None:
        self.seq = seq
        self.raw = raw
        self._message = message
        self._canonical: bytes | None = None

    @property
    def message(self) -> Message:
        return self._message

    @property
    def role(self) -> str:
        return self._message.role

    @property
    def canonical(self) -> bytes:
        if self._canonical is None:
            self._canonical = canonical_json(self.raw)
        return self._canonical

    def to_builtins(self) -> Any:
        return msgspec.json.decode(self.raw)

    def __repr__(self) -> str:
        return f"DerivedMessage(seq={self.seq}, role={self.role!r})"


class DerivedMessages(Sequence[DerivedMessage]):
    """An immutable view of the first `len` derived messages of one generation.

    Within a generation the backing list only grows, and a replace starts a new list, so a view handed out
    earlier never changes: derive is O(1) per call and shares every message with the live cache.
    """

    __slots__ = ("_items", "_len")

    def __init__(self, items: list[DerivedMessage], length: int) -> None:
        self._items = items
        self._len = length

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> DerivedMessage: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[DerivedMessage, ...]: ...
    def __getitem__(self, index: int | slice) -> DerivedMessage | tuple[DerivedMessage, ...]:
        if isinstance(index, slice):
            return tuple(self._items[: self._len][index])
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("derived message index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[DerivedMessage]:
        items = self._items
        for i in range(self._len):
            yield items[i]

    def extends(self, other: DerivedMessages) -> bool:
        """True when this view holds every message of `other`, in order, and maybe more after them. O(1): both are
        views of one generation's list, which only grows (a replace starts a new list), so no message is compared."""
        return self._items is other._items and other._len <= self._len

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DerivedMessages):
            return len(self) == len(other) and all(a.raw == b.raw for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(m.raw for m in self))

    def __repr__(self) -> str:
        return f"DerivedMessages({self._len} messages)"


class FoldedHeader(msgspec.Struct, frozen=True):
    """The latest `request/header` of a prefix: its seq, its typed view and the header object's bytes."""

    seq: int
    reason: str
    header: RequestHeader
    raw: bytes

    def to_builtins(self) -> dict[str, Any]:
        """The header as plain data, with an empty `system` or empty `tools` left out (SPEC section 5)."""
        out: dict[str, Any] = msgspec.json.decode(self.raw)
        if not out.get("system"):
            out.pop("system", None)
        if not out.get("tools"):
            out.pop("tools", None)
        return out


# A tool call and its result pair within one step (SPEC 6), so a pair is keyed by (turn, step, callId): providers
# that number calls per response reuse ids across turns.
PairKey = tuple[int, int, str]


def _call_ids(event: Event) -> tuple[PairKey, ...]:
    """Pair keys of the tool-call blocks an assistant/message announces."""
    if event.type != "assistant/message":
        return ()
    data = event.data
    return tuple((data.turn, data.step, b.id) for b in data.message.content if isinstance(b, ToolCallBlock))


def _result_key(event: Event) -> PairKey | None:
    if event.type != "tool/result":
        return None
    data = event.data
    return (data.turn, data.step, _result_call_id(event))


def _result_call_id(event: Event) -> str:
    block = event.data.message.content[0]
    assert isinstance(block, ToolResultBlock)
    return block.tool_call_id


def _parse_surface_op(event: Event) -> ReplaceOp | None:
    """None for "append", a ReplaceOp for a replace; anything else is `INVALID_SURFACE_OP`."""
    op = event.surface_op
    if op == "append":
        return None
    if (
        isinstance(op, dict)
        and op.keys() == {"op", "start", "end"}
        and op["op"] == "replace"
        and all(type(op[k]) is int and op[k] >= 0 for k in ("start", "end"))
    ):
        return ReplaceOp(start=op["start"], end=op["end"])
    raise InvalidSurfaceOp(
        f'{event.type}: surfaceOp must be "append" or exactly {{"op": "replace", "start", "end"}} with '
        f"non-negative integers, got {msgspec.json.encode(op).decode()}",
        seq=event.seq,
    )


def _parse_provenance(event: Event) -> tuple[int, ...] | None:
    seqs = event.source_event_seqs
    if seqs is UNSET:
        return None
    where = f"{event.type}: sourceEventSeqs"
    if not isinstance(seqs, list):
        raise ProvenanceInvalid(f"{where} must be an array, got {type(seqs).__name__}", seq=event.seq)
    if not seqs and event.type != "assistant/message":
        raise ProvenanceInvalid(f"{where} must not be empty (only assistant/message may)", seq=event.seq)
    seen: set[int] = set()
    for s in seqs:
        if type(s) is not int or s < 0:
            raise ProvenanceInvalid(f"{where} must hold non-negative integers, got {s!r}", seq=event.seq)
        if s >= event.seq:
            raise ProvenanceInvalid(f"{where} names seq {s}, which is not earlier than the event itself", seq=event.seq)
        if s in seen:
            raise ProvenanceInvalid(f"{where} names seq {s} twice", seq=event.seq)
        seen.add(s)
    return tuple(seqs)


class _Step:
    """What the open step has recorded: tool calls, results, and the calls its messages announced."""

    __slots__ = ("announced", "calls", "number", "results")

    def __init__(self, number: int) -> None:
        self.number = number
        self.calls: dict[str, int] = {}  # callId -> seq of its tool/call
        self.results: set[str] = set()
        self.announced: list[ToolCallBlock] = []


class Session:
    """One session's log, validated on every append; see the module docstring for the rules."""

    def __init__(self, events: Iterable[bytes | Event] = ()) -> None:
        self._events: list[Event] = []
        self.surface = Surface()
        self.open_turn: int | None = None
        self.last_turn = 0
        self.open_step: _Step | None = None
        self.last_step = 0
        self._messages: dict[int, DerivedMessage | None] = {}
        self._call_node: dict[PairKey, int] = {}  # pair -> seq of the assistant/message announcing it
        self._result_node: dict[PairKey, int] = {}  # pair -> seq of the latest tool/result carrying it
        self._header_seq: int | None = None
        self._header_seqs: list[int] = []  # every request/header, for the header in force at any seq
        self._derived: list[DerivedMessage] = []
        self._derived_nodes = 0
        self._derived_generation = 0
        self._derived_view: DerivedMessages | None = None
        self.extend(events)

    # ------------------------------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __getitem__(self, seq: int) -> Event:
        return self._events[seq]

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    @property
    def has_seqs(self) -> bool:
        """Whether events written to this log carry `seq` (False only for a recorder snapshot)."""
        return not self._events or self._events[-1].has_seq

    @property
    def last_time(self) -> int | None:
        for event in reversed(self._events):
            if event.time is not None:
                return event.time
        return None

    @property
    def turn_is_open(self) -> bool:
        return self.open_turn is not None

    @property
    def generation(self) -> int:
        return self.surface.generation

    def derive_messages(self) -> DerivedMessages:
        """The model-visible messages: each surface node mapped to its message (SPEC section 5)."""
        if self._derived_view is not None:
            return self._derived_view
        if self._derived_generation != self.surface.generation:
            self._derived = []  # a new list: views of the old generation keep theirs
            self._derived_nodes = 0
            self._derived_generation = self.surface.generation
        count = len(self.surface)
        for i in range(self._derived_nodes, count):
            message = self._messages[self.surface.node_at(i)]
            if message is not None:
                self._derived.append(message)
        self._derived_nodes = count
        self._derived_view = DerivedMessages(self._derived, len(self._derived))
        return self._derived_view

    def fold_request_header(self) -> FoldedHeader | None:
        """The latest request/header snapshot, or None when the log has none yet."""
        if self._header_seq is None:
            return None
        event = self._events[self._header_seq]
        data: RequestHeaderData = event.data
        return FoldedHeader(seq=event.seq, reason=data.reason, header=data.header, raw=_header_bytes(event.raw))

    def derive_at(self, seq: int) -> DerivedMessages:
        """The derived messages of the prefix ending at `seq` (inclusive), without replaying it: only the surface
        events up to `seq` are walked (their ops were checked when they were appended), so the cost is one derive,
        O(surface events), whatever the number of chunks and other events in between."""
        if seq >= len(self._events) - 1:
            return self.derive_messages()
        surface = Surface()
        for node in self._messages:  # surface events, in seq order
            if node > seq:
                break
            op = _parse_surface_op(self._events[node])
            if op is None:
                surface.append(node)
            else:
                surface.replace(surface.plan_replace(node, op))
        messages = self._messages
        items = [m for n in surface.nodes if (m := messages[n]) is not None]
        return DerivedMessages(items, len(items))

    @property
    def request_header_seqs(self) -> tuple[int, ...]:
        """The seqs of every `request/header` event, in order."""
        return tuple(self._header_seqs)

    def fold_request_header_at(self, seq: int) -> FoldedHeader | None:
        """The request/header in force at `seq` (inclusive): the latest one at or before it."""
        index = bisect.bisect_right(self._header_seqs, seq)
        if index == 0:
            return None
        event = self._events[self._header_seqs[index - 1]]
        data: RequestHeaderData = event.data
        return FoldedHeader(seq=event.seq, reason=data.reason, header=data.header, raw=_header_bytes(event.raw))

    def transcript(self) -> tuple[Event, ...]:
        """Append-origin surface events: what the user saw, untouched by any compaction."""
        return tuple(e for e in self._events if e.type in SURFACE_TYPES and e.surface_op == "append")

    def tool_call_event(self, call_id: str) -> int | None:
        """Seq of the tool/call recorded for `call_id` in the open step, if any."""
        return self.open_step.calls.get(call_id) if self.open_step is not None else None

    # ------------------------------------------------------------------------------------------ writing

    def append(self, event: bytes | Event) -> Event:
        """Validate and append one event; raise a typed error and change nothing when it is refused."""
        if not isinstance(event, Event):
            event = decode_event(event, len(self._events))
        replace = self._check(event)
        self._commit(event, replace)
        return event

    def check(self, event: bytes | Event) -> Event:
        """Validate one event as the next append would, without appending it."""
        return self.plan(event)[0]

    def plan(self, event: bytes | Event) -> tuple[Event, ReplacePlan | None]:
        """Validate one event as the next append would, without appending it; with the replace it would make."""
        if not isinstance(event, Event):
            event = decode_event(event, len(self._events))
        return event, self._check(event)

    def extend(self, events: Iterable[bytes | Event]) -> None:
        """Append each event in turn, exactly as `append` would; a refused event raises, and the events before it
        stay appended.

        A chunk inside its open step is most of any log, and all the rules ask of it is checked inline here (the
        same checks as `_check`'s chunk path, in the same order); every other event takes `append`'s road.
        """
        log = self._events
        for item in events:
            event = item if isinstance(item, Event) else decode_event(item, len(log))
            if event.type == "assistant/chunk":
                step = self.open_step
                if (
                    step is not None
                    and event.seq == len(log)
                    and (not log or event.has_seq is log[-1].has_seq)
                    and event.surface_op is UNSET
                    and event.source_event_seqs is UNSET
                    and event.data.step == step.number
                    and event.data.turn == self.open_turn
                ):
                    log.append(event)
                    continue
            self._commit(event, self._check(event))

    def copy(self) -> Session:
        """An independent session with the same log, without validating it again (O(n) pointer copies)."""
        other = Session.__new__(Session)
        other.__dict__.update(self.__dict__)
        other._events = list(self._events)
        other.surface = self.surface.copy()
        if self.open_step is not None:
            step = _Step(self.open_step.number)
            step.calls = dict(self.open_step.calls)
            step.results = set(self.open_step.results)
            step.announced = list(self.open_step.announced)
            other.open_step = step
        other._messages = dict(self._messages)
        other._call_node = dict(self._call_node)
        other._result_node = dict(self._result_node)
        other._header_seqs = list(self._header_seqs)
        other._derived = list(self._derived)
        other._derived_view = None
        return other

    def prefix(self, last_seq: int) -> Session:
        """A new session holding events 0..last_seq (inclusive), rebuilt from the log alone."""
        return Session(self._events[: last_seq + 1])

    # ------------------------------------------------------------------------------------------ checks

    def _check(self, event: Event) -> ReplacePlan | None:
        seq = event.seq
        if seq != len(self._events):
            raise SeqNotContiguous(f"{event.type}: seq {seq} is not the log length {len(self._events)}", seq=seq)
        if self._events and event.has_seq is not self._events[-1].has_seq:
            style = (
                "has no seq, but this log's events carry seqs"
                if not event.has_seq
                else "carries a seq, but this log's events are positional (they have none)"
            )
            raise SeqNotContiguous(f"{event.type}: {style}", seq=seq)
        if event.type == "assistant/chunk":  # the hot path: most events of a log are chunks
            step = self.open_step
            if event.surface_op is not UNSET or event.source_event_seqs is not UNSET:
                self._check_markers(event)
            elif step is None or event.data.step != step.number or event.data.turn != self.open_turn:
                self._expect_step(event)
            return None
        if event.type in SURFACE_TYPES:
            if event.surface_op is UNSET:
                raise SurfaceMarkerRequired(f"{event.type} must carry a surfaceOp", seq=seq)
        elif event.surface_op is not UNSET or event.source_event_seqs is not UNSET:
            self._check_markers(event)
        else:
            self._check_structure(event, replace=False)
            return None
        op = _parse_surface_op(event)
        plan = self.surface.plan_replace(seq, op) if op is not None else None
        provenance = _parse_provenance(event)
        if plan is not None:
            covered = frozenset(provenance or ())
            missing = [s for s in plan.shadowed if s not in covered]
            if missing:
                raise ProvenanceIncomplete(
                    f"surface replace: sourceEventSeqs must include every shadowed node; missing {missing}",
                    seq=seq,
                )
            if event.type == "tool/result":
                self._check_tool_result_replace(event, plan)
            else:
                self._check_tool_pairs(event, plan)
        self._check_structure(event, replace=plan is not None)
        return plan

    @staticmethod
    def _check_markers(event: Event) -> None:
        which = "surfaceOp" if event.surface_op is not UNSET else "sourceEventSeqs"
        raise SurfaceMarkerForbidden(f"{event.type} is not a surface type and may not carry {which}", seq=event.seq)

    def _check_tool_result_replace(self, event: Event, plan: ReplacePlan) -> None:
        if plan.first != plan.last:
            raise ToolResultReplaceInvalid(
                f"tool/result replace must rewrite exactly one node, got {len(plan.shadowed)} "
                f"(seqs {plan.shadowed[0]}..{plan.shadowed[-1]})",
                seq=event.seq,
            )
        target = self._events[plan.shadowed[0]]
        if target.type != "tool/result":
            raise ToolResultReplaceInvalid(
                f"tool/result replace must target a tool/result node, seq {target.seq} is {target.type}",
                seq=event.seq,
            )
        before, after = _without_result_content(target), _without_result_content(event)
        if before != after:
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            raise ToolResultReplaceInvalid(
                f"tool/result replace may change only the content of its result block; seq {target.seq} "
                f"differs in {changed}",
                seq=event.seq,
            )

    def _check_tool_pairs(self, event: Event, plan: ReplacePlan) -> None:
        shadowed = set(plan.shadowed)
        on_surface = self.surface.__contains__
        for node in plan.shadowed:
            node_event = self._events[node]
            for call_id in _call_ids(node_event):
                result = self._result_node.get(call_id)
                if result is not None and on_surface(result) and result not in shadowed:
                    raise ReplaceSplitsToolPair(
                        f"surface replace {plan.shadowed[0]}..{plan.shadowed[-1]} shadows the tool call "
                        f"{call_id[2]!r} (seq {node}) but not its result (seq {result})",
                        seq=event.seq,
                    )
            result_id = _result_key(node_event)
            if result_id is not None:
                call = self._call_node.get(result_id)
                if call is not None and on_surface(call) and call not in shadowed:
                    raise ReplaceSplitsToolPair(
                        f"surface replace {plan.shadowed[0]}..{plan.shadowed[-1]} shadows the result of tool "
                        f"call {result_id[2]!r} (seq {node}) but not the call (seq {call})",
                        seq=event.seq,
                    )
        for call_id in _call_ids(event):
            result = self._result_node.get(call_id)
            if result is not None and result in shadowed:
                raise ReplaceSplitsToolPair(
                    f"surface replace announces tool call {call_id[2]!r} but shadows its result (seq {result})",
                    seq=event.seq,
                )

    def _check_structure(self, event: Event, *, replace: bool) -> None:
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
            self._expect_step(event)
        elif replace:
            if self.open_turn is None:
                raise StructureInvalid(f"{kind} replace outside a turn (a compaction needs an open turn)", seq=seq)
        elif kind in STEP_SCOPED_TYPES:
            self._expect_step(event)
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
        call_id = _result_call_id(event)
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

    def _expect_step(self, event: Event) -> None:
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

    # ------------------------------------------------------------------------------------------ commit

    def _commit(self, event: Event, plan: ReplacePlan | None) -> None:
        self._events.append(event)
        kind = event.type
        seq = event.seq
        if kind in SURFACE_TYPES:
            self._messages[seq] = _derived_message(event)
            if plan is None:
                self.surface.append(seq)
            else:
                self.surface.replace(plan)
            for call_id in _call_ids(event):
                self._call_node[call_id] = seq
            result_key = _result_key(event)
            if result_key is not None:
                self._result_node[result_key] = seq
            self._derived_view = None
            if kind == "assistant/message" and self.open_step is not None:
                # A replacement's calls are announced too (dsh's closers register them); a call announced again
                # keeps its first place, so it is closed once.
                step = self.open_step
                for block in event.data.message.content:
                    if isinstance(block, ToolCallBlock) and all(c.id != block.id for c in step.announced):
                        step.announced.append(block)
            if plan is None and result_key is not None and self.open_step is not None:
                self.open_step.results.add(result_key[2])
        elif kind == "assistant/chunk":
            return
        elif kind == "turn/start":
            self.open_turn = event.data.turn
            self.last_turn = event.data.turn
            self.last_step = 0
        elif kind == "turn/end":
            self.open_turn = None
        elif kind == "step/start":
            self.open_step = _Step(event.data.step)
            self.last_step = event.data.step
        elif kind == "step/end":
            self.open_step = None
        elif kind == "tool/call":
            assert self.open_step is not None
            self.open_step.calls[event.data.call_id] = seq
        elif kind == "request/header":
            self._header_seq = seq
            self._header_seqs.append(seq)


def _derived_message(event: Event) -> DerivedMessage | None:
    """The message a surface event puts on the surface; None for an assistant/message with no content."""
    if event.type == "user/message":
        message: Message = event.data
    else:
        data: AssistantMessageData | ToolResultData = event.data
        message = data.message
        if event.type == "assistant/message" and not message.content:
            return None
    return DerivedMessage(event.seq, message_bytes(event), message)


class _HeaderBytes(msgspec.Struct):
    header: msgspec.Raw


class _HeaderEnvelope(msgspec.Struct):
    data: _HeaderBytes


_header_decoder: Final = msgspec.json.Decoder(_HeaderEnvelope)


def _header_bytes(raw: bytes) -> bytes:
    return bytes(_header_decoder.decode(raw).data.header)


def _without_result_content(event: Event) -> dict[str, Any]:
    """A tool/result's data as plain values, minus the content of its result block."""
    data: dict[str, Any] = msgspec.json.decode(data_bytes(event))
    data["message"]["content"][0].pop("content", None)
    return data


def derive_messages(log: Session | Iterable[bytes | Event]) -> DerivedMessages:
    """The derived messages of a log: a pure function of its events."""
    session = log if isinstance(log, Session) else Session(log)
    return session.derive_messages()


def fold_request_header(log: Session | Iterable[bytes | Event]) -> FoldedHeader | None:
    session = log if isinstance(log, Session) else Session(log)
    return session.fold_request_header()


def messages_json(messages: Iterable[DerivedMessage]) -> bytes:
    """The messages as one JSON array of their logged bytes."""
    return b"[" + b",".join(m.raw for m in messages) + b"]"


def messages_canonical(messages: Iterable[DerivedMessage]) -> bytes:
    """The messages as canonical JSON (sorted keys, compact): what the gateway compares and hashes."""
    return b"[" + b",".join(m.canonical for m in messages) + b"]"
