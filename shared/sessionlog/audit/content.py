"""How a message differs from what its chunks assemble to, and how its provenance misses them: the words of the
`MESSAGE_DIFFERS_FROM_CHUNKS` and `PROVENANCE_DOES_NOT_COVER_CHUNKS` findings. Pure functions of blocks and seqs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..events import ReasoningBlock, TextBlock, ToolCallBlock


def shown(block: Any) -> str:
    if isinstance(block, ToolCallBlock):
        return f"tool-call {block.name}({clip(block.arguments)}) [{block.id}]"
    if isinstance(block, (TextBlock, ReasoningBlock)):
        kind = "text" if isinstance(block, TextBlock) else "reasoning"
        return f"{kind} {clip(block.text)!r}"
    return type(block).__name__


def clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _body(block: Any) -> str | None:
    if isinstance(block, (TextBlock, ReasoningBlock)):
        return block.text
    if isinstance(block, ToolCallBlock):
        return block.arguments
    return None


def _block_difference(message: Any, chunks: Any) -> str:
    """How a message block differs from the chunks' block: where their texts part, with a little context."""
    mine, theirs = _body(message), _body(chunks)
    same_kind = type(message) is type(chunks)
    if same_kind and isinstance(message, ToolCallBlock) and (message.id, message.name) != (chunks.id, chunks.name):
        return f"the message has {shown(message)}, the chunks {shown(chunks)}"
    if not same_kind or mine is None or theirs is None:
        return f"the message has {shown(message)}, the chunks {shown(chunks)}"
    at = next((k for k, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), min(len(mine), len(theirs)))
    start = max(0, at - 20)
    what = shown(message).split(" ", 1)[0]
    return (
        f"{what} differs at character {at}: the message has {clip(mine[start : at + 40])!r}, "
        f"the chunks {clip(theirs[start : at + 40])!r}"
    )


def _significant(blocks: Iterable[Any]) -> list[Any]:
    """Blocks that carry something: empty text and reasoning blocks are left out on both sides."""
    return [b for b in blocks if not (isinstance(b, (TextBlock, ReasoningBlock)) and not b.text)]


def content_difference(message: Sequence[Any], assembled: Sequence[Any], *, cut_short: bool) -> str | None:
    """Why a message's blocks are not what the chunks assemble to, or None when they are (see `sessionlog.audit`)."""
    got = _significant(message)
    want = _significant(assembled)
    if not cut_short:
        if got == want:
            return None
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            if a != b:
                return f"block {i}: {_block_difference(a, b)}"
        return f"the message has {len(got)} blocks, the chunks {len(want)}"
    j = 0
    for i, block in enumerate(got):
        while j < len(want) and want[j] != block and isinstance(want[j], ToolCallBlock):
            j += 1  # a tool call the cut left unfinished may be dropped
        if j >= len(want):
            return f"block {i} ({shown(block)}) is not in the chunks"
        if want[j] != block:
            return f"block {i}: {_block_difference(block, want[j])}"
        j += 1
    rest = [b for b in want[j:] if not isinstance(b, ToolCallBlock)]
    if rest:
        return f"the chunks hold {shown(rest[0])} after the message's last block"
    return None


def provenance_difference(seqs: list[int], own: list[int], spare: Iterable[int]) -> str | None:
    """Why `sourceEventSeqs` (`seqs`) does not cover a message's chunks (`own`), or None when it does; `spare` are
    chunks of the step that no message took, which it may name. A message names hundreds of chunks: compare lists
    and sets in C."""
    if seqs == own:
        return None
    covered = set(seqs)
    missing = [s for s in own if s not in covered] if not covered.issuperset(own) else []
    rest = covered.difference(own)
    foreign: list[int] = []
    if rest:
        rest.difference_update(spare)
        foreign = sorted(rest)
    if not missing and not foreign:
        return None
    parts = []
    if missing:
        parts.append(f"misses chunks {seq_list(missing)}")
    if foreign:
        parts.append(f"names {seq_list(foreign)}, which are not chunks of this step")
    return " and ".join(parts)


def channels(blocks: Iterable[Any]) -> tuple[str, str, list[list[str]]]:
    """Text, reasoning and tool calls (`[id, name, arguments]`) of blocks, each channel joined."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[list[str]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ReasoningBlock):
            reasoning.append(block.text)
        elif isinstance(block, ToolCallBlock):
            calls.append([block.id, block.name, block.arguments])
    return "".join(text), "".join(reasoning), calls


def seq_list(seqs: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in seqs[:limit])
    return f"[{shown}{', ...' if len(seqs) > limit else ''}]"


def seq_range(seqs: Sequence[int]) -> str:
    if not seqs:
        return "none"
    return f"seq {seqs[0]}" if len(seqs) == 1 else f"seqs {seqs[0]}-{seqs[-1]}"
