"""Tool calls and their results on the surface (SPEC section 4): which node announced each call and which carries
its result, a replace that would split a pair (`REPLACE_SPLITS_TOOL_PAIR`), and a `tool/result` replacement that may
rewrite only its result's content (`TOOL_RESULT_REPLACE_INVALID`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from .errors import ReplaceSplitsToolPair, ToolResultReplaceInvalid
from .events import Event, ToolCallBlock, ToolResultBlock, data_bytes
from .surface import ReplacePlan

# A tool call and its result pair within one step (SPEC 6), so a pair is keyed by (turn, step, callId): providers
# that number calls per response reuse ids across turns.
PairKey = tuple[int, int, str]


def call_keys(event: Event) -> tuple[PairKey, ...]:
    """Pair keys of the tool-call blocks an assistant/message announces."""
    if event.type != "assistant/message":
        return ()
    data = event.data
    return tuple((data.turn, data.step, b.id) for b in data.message.content if isinstance(b, ToolCallBlock))


def result_key(event: Event) -> PairKey | None:
    if event.type != "tool/result":
        return None
    data = event.data
    return (data.turn, data.step, result_call_id(event))


def result_call_id(event: Event) -> str:
    block = event.data.message.content[0]
    assert isinstance(block, ToolResultBlock)
    return block.tool_call_id


class ToolPairs:
    """For each pair, the seq of the assistant/message announcing the call and of the latest tool/result."""

    __slots__ = ("call_node", "result_node")

    def __init__(self) -> None:
        self.call_node: dict[PairKey, int] = {}
        self.result_node: dict[PairKey, int] = {}

    def copy(self) -> ToolPairs:
        other = ToolPairs()
        other.call_node, other.result_node = dict(self.call_node), dict(self.result_node)
        return other

    def commit(self, event: Event) -> None:
        for call in call_keys(event):
            self.call_node[call] = event.seq
        result = result_key(event)
        if result is not None:
            self.result_node[result] = event.seq

    def _partners(self, event: Event) -> Iterator[tuple[PairKey, int | None, str, str]]:
        """Each pair `event` holds one side of: the key, the seq of the other side, and both sides' names."""
        for call in call_keys(event):
            yield call, self.result_node.get(call), "the tool call", "its result"
        result = result_key(event)
        if result is not None:
            yield result, self.call_node.get(result), "the result of tool call", "the call"

    def check_replace(
        self, event: Event, plan: ReplacePlan, log: Sequence[Event], on_surface: Callable[[int], bool]
    ) -> None:
        """Refuse a replace that shadows one side of a pair whose other side stays on the surface, or that announces
        a call whose result it shadows."""
        shadowed = set(plan.shadowed)
        for node in plan.shadowed:
            for key, partner, side, other in self._partners(log[node]):
                if partner is not None and on_surface(partner) and partner not in shadowed:
                    raise ReplaceSplitsToolPair(
                        f"surface replace {plan.shadowed[0]}..{plan.shadowed[-1]} shadows {side} {key[2]!r} "
                        f"(seq {node}) but not {other} (seq {partner})",
                        seq=event.seq,
                    )
        for key in call_keys(event):
            result = self.result_node.get(key)
            if result is not None and result in shadowed:
                raise ReplaceSplitsToolPair(
                    f"surface replace announces tool call {key[2]!r} but shadows its result (seq {result})",
                    seq=event.seq,
                )


def check_tool_result_replace(event: Event, plan: ReplacePlan, log: Sequence[Event]) -> None:
    """A `tool/result` replacement rewrites exactly one `tool/result` node, and only its result's content."""
    if plan.first != plan.last:
        raise ToolResultReplaceInvalid(
            f"tool/result replace must rewrite exactly one node, got {len(plan.shadowed)} "
            f"(seqs {plan.shadowed[0]}..{plan.shadowed[-1]})",
            seq=event.seq,
        )
    target = log[plan.shadowed[0]]
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


def _without_result_content(event: Event) -> dict[str, Any]:
    """A tool/result's data as plain values, minus the content of its result block."""
    data: dict[str, Any] = msgspec.json.decode(data_bytes(event))
    data["message"]["content"][0].pop("content", None)
    return data
