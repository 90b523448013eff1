"""An agent's model turns, logged event by event: the loop that talks to a model only through the gateway.

`Agent` writes every event with a `SessionWriter` (turns, steps, the request header, every streamed chunk, the
assembled assistant message, tool calls and results), as the `events` Structs (`user_message`,
`tool_result_message` and `model_message` build its messages), flushes at the checkpoints (before every provider
request and before every tool body, so a durable `tool/call` means the tool may have run), builds each request from
its own log with `sessionlog.wire.to_wire`, and sends it with the OpenAI SDK, naming the session and the flushed
seq in `X-Session-Id` / `X-Session-Seq`. The SDK's chunks are decoded as `openai_wire.ChatCompletionChunk` and
turned into dsh's chunks by `openai_wire.ResponseAssembler`. The demo and `examples/agent_loop.py` both use it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import openai
from msgspec import UNSET

from .events import (
    AssistantChunkData,
    AssistantMessageData,
    Block,
    Chunk,
    Completed,
    Event,
    Message,
    Source,
    StepData,
    TextBlock,
    ToolCallData,
    ToolResultBlock,
    ToolResultData,
    TurnEndData,
    TurnEndReason,
    TurnStartData,
    Usage,
)
from .fork import next_header_reason
from .log import SessionWriter
from .openai_wire import ChatCompletionChunk, ResponseAssembler
from .wire import to_wire

Tool = Callable[[str], Awaitable[str]]


def user_message(message_id: str, text: str) -> Message:
    """A person's text as a `user/message`."""
    return Message(id=message_id, role="user", source=Source(kind="user"), content=(TextBlock(text=text),))


def tool_result_message(call_id: str, output: str) -> Message:
    """A tool's text output as the message of its `tool/result`."""
    block = ToolResultBlock(tool_call_id=call_id, content=(TextBlock(text=output),))
    return Message(id=f"result-{call_id}", role="user", source=Source(kind="tool", call_id=call_id), content=(block,))


def model_message(provider: str, model: str, content: list[dict[str, Any]]) -> Message:
    """The assistant message a model's response assembles to (`ResponseAssembler.content()`)."""
    return Message(
        id=f"msg-{uuid.uuid4().hex[:8]}",
        role="assistant",
        source=Source(kind="model", provider=provider, model=model),
        content=msgspec.convert(content, tuple[Block, ...]),
    )


class Agent:
    """One session: writes events through the writer and asks the model through the gateway."""

    def __init__(
        self,
        writer: SessionWriter,
        client: openai.AsyncOpenAI,
        header: dict[str, Any],
        tools: Mapping[str, Tool],
        *,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.writer = writer
        self.client = client
        self.header = header
        self.tools = tools
        self.on_event = on_event
        self.turn = writer.session.last_turn
        self.step = 0

    async def emit(self, kind: str, data: Any, **surface: Any) -> int:
        event = await self.writer.emit(kind, data, **surface)
        if self.on_event is not None:
            self.on_event(event)
        return event.seq

    def request(self) -> dict[str, Any]:
        session = self.writer.session
        header = session.fold_request_header()
        assert header is not None
        return to_wire(session.derive_messages(), header)

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Flush (the checkpoint before a provider request), stream the reply, log every chunk and the message."""
        seq = await self.writer.flush()
        stream = await self.client.chat.completions.create(
            **request,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": self.writer.session_id, "X-Session-Seq": str(seq)},
        )
        turn, step = self.turn, self.step
        chunks: list[int] = []
        assembler = ResponseAssembler()  # the one assembler of OpenAI responses into dsh's chunks

        async def chunk(body: dict[str, Any]) -> None:
            data = AssistantChunkData(turn=turn, step=step, chunk=msgspec.convert(body, Chunk))
            chunks.append(await self.emit("assistant/chunk", data))

        async for part in stream:
            for body in assembler.take(msgspec.convert(part.model_dump(), ChatCompletionChunk)):
                await chunk(body)
        for body in assembler.end():
            await chunk(body)
        content = assembler.content()
        message = model_message(self.header["config"]["provider"], request["model"], content)
        usage = msgspec.convert(assembler.usage, Usage) if assembler.usage is not None else UNSET
        data = AssistantMessageData(turn=turn, step=step, message=message, usage=usage)
        await self.emit("assistant/message", data, surface_op="append", source_event_seqs=chunks)
        text = "".join(b["text"] for b in content if b["type"] == "text")
        return {"text": text, "calls": assembler.calls()}

    async def run_tool(self, call: dict[str, str]) -> None:
        turn, step = self.turn, self.step
        data = ToolCallData(turn=turn, step=step, call_id=call["id"], name=call["name"], arguments=call["arguments"])
        call_seq = await self.emit("tool/call", data)
        await self.writer.flush()  # durable before the tool body: a crash now means "outcome unknown"
        tool = self.tools.get(call["name"])
        output = await tool(call["arguments"]) if tool is not None else f"no such tool: {call['name']}"
        result = ToolResultData(turn=turn, step=step, message=tool_result_message(call["id"], output))
        await self.emit("tool/result", result, surface_op="append", source_event_seqs=[call_seq])

    async def start_turn(self, text: str) -> None:
        self.turn += 1
        self.step = 0
        await self.emit("turn/start", TurnStartData(turn=self.turn))
        await self.emit("user/message", user_message(f"user-{self.turn}", text), surface_op="append")

    async def start_step(self) -> None:
        self.step += 1
        await self.emit("step/start", StepData(turn=self.turn, step=self.step))
        reason = next_header_reason(self.writer.session)
        if reason is not None:
            # a dict, not RequestHeaderData: the header's sampling fields live only in its bytes
            await self.emit("request/header", {"header": self.header, "reason": reason})

    async def end_step(self) -> None:
        await self.emit("step/end", StepData(turn=self.turn, step=self.step))

    async def end_turn(self, reason: TurnEndReason | dict[str, Any] | None = None) -> None:
        """Close the open step, if any, and the turn (`Completed()` without a reason; a dict is the SPEC form)."""
        if self.writer.session.open_step is not None:
            await self.end_step()
        typed: TurnEndReason = Completed()
        if isinstance(reason, dict):
            typed = msgspec.convert(reason, TurnEndReason)
        elif reason is not None:
            typed = reason
        await self.emit("turn/end", TurnEndData(turn=self.turn, reason=typed))
        await self.writer.flush()

    async def turn_with_tools(self, text: str, max_steps: int = 6) -> str:
        await self.start_turn(text)
        answer = ""
        for _ in range(max_steps):
            await self.start_step()
            reply = await self.ask(self.request())
            answer = reply["text"]
            for call in reply["calls"]:
                await self.run_tool(call)
            await self.end_step()
            if not reply["calls"]:
                break
        await self.end_turn(Completed())
        return answer
