"""An agent's model turns, logged event by event: the loop that talks to a model only through the gateway.

`Agent` writes every event with a `SessionWriter` (turns, steps, the request header, every streamed chunk, the
assembled assistant message, tool calls and results), flushes at the checkpoints (before every provider request
and before every tool body, so a durable `tool/call` means the tool may have run), builds each request from its
own log with `sessionlog.wire.to_wire`, and sends it with the OpenAI SDK, naming the session and the flushed seq
in `X-Session-Id` / `X-Session-Seq`. The demo and `examples/agent_loop.py` both use it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import openai

from .events import Event
from .fork import next_header_reason
from .log import SessionWriter
from .wire import to_wire
from .wireforms import ResponseAssembler

Tool = Callable[[str], Awaitable[str]]


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
            chunks.append(await self.emit("assistant/chunk", {"turn": turn, "step": step, "chunk": body}))

        async for part in stream:
            for body in assembler.chunk(part.model_dump()):
                await chunk(body)
        for body in assembler.end():
            await chunk(body)
        content = assembler.content()
        usage = assembler.usage
        message = {
            "id": f"msg-{uuid.uuid4().hex[:8]}",
            "role": "assistant",
            "source": {"kind": "model", "provider": self.header["config"]["provider"], "model": request["model"]},
            "content": content,
        }
        data: dict[str, Any] = {"turn": turn, "step": step, "message": message}
        if usage is not None:
            data["usage"] = usage
        await self.emit("assistant/message", data, surface_op="append", source_event_seqs=chunks)
        text = "".join(b["text"] for b in content if b["type"] == "text")
        return {"text": text, "calls": assembler.calls()}

    async def run_tool(self, call: dict[str, str]) -> None:
        turn, step = self.turn, self.step
        call_seq = await self.emit(
            "tool/call", {"turn": turn, "step": step, "callId": call["id"], "name": call["name"],
                          "arguments": call["arguments"]},
        )  # fmt: skip
        await self.writer.flush()  # durable before the tool body: a crash now means "outcome unknown"
        tool = self.tools.get(call["name"])
        output = await tool(call["arguments"]) if tool is not None else f"no such tool: {call['name']}"
        result = {
            "id": f"result-{call['id']}",
            "role": "user",
            "source": {"kind": "tool", "callId": call["id"]},
            "content": [
                {"type": "tool-result", "toolCallId": call["id"], "content": [{"type": "text", "text": output}]}
            ],
        }
        await self.emit("tool/result", {"turn": turn, "step": step, "message": result}, surface_op="append",
                        source_event_seqs=[call_seq])  # fmt: skip

    async def start_turn(self, text: str) -> None:
        self.turn += 1
        self.step = 0
        await self.emit("turn/start", {"turn": self.turn})
        message = {"id": f"user-{self.turn}", "role": "user", "source": {"kind": "user"},
                   "content": [{"type": "text", "text": text}]}  # fmt: skip
        await self.emit("user/message", message, surface_op="append")

    async def start_step(self) -> None:
        self.step += 1
        await self.emit("step/start", {"turn": self.turn, "step": self.step})
        reason = next_header_reason(self.writer.session)
        if reason is not None:
            await self.emit("request/header", {"header": self.header, "reason": reason})

    async def end_turn(self, reason: dict[str, Any]) -> None:
        if self.writer.session.open_step is not None:
            await self.emit("step/end", {"turn": self.turn, "step": self.step})
        await self.emit("turn/end", {"turn": self.turn, "reason": reason})
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
            await self.emit("step/end", {"turn": self.turn, "step": self.step})
            if not reply["calls"]:
                break
        await self.end_turn({"kind": "completed"})
        return answer
