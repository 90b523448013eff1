"""The surface: the ordered event seqs the model sees, and the generation counter (SPEC section 4).

`Surface` only knows seqs. Planning a replace (`plan_replace`) checks the range against the current nodes and
returns a `ReplacePlan`; nothing changes until the session commits it. A replace costs one rebuild of the
position index; an append is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ReplaceRangeInverted, ReplaceRangeNotFound


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
        first = self._position.get(op.start)
        if first is None:
            raise ReplaceRangeNotFound(
                f"surface replace: start seq {op.start} not found in surface "
                f"(expected one of the {len(self._nodes)} current nodes)",
                seq=seq,
            )
        last = self._position.get(op.end)
        if last is None:
            raise ReplaceRangeNotFound(
                f"surface replace: end seq {op.end} not found in surface "
                f"(expected one of the {len(self._nodes)} current nodes)",
                seq=seq,
            )
        if first > last:
            raise ReplaceRangeInverted(
                f"surface replace: start seq {op.start} (surface position {first}) comes after "
                f"end seq {op.end} (surface position {last})",
                seq=seq,
            )
        return ReplacePlan(seq=seq, first=first, last=last, shadowed=tuple(self._nodes[first : last + 1]))

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
