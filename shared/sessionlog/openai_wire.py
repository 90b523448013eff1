"""The OpenAI chat-completions wire as typed Structs, and the one assembler of an OpenAI response. Pure: no I/O.

The Structs are the request, the response (`ChatCompletion`), the streamed chunk (`ChatCompletionChunk`), its delta,
the tool-call delta and the usage, each with only the fields this library reads: unknown fields are ignored,
optional ones may be absent or `null` (providers do both). Every reader of the wire decodes with them: the agent
(the SDK's chunks), the gateway's record mode (the relayed SSE, through `ResponseAssembler.chunk`), the auditor
(the raw tee's bytes, `parse_raw_response`). A payload that does not fit them is not a chat-completions message:
the assembler skips it and the raw parser says so in `RawResponse.error`.

`ResponseAssembler` turns a response (chunks or one completion object) into dsh's stream chunks (SPEC 3:
block-start, text-delta, reasoning-delta, tool-call-delta, block-end, usage, finish) and the assembled message. It
is the one assembler of OpenAI responses: the agent and record mode log what it gives, and the auditor reads the
provider's raw answer through it, so "what the provider sent" is assembled by the same rules as what was logged.
The logged chunks are in turn assembled into blocks by `sessionlog.assembly` (the auditor and the transcript).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from msgspec import Struct

OPENAI_FINISH: Final = {
    "stop": "stop",
    "tool_calls": "tool-calls",
    "length": "max-tokens",
    "function_call": "tool-calls",
}

# ---------------------------------------------------------------------------------------------- the Structs


class PromptTokensDetails(Struct):
    cached_tokens: int | None = None


class CompletionTokensDetails(Struct):
    reasoning_tokens: int | None = None


class ChatUsage(Struct):
    """An OpenAI `usage` object (DeepSeek's `prompt_cache_hit_tokens` included)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: PromptTokensDetails | None = None
    prompt_cache_hit_tokens: int | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def cached(self) -> int | None:
        """Cache hits: DeepSeek's own field, else OpenAI's `prompt_tokens_details.cached_tokens`."""
        if self.prompt_cache_hit_tokens is not None:
            return self.prompt_cache_hit_tokens
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details is not None else None

    @property
    def reasoning(self) -> int | None:
        details = self.completion_tokens_details
        return details.reasoning_tokens if details is not None else None

    def logged(self) -> dict[str, int] | None:
        """The logged Usage (SPEC 3) it is, or None when it gives no token counts."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        out = {"inputTokens": self.prompt_tokens, "outputTokens": self.completion_tokens}
        cached, reasoning = self.cached, self.reasoning
        if cached is not None:
            out["cacheReadTokens"] = cached
        if reasoning is not None:
            out["reasoningTokens"] = reasoning
        return out


class FunctionCall(Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct):
    """A piece of a tool call in a streamed delta (`index` says which call); also a whole call of a completion."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class Delta(Struct):
    """What a streamed delta adds; a completion's message (`ResponseMessage`) carries the same fields, whole."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # OpenAI's refusal, sent instead of content: the text the model said
    tool_calls: list[ToolCallDelta] | None = None


ResponseMessage = Delta


def _said(delta: Delta) -> str | None:
    """A delta's (or a whole message's) text: its content, and a refusal after it (a refusal is what the model
    said, and the log keeps it as text)."""
    if delta.refusal:
        return (delta.content or "") + delta.refusal
    return delta.content


class _Choice(Struct):
    index: int = 0
    finish_reason: str | None = None


class ChunkChoice(_Choice):
    delta: Delta | None = None


class Choice(_Choice):
    message: ResponseMessage | None = None


class ChatError(Struct):
    message: str | None = None
    code: str | int | None = None


class _Response(Struct):
    usage: ChatUsage | None = None
    error: ChatError | str | None = None
    model: str | None = None


class ChatCompletionChunk(_Response):
    """One streamed chunk (an SSE `data:` payload)."""

    choices: list[ChunkChoice] | None = None


class ChatCompletion(_Response):
    """A whole (non-streamed) response."""

    choices: list[Choice] | None = None


class ChatRequest(Struct):
    """A request, as far as the library reads one as data (the wire comparison reads the JSON object itself)."""

    model: str | None = None
    stream: bool | None = None


chunk_decoder: Final = msgspec.json.Decoder(ChatCompletionChunk)
completion_decoder: Final = msgspec.json.Decoder(ChatCompletion)
request_decoder: Final = msgspec.json.Decoder(ChatRequest)


def usage_of(usage: Any) -> dict[str, int] | None:
    """The logged Usage (SPEC 3) of an OpenAI `usage` object (a `ChatUsage` or its JSON form), or None when it
    gives no token counts."""
    if isinstance(usage, ChatUsage):
        return usage.logged()
    try:
        typed: ChatUsage = msgspec.convert(usage, ChatUsage)
    except msgspec.ValidationError:
        return None
    return typed.logged()


def error_text(error: ChatError | str | None, *, code: bool = True) -> str | None:
    """The words of a response's `error` (its message, else its code), or None without one."""
    if error is None:
        return None
    if isinstance(error, str):
        return error
    return str(error.message or (error.code if code else None) or "error")


def error_words(error: ChatError | str) -> str:
    """A response's `error` object in words: its message, with its code beside it (`overloaded (server_busy)`)."""
    if isinstance(error, str):
        return error
    if error.message and error.code is not None:
        return f"{error.message} ({error.code})"
    return str(error.message or error.code or "an error without a message")


# ---------------------------------------------------------------------------------------------- assembling


class ResponseAssembler:
    """An OpenAI chat-completions response, chunk by chunk, as dsh's stream chunks and the assembled message.

    `take(chunk)` takes one `ChatCompletionChunk` and returns the dsh chunks it gives (block-start when a block
    begins, then its delta); `chunk(obj)` is the same for its JSON form (a chunk that does not fit the Struct gives
    nothing). `end()` returns the closing chunks (block-end of every block in order, usage when the stream carried
    it, finish). `content()` is the message's blocks in block order, `calls()` the tool calls. A block opens when
    its first delta arrives: reasoning, text, and each tool call (by its `index`) are blocks of their own. Only
    choice 0 is read.
    """

    __slots__ = ("_blocks", "_calls", "_finish", "_keys", "_texts", "error", "reported", "usage")

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}  # "reasoning" / "text" / "call<N>" -> block index
        self._blocks: list[str] = []
        self._texts: dict[str, list[str]] = {}
        self._calls: dict[int, dict[str, str]] = {}
        self._finish: str | None = None
        self.usage: dict[str, int] | None = None  # as logged
        self.reported: ChatUsage | None = None  # as the provider sent it
        # The first error object the answer carried (a provider that failed after sending its 200), in words.
        self.error: str | None = None

    def _open(self, key: str, block_type: str, out: list[dict[str, Any]]) -> int:
        index = self._keys.get(key)
        if index is None:
            index = self._keys[key] = len(self._blocks)
            self._blocks.append(key)
            out.append({"type": "block-start", "index": index, "blockType": block_type})
        return index

    def chunk(self, obj: Any) -> list[dict[str, Any]]:
        if not isinstance(obj, ChatCompletionChunk):
            try:
                obj = msgspec.convert(obj, ChatCompletionChunk)
            except msgspec.ValidationError:
                return []
        return self.take(obj)

    def take(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._note_error(chunk.error)
        if chunk.usage is not None:
            self.reported = chunk.usage
            usage = chunk.usage.logged()
            if usage is not None:
                self.usage = usage
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue
            delta = choice.delta
            if delta is not None:
                self._delta(delta.reasoning_content, _said(delta), delta.tool_calls, out)
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason
        return out

    def _delta(
        self, reasoning: str | None, text: str | None, calls: list[ToolCallDelta] | None, out: list[dict[str, Any]]
    ) -> None:
        if reasoning:
            index = self._open("reasoning", "reasoning", out)
            self._texts.setdefault("reasoning", []).append(reasoning)
            out.append({"type": "reasoning-delta", "index": index, "text": reasoning})
        if text:
            index = self._open("text", "text", out)
            self._texts.setdefault("text", []).append(text)
            out.append({"type": "text-delta", "index": index, "text": text})
        for call in calls or ():
            self._call_delta(call, out)

    def _call_delta(self, call: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        slot = self._calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
        if call.id:
            slot["id"] = call.id
        function = call.function
        name = (function.name if function is not None else None) or ""
        piece = (function.arguments if function is not None else None) or ""
        if name:
            slot["name"] = name
        slot["arguments"] += piece
        index = self._open(f"call{call.index}", "tool-call", out)
        delta: dict[str, Any] = {"type": "tool-call-delta", "index": index, "id": slot["id"], "argumentsDelta": piece}
        if name:
            delta["name"] = name
        out.append(delta)

    def completion(self, obj: Any) -> None:
        """Take a whole (non-streamed) completion object (a `ChatCompletion` or its JSON form) instead of chunks."""
        if not isinstance(obj, ChatCompletion):
            try:
                obj = msgspec.convert(obj, ChatCompletion)
            except msgspec.ValidationError:
                return
        self.take_completion(obj)

    def take_completion(self, completion: ChatCompletion) -> None:
        self._note_error(completion.error)
        self.reported = completion.usage
        self.usage = completion.usage.logged() if completion.usage is not None else None
        for choice in completion.choices or ():
            if choice.index != 0:
                continue
            message = choice.message or ResponseMessage()
            calls = [msgspec.structs.replace(c, index=i) for i, c in enumerate(message.tool_calls or ())]
            self._delta(message.reasoning_content, _said(message), calls, [])
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason

    def _note_error(self, error: ChatError | str | None) -> None:
        if error is not None and self.error is None:
            self.error = error_words(error)

    def _block(self, key: str) -> dict[str, Any]:
        if key.startswith("call"):
            return {"type": "tool-call", **self._calls[int(key[4:])]}
        return {"type": key, "text": self.text(key)}

    def text(self, key: str = "text") -> str:
        """The text (`text`) or reasoning (`reasoning`) assembled so far."""
        return "".join(self._texts.get(key, ()))

    def content(self) -> list[dict[str, Any]]:
        return [self._block(key) for key in self._blocks]

    def calls(self) -> list[dict[str, str]]:
        return [self._calls[i] for i in sorted(self._calls)]

    @property
    def finish(self) -> str:
        """The finish kind (dsh's names: `stop`, `tool-calls`, `max-tokens`, or the provider's own): `tool-calls`
        for an answer with tool calls that the provider finished as such, as `stop` (some servers do) or not at all;
        a provider's other finish (`length`, `content_filter`) is kept, so the log says the calls were cut short."""
        reason = self._finish
        if self._calls and reason in (None, "stop", "tool_calls", "function_call"):
            return "tool-calls"
        reason = reason or "stop"
        return OPENAI_FINISH.get(reason, reason)

    @property
    def finished(self) -> bool:
        """Whether a finish reason arrived (a stream cut short has none)."""
        return self._finish is not None

    @property
    def provider_finish(self) -> str | None:
        """The finish reason the provider sent (in dsh's names), or None when it sent none."""
        reason = self._finish
        return None if reason is None else OPENAI_FINISH.get(reason, reason)

    def end(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"type": "block-end", "index": i, "block": self._block(key)} for i, key in enumerate(self._blocks)
        ]
        if self.usage is not None:
            out.append({"type": "usage", "usage": self.usage})
        out.append({"type": "finish", "reason": {"kind": self.finish}})
        return out


class SseLines:
    """Splits a byte stream into the JSON payloads of its SSE `data:` lines, across chunk boundaries: as plain JSON
    values, or typed with `decoder` (`SseLines(chunk_decoder)` gives `ChatCompletionChunk`s for
    `ResponseAssembler.take`; a payload that does not fit is skipped like one that is not JSON)."""

    __slots__ = ("_decode", "_rest", "done")

    def __init__(self, decoder: msgspec.json.Decoder[Any] | None = None) -> None:
        self._rest = b""
        self._decode = decoder.decode if decoder is not None else msgspec.json.decode
        self.done = False  # `data: [DONE]` was seen

    def feed(self, data: bytes) -> list[Any]:
        buffer = self._rest + data if self._rest else data
        lines = buffer.split(b"\n")
        self._rest = lines.pop()
        out: list[Any] = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
            elif payload:
                try:
                    out.append(self._decode(payload))
                except msgspec.DecodeError:
                    continue  # not ours to judge: the audit compares the raw bytes
        return out


def ends_with_done(pieces: list[bytes]) -> bool:
    """Whether bytes relayed in `pieces` end with an SSE stream's last line, `data: [DONE]` (read as `SseLines`
    reads a line; the line may be split over the last pieces, and blank lines may follow it)."""
    tail = b""
    for piece in reversed(pieces):
        tail = piece + tail
        if len(tail.rstrip(b"\r\n")) >= 64:
            break
    return is_done_line(tail.rstrip(b"\r\n").rpartition(b"\n")[2])


def done_line_at(data: bytes) -> int:
    """Where the SSE line `data: [DONE]` starts in `data`, or -1."""
    at = data.find(b"[DONE]")
    while at >= 0:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        if is_done_line(data[start : end if end >= 0 else len(data)].strip()):
            return start
        at = data.find(b"[DONE]", at + 6)
    return -1


def is_done_line(line: bytes) -> bool:
    """Whether an SSE line (without its line end) is a stream's last, `data: [DONE]`."""
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


# ---------------------------------------------------------------------------------------------- raw responses


@dataclass(slots=True)
class RawResponse:
    """What a raw chat-completions response (SSE or one JSON object) carries, assembled."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[list[str]] = field(default_factory=list)  # [id, name, arguments] in index order
    finish: str | None = None
    usage: ChatUsage | None = None
    chunks: int = 0
    error: str | None = None


def parse_raw_response(body: bytes) -> RawResponse:
    """Assemble a response body (SSE `data:` lines of chunks, or one completion object) with `ResponseAssembler`."""
    out = RawResponse()
    stripped = body.lstrip()
    if not stripped:
        return out
    assembler = ResponseAssembler()
    if stripped.startswith(b"{"):
        try:
            completion = completion_decoder.decode(stripped)
        except msgspec.ValidationError as err:
            out.error = f"the response body is not a chat completion: {err}"
            return out
        except msgspec.DecodeError:
            out.error = "the response body is not JSON"
            return out
        out.error = error_text(completion.error, code=False)
        assembler.take_completion(completion)
    else:
        for line in body.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]" or not payload:
                continue
            try:
                chunk = chunk_decoder.decode(payload)
            except msgspec.ValidationError as err:
                out.error = f"an SSE data line is not a chat-completions chunk: {err}"
                continue
            except msgspec.DecodeError:
                out.error = "an SSE data line is not JSON"
                continue
            out.chunks += 1
            out.error = error_text(chunk.error) or out.error
            assembler.take(chunk)
    out.text = assembler.text("text")
    out.reasoning = assembler.text("reasoning")
    out.tool_calls = [[c["id"], c["name"], c["arguments"]] for c in assembler.calls()]
    out.finish = assembler.provider_finish
    out.usage = assembler.reported
    return out


__all__ = [
    "OPENAI_FINISH",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatError",
    "ChatRequest",
    "ChatUsage",
    "Choice",
    "ChunkChoice",
    "CompletionTokensDetails",
    "Delta",
    "FunctionCall",
    "PromptTokensDetails",
    "RawResponse",
    "ResponseAssembler",
    "ResponseMessage",
    "SseLines",
    "ToolCallDelta",
    "chunk_decoder",
    "completion_decoder",
    "done_line_at",
    "error_text",
    "error_words",
    "is_done_line",
    "parse_raw_response",
    "request_decoder",
    "usage_of",
]
