"""The surface: the ordered event seqs the model sees, and the generation counter (SPEC section 4).

`Surface` only knows seqs. Planning a replace (`plan_replace`) checks the range against the current nodes and
returns a `ReplacePlan`; nothing changes until the session commits it. A replace costs one rebuild of the
position index; an append is O(1). `parse_surface_op` and `parse_provenance` read an event's surface markers.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from msgspec import UNSET

from .errors import InvalidSurfaceOp, ProvenanceInvalid, ReplaceRangeInverted, ReplaceRangeNotFound
from .events import Event


@dataclass(frozen=True, slots=True)
class ReplaceOp:
    """`{op: "replace", start, end}`: nodes start..end (inclusive, by surface position) give way to one event."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ReplacePlan:
    """A checked replace: positions `first..last` of the surface are shadowed by the event at `seq`."""

    seq: int
    first: int
    last: int
    shadowed: tuple[int, ...]


class Surface:
    """Ordered node seqs plus the number of replacements so far."""

    __slots__ = ("_nodes", "_position", "generation")

    def __init__(self) -> None:
        self._nodes: list[int] = []
        self._position: dict[int, int] = {}
        self.generation = 0

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, seq: object) -> bool:
        return seq in self._position

    def position(self, seq: int) -> int | None:
        return self._position.get(seq)

    def node_at(self, index: int) -> int:
        return self._nodes[index]

    def plan_replace(self, seq: int, op: ReplaceOp) -> ReplacePlan:
        first, last = self._node_position("start", op.start, seq), self._node_position("end", op.end, seq)
        if first > last:
            raise ReplaceRangeInverted(
                f"surface replace: start seq {op.start} (surface position {first}) comes after "
                f"end seq {op.end} (surface position {last})",
                seq=seq,
            )
        return ReplacePlan(seq=seq, first=first, last=last, shadowed=tuple(self._nodes[first : last + 1]))

    def _node_position(self, which: str, node: int, seq: int) -> int:
        position = self._position.get(node)
        if position is None:
            raise ReplaceRangeNotFound(
                f"surface replace: {which} seq {node} not found in surface "
                f"(expected one of the {len(self._nodes)} current nodes)",
                seq=seq,
            )
        return position

    def append(self, seq: int) -> None:
        self._position[seq] = len(self._nodes)
        self._nodes.append(seq)

    def replace(self, plan: ReplacePlan) -> None:
        self._nodes[plan.first : plan.last + 1] = [plan.seq]
        self._position = {node: i for i, node in enumerate(self._nodes)}
        self.generation += 1

    def copy(self) -> Surface:
        other = Surface()
        other._nodes = list(self._nodes)
        other._position = dict(self._position)
        other.generation = self.generation
        return other


# ---------------------------------------------------------------------------------------------- markers


def parse_surface_op(event: Event) -> ReplaceOp | None:
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


def parse_provenance(event: Event) -> tuple[int, ...] | None:
    """The replacement's provenance (None without `sourceEventSeqs`); a malformed one is `PROVENANCE_INVALID`."""
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
