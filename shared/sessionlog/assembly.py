"""A streamed response assembled from its `assistant/chunk`s: the one assembler of logged chunks into blocks, which
the auditor (`sessionlog.audit`) and the transcript (`sessionlog.transcript`) share. Pure: no I/O.

The rule (2026-12-03): a block is its `block-end` block once it has one (the adapter's final word on it), else its
deltas joined. dsh's recorder rewrites the final blocks and the messages and leaves the deltas as they were sent,
so the final word is what the message holds and what the user saw once the block ended; the transcript and the
audit's message check both read `assembled()`. The deltas stay as the record of what arrived: `streamed()` reads
them first, and the raw-stream check (which compares arrival with the provider's bytes) is their only reader. A
block whose block-end is not its deltas joined is `mismatched()`, which replay reports.

`StreamAssembly.take(chunk)` applies one chunk. Its hot case, a text delta to the block the previous text delta
went to, only appends to `last_parts`; a caller that inlines that case (the auditor's `feed`) must do exactly that
and nothing more (tests/test_assembly.py checks the inlined path against `take`).
"""

from __future__ import annotations

from typing import Any, Final

from msgspec import UNSET

from .events import (
    BlockEndChunk,
    BlockStartChunk,
    FinishChunk,
    ReasoningBlock,
    ReasoningDeltaChunk,
    TextBlock,
    TextDeltaChunk,
    ToolCallBlock,
    ToolCallDeltaChunk,
    Usage,
    UsageChunk,
)

BLOCK_TYPES: Final = {
    "TextBlock": "text",
    "ReasoningBlock": "reasoning",
    "ToolCallBlock": "tool-call",
    "ImageBlock": "image",
    "ToolResultBlock": "tool-result",
}


def block_type(block: Any) -> str:
    """The SPEC type of a content block Struct."""
    return BLOCK_TYPES.get(type(block).__name__, "other")


class StreamBlock:
    """One block of a response: its deltas as they came and its block-end block."""

    __slots__ = ("end", "end_seq", "id", "name", "parts", "type")

    def __init__(self, block_type: str) -> None:
        self.type = block_type
        self.parts: list[str] = []
        self.id: str | None = None  # tool calls: the id the latest delta gave
        self.name: str | None = None  # tool calls: the first name a delta gave
        self.end: Any = None
        self.end_seq = -1

    def from_deltas(self) -> Any:
        text = "".join(self.parts)
        if self.type == "tool-call":
            return ToolCallBlock(id=self.id or "", name=self.name or "", arguments=text)
        if self.type == "reasoning":
            return ReasoningBlock(text=text)
        return TextBlock(text=text)

    def assembled(self) -> Any:
        """The block by the rule: its block-end block, else its deltas joined."""
        return self.end if self.end is not None else self.from_deltas()

    def streamed(self) -> Any:
        """The block as it arrived: its deltas, else (a block that came whole) its block-end block."""
        return self.from_deltas() if self.parts or self.end is None else self.end

    def mismatched(self) -> bool:
        return bool(self.parts) and self.end is not None and self.from_deltas() != self.end


class StreamAssembly:
    """One response's blocks by index, with its usage and finish, chunk by chunk."""

    __slots__ = ("blocks", "finish", "last_index", "last_parts", "usage")

    def __init__(self) -> None:
        self.blocks: dict[int, StreamBlock] = {}
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.last_index = -1  # the block the last text delta went to, and its parts: the hot path of a stream
        self.last_parts: list[str] = []

    def block(self, index: int, block_type: str) -> StreamBlock:
        block = self.blocks.get(index)
        if block is None:
            block = self.blocks[index] = StreamBlock(block_type)
        return block

    def take(self, chunk: Any, seq: int = -1) -> None:
        """Apply one chunk (`seq` is its event's)."""
        kind = type(chunk)
        if kind is TextDeltaChunk:
            if chunk.index == self.last_index:
                self.last_parts.append(chunk.text)
                return
            block = self.block(chunk.index, "text")
            block.parts.append(chunk.text)
            self.last_index, self.last_parts = chunk.index, block.parts
            return
        self.last_index = -1
        if kind is ReasoningDeltaChunk:
            block = self.block(chunk.index, "reasoning")
            block.parts.append(chunk.text)
        elif kind is ToolCallDeltaChunk:
            block = self.block(chunk.index, "tool-call")
            block.parts.append(chunk.arguments_delta)
            block.id = chunk.id
            if chunk.name is not UNSET and not block.name:
                block.name = chunk.name
        elif kind is BlockStartChunk:
            self.block(chunk.index, chunk.block_type)
        elif kind is BlockEndChunk:
            block = self.block(chunk.index, block_type(chunk.block))
            block.end = chunk.block
            block.end_seq = seq
        elif kind is UsageChunk:
            self.usage = chunk.usage
        elif kind is FinishChunk:
            self.finish = chunk.reason.kind

    def assembled(self) -> list[Any]:
        """Every block by the rule (see the module doc), in index order."""
        return [self.blocks[i].assembled() for i in sorted(self.blocks)]

    def streamed(self) -> list[Any]:
        """Every block as it arrived, in index order."""
        return [self.blocks[i].streamed() for i in sorted(self.blocks)]

    def mismatches(self) -> list[int]:
        """The block-end chunk seqs whose block is not its deltas joined."""
        return [b.end_seq for b in self.blocks.values() if b.mismatched()]


__all__ = ["BLOCK_TYPES", "StreamAssembly", "StreamBlock", "block_type"]
