"""A session: the append-only event list, its surface, its structure, and what is derived from them.

`Session.append` is the one gate every event passes. It decodes (`INVALID_EVENT`, `UNKNOWN_EVENT_TYPE`), then
checks the rules in the order of SPEC section 10 (contiguity, surface markers, surface op, replace range,
provenance, tool/result replacement, tool pairs, structure) without touching any state, and only then commits.
A refused append changes nothing.

Derived messages (SPEC section 5) are cached and extended as nodes are appended; a replace (a new generation)
drops the cache, which is rebuilt from the stored per-node messages on the next call, never by re-decoding.
Everything handed out is immutable: bytes, tuples and frozen Structs (`derived.py`).

The rules live with what they are about: surface markers and ranges in `surface.py`, tool pairs in `toolpairs.py`,
turns and steps in `structure.py`; this module runs them in order and commits.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from msgspec import UNSET

from .derived import (
    DerivedMessage,
    DerivedMessages,
    FoldedHeader,
    derived_message,
    folded_header,
    messages_canonical,
    messages_json,
)
from .errors import ProvenanceIncomplete, SeqNotContiguous, SurfaceMarkerForbidden, SurfaceMarkerRequired
from .events import SURFACE_TYPES, Event, decode_event
from .structure import COMMITTED_KINDS, TOOL_NOT_STARTED, TOOL_OUTCOME_UNKNOWN, Step, Structure
from .surface import ReplacePlan, Surface, parse_provenance, parse_surface_op
from .toolpairs import ToolPairs, check_tool_result_replace

__all__ = [
    "TOOL_NOT_STARTED",
    "TOOL_OUTCOME_UNKNOWN",
    "DerivedMessage",
    "DerivedMessages",
    "FoldedHeader",
    "Session",
    "derive_messages",
    "fold_request_header",
    "messages_canonical",
    "messages_json",
]


class Session:
    """One session's log, validated on every append; see the module docstring for the rules."""

    def __init__(self, events: Iterable[bytes | Event] = ()) -> None:
        self._events: list[Event] = []
        self.surface = Surface()
        self.structure = Structure()
        self._pairs = ToolPairs()
        self._messages: dict[int, DerivedMessage | None] = {}
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
    def open_turn(self) -> int | None:
        return self.structure.open_turn

    @property
    def open_step(self) -> Step | None:
        return self.structure.open_step

    @property
    def last_turn(self) -> int:
        return self.structure.last_turn

    @property
    def last_step(self) -> int:
        return self.structure.last_step

    @property
    def turn_is_open(self) -> bool:
        return self.structure.open_turn is not None

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
        return folded_header(self._events[self._header_seq]) if self._header_seq is not None else None

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
            op = parse_surface_op(self._events[node])
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
        return folded_header(self._events[self._header_seqs[index - 1]]) if index else None

    def transcript(self) -> tuple[Event, ...]:
        """Append-origin surface events: what the user saw, untouched by any compaction."""
        return tuple(e for e in self._events if e.type in SURFACE_TYPES and e.surface_op == "append")

    def tool_call_event(self, call_id: str) -> int | None:
        """Seq of the tool/call recorded for `call_id` in the open step, if any."""
        step = self.structure.open_step
        return step.calls.get(call_id) if step is not None else None

    # ------------------------------------------------------------------------------------------ writing

    def append(self, event: bytes | Event) -> Event:
        """Validate and append one event; raise a typed error and change nothing when it is refused."""
        if not isinstance(event, Event):
            event = decode_event(event, len(self._events))
        if event.type == "assistant/chunk" and self._chunk_fits(event):
            self._events.append(event)  # most of any log: a chunk that fits commits nothing else (as in `extend`)
            return event
        self._commit(event, self._check(event))
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
        stay appended. A chunk that `_chunk_fits` (most of any log) is appended without the rest of the gate."""
        log = self._events
        fits, keep = self._chunk_fits, log.append  # bound once: the loop runs once per event of a whole log
        for item in events:
            event = item if type(item) is Event else decode_event(item, len(log))  # type: ignore[arg-type]
            if event.type == "assistant/chunk" and fits(event):
                keep(event)  # a chunk commits nothing else
            else:
                self._commit(event, self._check(event))

    def copy(self) -> Session:
        """An independent session with the same log, without validating it again (O(n) pointer copies)."""
        other = Session.__new__(Session)
        other.__dict__.update(self.__dict__)
        other._events = list(self._events)
        other.surface = self.surface.copy()
        other.structure = self.structure.copy()
        other._pairs = self._pairs.copy()
        other._messages = dict(self._messages)
        other._header_seqs = list(self._header_seqs)
        other._derived = list(self._derived)
        other._derived_view = None
        return other

    def prefix(self, last_seq: int) -> Session:
        """A new session holding events 0..last_seq (inclusive), rebuilt from the log alone."""
        return Session(self._events[: last_seq + 1])

    # ------------------------------------------------------------------------------------------ checks

    def _chunk_fits(self, event: Event) -> bool:
        """Whether a chunk passes every rule: the next seq in the log's style, no surface marker, the open turn and
        step. The one statement of the rules for chunks, the hot path; a chunk that does not fit meets the ordered
        checks of `_check`, which name the rule it breaks."""
        log = self._events
        structure = self.structure
        step = structure.open_step
        data = event.data
        return (
            step is not None
            and data.step == step.number
            and data.turn == structure.open_turn
            and event.seq == len(log)
            and (not log or event.has_seq is log[-1].has_seq)
            and event.surface_op is UNSET
            and event.source_event_seqs is UNSET
        )

    def _check(self, event: Event) -> ReplacePlan | None:
        if event.type == "assistant/chunk" and self._chunk_fits(event):
            return None
        seq = event.seq
        log = self._events
        if seq != len(log):
            raise SeqNotContiguous(f"{event.type}: seq {seq} is not the log length {len(log)}", seq=seq)
        if log and event.has_seq is not log[-1].has_seq:
            style = (
                "has no seq, but this log's events carry seqs"
                if not event.has_seq
                else "carries a seq, but this log's events are positional (they have none)"
            )
            raise SeqNotContiguous(f"{event.type}: {style}", seq=seq)
        if event.type == "assistant/chunk":  # one that does not fit: say which rule it breaks
            if event.surface_op is not UNSET or event.source_event_seqs is not UNSET:
                _refuse_markers(event)
            self.structure.expect_step(event)
            raise AssertionError("unreachable: a chunk that does not fit breaks a rule above")
        if event.type in SURFACE_TYPES:
            if event.surface_op is UNSET:
                raise SurfaceMarkerRequired(f"{event.type} must carry a surfaceOp", seq=seq)
        elif event.surface_op is not UNSET or event.source_event_seqs is not UNSET:
            _refuse_markers(event)
        else:
            self.structure.check(event, False)
            return None
        op = parse_surface_op(event)
        plan = self.surface.plan_replace(seq, op) if op is not None else None
        provenance = parse_provenance(event)
        if plan is not None:
            covered = frozenset(provenance or ())
            missing = [s for s in plan.shadowed if s not in covered]
            if missing:
                raise ProvenanceIncomplete(
                    f"surface replace: sourceEventSeqs must include every shadowed node; missing {missing}",
                    seq=seq,
                )
            if event.type == "tool/result":
                check_tool_result_replace(event, plan, log)
            else:
                self._pairs.check_replace(event, plan, log, self.surface.__contains__)
        self.structure.check(event, plan is not None)
        return plan

    # ------------------------------------------------------------------------------------------ commit

    def _commit(self, event: Event, plan: ReplacePlan | None) -> None:
        self._events.append(event)
        kind = event.type
        if kind == "assistant/chunk":  # nothing to record: the hot path
            return
        seq = event.seq
        if kind in SURFACE_TYPES:
            self._messages[seq] = derived_message(event)
            if plan is None:
                self.surface.append(seq)
            else:
                self.surface.replace(plan)
            if kind != "user/message":
                self._pairs.commit(event)
            self._derived_view = None
        elif kind == "request/header":
            self._header_seq = seq
            self._header_seqs.append(seq)
        if kind in COMMITTED_KINDS:
            self.structure.commit(event, plan is not None)


def _refuse_markers(event: Event) -> None:
    which = "surfaceOp" if event.surface_op is not UNSET else "sourceEventSeqs"
    raise SurfaceMarkerForbidden(f"{event.type} is not a surface type and may not carry {which}", seq=event.seq)


def derive_messages(log: Session | Iterable[bytes | Event]) -> DerivedMessages:
    """The derived messages of a log: a pure function of its events."""
    session = log if isinstance(log, Session) else Session(log)
    return session.derive_messages()


def fold_request_header(log: Session | Iterable[bytes | Event]) -> FoldedHeader | None:
    session = log if isinstance(log, Session) else Session(log)
    return session.fold_request_header()
