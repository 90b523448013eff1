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
from .log import SessionWriter
from .wire import to_wire

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
        blocks: dict[str, int] = {}  # "reasoning" / "text" / call index -> block index
        texts: dict[str, list[str]] = {"reasoning": [], "text": []}
        calls: dict[int, dict[str, str]] = {}
        usage: dict[str, int] | None = None
        finish = "stop"

        async def chunk(body: dict[str, Any]) -> None:
            chunks.append(await self.emit("assistant/chunk", {"turn": turn, "step": step, "chunk": body}))

        async def block(key: str, block_type: str) -> int:
            if key not in blocks:
                blocks[key] = len(blocks)
                await chunk({"type": "block-start", "index": blocks[key], "blockType": block_type})
            return blocks[key]

        async for part in stream:
            if part.usage is not None:
                usage = {"inputTokens": part.usage.prompt_tokens, "outputTokens": part.usage.completion_tokens}
            if not part.choices:
                continue
            choice = part.choices[0]
            delta = choice.delta
            reasoning = getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                index = await block("reasoning", "reasoning")
                texts["reasoning"].append(reasoning)
                await chunk({"type": "reasoning-delta", "index": index, "text": reasoning})
            if delta.content:
                index = await block("text", "text")
                texts["text"].append(delta.content)
                await chunk({"type": "text-delta", "index": index, "text": delta.content})
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] = call.function.name or slot["name"]
                    slot["arguments"] += call.function.arguments or ""
                index = await block(f"call{call.index}", "tool-call")
                piece = call.function.arguments if call.function is not None else ""
                delta_chunk = {
                    "type": "tool-call-delta",
                    "index": index,
                    "id": slot["id"],
                    "argumentsDelta": piece or "",
                }
                if call.function is not None and call.function.name:
                    delta_chunk["name"] = call.function.name
                await chunk(delta_chunk)
            if choice.finish_reason:
                finish = choice.finish_reason
        content: list[dict[str, Any]] = []
        if texts["reasoning"]:
            content.append({"type": "reasoning", "text": "".join(texts["reasoning"])})
        if texts["text"]:
            content.append({"type": "text", "text": "".join(texts["text"])})
        content += [{"type": "tool-call", **calls[i]} for i in sorted(calls)]
        for key, index in blocks.items():
            await chunk({"type": "block-end", "index": index, "block": _block_of(key, content, calls)})
        if usage is not None:
            await chunk({"type": "usage", "usage": usage})
        await chunk({"type": "finish", "reason": {"kind": "tool-calls" if calls else finish}})
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
        return {"text": "".join(texts["text"]), "calls": [calls[i] for i in sorted(calls)]}

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
        session = self.writer.session
        folded = session.fold_request_header()
        if folded is None or self._resumed_since(folded.seq):
            reason = "initial" if folded is None else "resume"
            await self.emit("request/header", {"header": self.header, "reason": reason})

    def _resumed_since(self, header_seq: int) -> bool:
        """A `session/end-seed` after the latest header: the next request writes one with reason `resume`."""
        session = self.writer.session
        return any(session[s].type == "session/end-seed" for s in range(header_seq + 1, len(session)))

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


def _block_of(key: str, content: list[dict[str, Any]], calls: dict[int, dict[str, str]]) -> dict[str, Any]:
    if key.startswith("call"):
        return {"type": "tool-call", **calls[int(key[4:])]}
    return next(b for b in content if b["type"] == key)
