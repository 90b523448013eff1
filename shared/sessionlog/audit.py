"""The token audit: per step, the raw chunk stream and what it assembles to; per session and model, a token ledger;
and findings, as data, wherever the log disagrees with itself or with the provider's raw bytes. Pure: no I/O.

`SessionAuditor` is fed a session's events in order (`add(event, session)`, the `Session` the event was just
appended to; or `feed(events, session)`, which appends a batch to the session, the gate that validates, and takes
each) and the gateway's raw exchanges (`add_raw`), in any order relative to each other. It assembles every attempt
chunk by chunk: a text delta costs two list appends. `audit_session(session, raw)` is the same for a whole log.

What is an attempt. A step may make several requests (a retried empty response): a `finish` chunk or an
`llm/retry` event closes the current attempt, and the next chunk opens another. An `assistant/message` (an append;
a compaction's replacement is no model response) takes the step's latest attempt that no message has taken.

Findings (`Finding.code`):

- `MESSAGE_DIFFERS_FROM_CHUNKS`: an assistant/message's content is not what its attempt's chunks assemble to. A
  block assembles to its `block-end` block (the adapter's final word on it) or, without one, to its deltas joined.
  Empty text and reasoning blocks are ignored on both sides. A response cut short (no finish chunk, finish
  `max-tokens` or `error`, or a message marked `interrupted`) may leave out tool calls it had started: the message
  must hold the other blocks, in order. A message with no chunks at all was not streamed and is not compared with
  chunks; a model's message that was not streamed is an attempt of its own (its blocks as it gives them), so the raw
  response that answered it is compared with it (`RAW_STREAM_DIFFERS`) and its request is checked like any other.
- `PROVENANCE_DOES_NOT_COVER_CHUNKS`: the message's `sourceEventSeqs` misses a chunk of its attempt, or names an
  event that is not a chunk of its step. Chunks of an earlier failed attempt of the step may be named or not.
- `MESSAGE_USAGE_DIFFERS`: the message's usage is not its attempt's usage chunk.
- `REQUEST_NOT_REBUILDABLE`: the theorem (SPEC section 6) does not hold for a request: its step has no
  `request/header` before the first chunk, or the raw request the gateway forwarded is not the wire form of the
  derivation of the prefix before that chunk (the reason names `DERIVATION_DIVERGES` or `HEADER_DIVERGES` and the
  JSON path of the first difference).
- `RAW_STREAM_DIFFERS`: the provider's raw response (the gateway's tee) does not carry what the agent logged: other
  text, reasoning or tool calls, another finish reason, or a complete response that the log holds no chunks of.
- `PROVIDER_USAGE_DIFFERS`: the usage the provider reported in its raw response is not the logged usage chunk.

The ledger counts every attempt once: its (last) usage chunk, else its message's usage; a message that was not
streamed counts with its own usage. Each attempt is charged to the provider and model of the request header in
force at its first chunk (else the message's source, else "unknown").

Decisions (2026-12):
- The block-end block, not the deltas, is what a message is checked against: two dsh fixtures carry deltas that the
  recorder did not rewrite while it rewrote the final blocks and the messages. When both exist and disagree, the
  step records it (`StepReport.delta_mismatches`, shown by `sessionlog replay`), and the raw-stream check, which
  is about what arrived, uses the deltas.
- Provider usage: `prompt_tokens` may count cache hits or not (DeepSeek's `prompt_cache_hit_tokens`, OpenAI's
  `prompt_tokens_details.cached_tokens`), so the logged input matches when it equals `prompt_tokens` or
  `prompt_tokens` minus the cache hits; output must equal `completion_tokens`; reasoning and cache reads are
  compared when both sides report them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from msgspec import UNSET, Struct

from .errors import InvalidStep, SessionLogError
from .events import (
    AssistantMessageData,
    BlockEndChunk,
    BlockStartChunk,
    Event,
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
from .record import (
    H_RAW_KIND,
    H_RAW_OUTCOME,
    H_RAW_PART,
    H_RAW_PARTS,
    H_RAW_REQUEST_ID,
    H_RAW_SESSION_SEQ,
    H_RAW_STATUS,
    raw_subject,
)
from .session import DerivedMessages, FoldedHeader, Session
from .wire import WireCache, compare_request
from .wireforms import OPENAI_FINISH, usage_of

MESSAGE_DIFFERS: Final = "MESSAGE_DIFFERS_FROM_CHUNKS"
PROVENANCE_UNCOVERED: Final = "PROVENANCE_DOES_NOT_COVER_CHUNKS"
MESSAGE_USAGE_DIFFERS: Final = "MESSAGE_USAGE_DIFFERS"
REQUEST_NOT_REBUILDABLE: Final = "REQUEST_NOT_REBUILDABLE"
RAW_STREAM_DIFFERS: Final = "RAW_STREAM_DIFFERS"
PROVIDER_USAGE_DIFFERS: Final = "PROVIDER_USAGE_DIFFERS"
FINDING_CODES: Final = (
    MESSAGE_DIFFERS,
    PROVENANCE_UNCOVERED,
    MESSAGE_USAGE_DIFFERS,
    REQUEST_NOT_REBUILDABLE,
    RAW_STREAM_DIFFERS,
    PROVIDER_USAGE_DIFFERS,
)

COMPLETE_OUTCOME: Final = "complete"
_PARTIAL_FINISHES: Final = frozenset({"max-tokens", "error"})
_OPENAI_FINISH: Final = OPENAI_FINISH


class _RawModel(Struct):
    model: Any = None


_raw_model_decoder: Final = msgspec.json.Decoder(_RawModel)


_BLOCK_TYPES: Final = {"TextBlock": "text", "ReasoningBlock": "reasoning", "ToolCallBlock": "tool-call"}


# ---------------------------------------------------------------------------------------------- results


class Finding(Struct, frozen=True, omit_defaults=True):
    """One disagreement, as data: which rule, which event, and what was expected against what was found."""

    code: str
    message: str
    seq: int | None = None
    turn: int | None = None
    step: int | None = None
    request_id: str | None = None


class TokenCounts(Struct, omit_defaults=False):
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.requests += 1
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cache_read_tokens += _or0(usage.cache_read_tokens)
        self.cache_write_tokens += _or0(usage.cache_write_tokens)
        self.reasoning_tokens += _or0(usage.reasoning_tokens)

    def count_request(self) -> None:
        self.requests += 1


class ModelTokens(Struct):
    provider: str
    model: str
    tokens: TokenCounts


class Ledger(Struct):
    total: TokenCounts
    by_model: list[ModelTokens]


class StepReport(Struct, frozen=True, omit_defaults=True):
    """One step as the auditor holds it (for `replay` and the report)."""

    turn: int
    step: int
    attempts: int
    chunks: int
    first_chunk: int | None
    message: int | None
    text: str
    reasoning: str
    tool_calls: tuple[tuple[str, str, str], ...]
    usage: dict[str, int] | None
    finish: str | None
    delta_mismatches: tuple[int, ...] = ()  # block-end chunk seqs whose block is not their deltas joined


class AuditReport(Struct, frozen=True):
    session: str
    seq: int
    events: int
    chunks: int
    steps: int
    ledger: Ledger
    findings: list[Finding]
    raw_exchanges: int
    raw_matched: int
    # every exchange the provider answered (HTTP 200), counted from the raw tee, by the model it was sent; beside
    # the log's ledger, and what differs between the two, in words
    provider_ledger: Ledger | None = None
    ledger_difference: list[str] = msgspec.field(default_factory=list)


def _or0(value: int | Any) -> int:
    return value if type(value) is int else 0


def usage_dict(usage: Usage) -> dict[str, int]:
    return msgspec.to_builtins(usage)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- raw exchanges


@dataclass(slots=True)
class RawExchange:
    """One request the gateway forwarded, from the raw audit stream: the exact bytes sent and received."""

    request_id: str
    session_seq: int  # the last seq of the durable log the gateway checked the request at
    request: bytes
    response: bytes
    status: int = 200
    outcome: str = COMPLETE_OUTCOME  # complete | client_disconnected | upstream_error


@dataclass(slots=True)
class RawResponse:
    """What a raw chat-completions response (SSE or one JSON object) carries, assembled."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[list[str]] = field(default_factory=list)  # [id, name, arguments] in index order
    finish: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    error: str | None = None


class RawAssembler:
    """Turns raw-tee messages back into `RawExchange`s: parts joined, the request paired with its response."""

    def __init__(self, max_open: int = 4096) -> None:
        self._parts: dict[tuple[str, str], list[bytes | None]] = {}
        self._requests: dict[str, bytes] = {}
        self._max_open = max_open

    def add(self, headers: Mapping[str, str], data: bytes) -> RawExchange | None:
        """Take one tee message; return the exchange it completes, if any. Messages that are not tee entries are
        ignored (None)."""
        request_id = headers.get(H_RAW_REQUEST_ID)
        kind = headers.get(H_RAW_KIND)
        if not request_id or kind not in ("request", "response"):
            return None
        try:
            part = int(headers.get(H_RAW_PART, "0"))
            parts = int(headers.get(H_RAW_PARTS, "1"))
        except ValueError:
            return None
        if parts < 1 or not 0 <= part < parts:
            return None
        if parts == 1:
            body = data
        else:
            slots = self._parts.setdefault((request_id, kind), [None] * parts)
            if len(slots) != parts:
                return None
            slots[part] = data
            if any(s is None for s in slots):
                return None
            del self._parts[(request_id, kind)]
            body = b"".join(s for s in slots if s is not None)
        if kind == "request":
            self._requests[request_id] = body
            while len(self._requests) > self._max_open:  # requests whose response never came
                self._requests.pop(next(iter(self._requests)))
            return None
        try:
            session_seq = int(headers.get(H_RAW_SESSION_SEQ, "-1"))
            status = int(headers.get(H_RAW_STATUS, "200"))
        except ValueError:
            return None
        return RawExchange(
            request_id=request_id,
            session_seq=session_seq,
            request=self._requests.pop(request_id, b""),
            response=body,
            status=status,
            outcome=headers.get(H_RAW_OUTCOME, COMPLETE_OUTCOME),
        )


def parse_raw_response(body: bytes) -> RawResponse:
    """Assemble an OpenAI-compatible response body: SSE `data:` lines of chunks, or one completion object."""
    out = RawResponse()
    stripped = body.lstrip()
    if not stripped:
        return out
    if stripped.startswith(b"{"):
        try:
            obj = msgspec.json.decode(stripped)
        except msgspec.DecodeError:
            out.error = "the response body is not JSON"
            return out
        _take_completion(obj, out)
        return out
    calls: dict[int, list[str]] = {}
    text: list[str] = []
    reasoning: list[str] = []
    for line in body.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            continue
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            out.error = "an SSE data line is not JSON"
            continue
        if not isinstance(obj, dict):
            continue
        out.chunks += 1
        if isinstance(obj.get("error"), dict):
            out.error = str(obj["error"].get("message") or obj["error"].get("code") or "error")
        if isinstance(obj.get("usage"), dict):
            out.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                text.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                if not isinstance(call, dict):
                    continue
                entry = calls.setdefault(int(call.get("index", 0)), ["", "", ""])
                if isinstance(call.get("id"), str) and call["id"]:
                    entry[0] = call["id"]
                function = call.get("function") or {}
                if isinstance(function.get("name"), str) and function["name"]:
                    entry[1] = function["name"]
                if isinstance(function.get("arguments"), str):
                    entry[2] += function["arguments"]
            if isinstance(choice.get("finish_reason"), str):
                out.finish = _OPENAI_FINISH.get(choice["finish_reason"], choice["finish_reason"])
    out.text = "".join(text)
    out.reasoning = "".join(reasoning)
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


def _take_completion(obj: Any, out: RawResponse) -> None:
    if not isinstance(obj, dict):
        return
    if isinstance(obj.get("error"), dict):
        out.error = str(obj["error"].get("message") or "error")
    if isinstance(obj.get("usage"), dict):
        out.usage = obj["usage"]
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        message = choice.get("message") or {}
        out.text = message.get("content") or ""
        out.reasoning = message.get("reasoning_content") or ""
        out.tool_calls = [
            [c.get("id", ""), (c.get("function") or {}).get("name", ""), (c.get("function") or {}).get("arguments", "")]
            for c in message.get("tool_calls") or ()
            if isinstance(c, dict)
        ]
        if isinstance(choice.get("finish_reason"), str):
            out.finish = _OPENAI_FINISH.get(choice["finish_reason"], choice["finish_reason"])


def provider_usage_difference(logged: Usage, reported: Mapping[str, Any]) -> str | None:
    """Why the provider's reported usage is not the logged usage chunk, or None when they agree."""
    prompt = reported.get("prompt_tokens")
    completion = reported.get("completion_tokens")
    details = reported.get("prompt_tokens_details") or {}
    cached = reported.get("prompt_cache_hit_tokens")
    if cached is None and isinstance(details, dict):
        cached = details.get("cached_tokens")
    reasons: list[str] = []
    if isinstance(prompt, int):
        accepted = {prompt} | ({prompt - cached} if isinstance(cached, int) else set())
        if logged.input_tokens not in accepted:
            reasons.append(f"input: logged {logged.input_tokens}, provider {prompt} prompt tokens")
    if isinstance(completion, int) and logged.output_tokens != completion:
        reasons.append(f"output: logged {logged.output_tokens}, provider {completion}")
    if isinstance(cached, int) and type(logged.cache_read_tokens) is int and logged.cache_read_tokens != cached:
        reasons.append(f"cache read: logged {logged.cache_read_tokens}, provider {cached}")
    completion_details = reported.get("completion_tokens_details") or {}
    reasoning = completion_details.get("reasoning_tokens") if isinstance(completion_details, dict) else None
    if isinstance(reasoning, int) and type(logged.reasoning_tokens) is int and logged.reasoning_tokens != reasoning:
        reasons.append(f"reasoning: logged {logged.reasoning_tokens}, provider {reasoning}")
    return "; ".join(reasons) or None


# ---------------------------------------------------------------------------------------------- assembly


class _Block:
    """One block of an attempt: its deltas as they came and its block-end block."""

    __slots__ = ("end", "end_seq", "id", "name", "parts", "type")

    def __init__(self, block_type: str) -> None:
        self.type = block_type
        self.parts: list[str] = []
        self.id = ""
        self.name = ""
        self.end: Any = None
        self.end_seq = -1

    def from_deltas(self) -> Any:
        text = "".join(self.parts)
        if self.type == "tool-call":
            return ToolCallBlock(id=self.id, name=self.name, arguments=text)
        if self.type == "reasoning":
            return ReasoningBlock(text=text)
        return TextBlock(text=text)

    def assembled(self) -> Any:
        """The block as its chunks give it: the block-end block, else the deltas joined."""
        return self.end if self.end is not None else self.from_deltas()

    def streamed(self) -> Any:
        """The block as it arrived: the deltas, else the block-end block."""
        return self.from_deltas() if self.parts or self.end is None else self.end

    def mismatched(self) -> bool:
        return bool(self.parts) and self.end is not None and self.from_deltas() != self.end


class Attempt:
    """One request of a step and the chunks that answered it."""

    __slots__ = (
        "accounted",
        "blocks",
        "chunk_seqs",
        "closed",
        "finish",
        "first_seq",
        "header",
        "last_index",
        "last_parts",
        "matched",
        "message",
        "messages",
        "step",
        "turn",
        "usage",
        "whole",
    )

    def __init__(self, event: Event, messages: DerivedMessages, header: FoldedHeader | None) -> None:
        self.first_seq = event.seq
        self.turn: int = event.data.turn
        self.step: int = event.data.step
        self.chunk_seqs: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.closed = False
        self.message: Event | None = None  # the assistant/message that took it
        self.messages = messages  # what the prefix before the first chunk derives (the request, per the theorem)
        self.header = header
        self.matched = False  # a raw exchange was compared with it
        self.accounted = False
        self.last_index = -1  # the block the last text delta went to, and its parts: the hot path of a stream
        self.last_parts: list[str] = []
        self.whole = False  # a message that was not streamed: no chunks, its blocks as the message gives them

    def block(self, index: int, block_type: str) -> _Block:
        block = self.blocks.get(index)
        if block is None:
            block = self.blocks[index] = _Block(block_type)
        return block

    def assembled(self) -> list[Any]:
        return [self.blocks[i].assembled() for i in sorted(self.blocks)]

    def streamed(self) -> list[Any]:
        return [self.blocks[i].streamed() for i in sorted(self.blocks)]

    @property
    def cut_short(self) -> bool:
        interrupted = self.message is not None and self.message.data.interrupted is True
        if self.whole:
            return interrupted
        return interrupted or self.finish is None or self.finish in _PARTIAL_FINISHES

    @property
    def model(self) -> tuple[str, str]:
        if self.header is not None:
            config = self.header.header.config
            return config.provider, config.model
        if self.message is not None:
            return _source_model(self.message)
        return "unknown", "unknown"


def _source_model(event: Event) -> tuple[str, str]:
    source = event.data.message.source
    provider = source.provider if isinstance(source.provider, str) else "unknown"
    model = source.model if isinstance(source.model, str) else "unknown"
    return provider, model


class _Step:
    __slots__ = ("attempts", "end_seq", "messages", "start_seq", "step", "turn")

    def __init__(self, turn: int, step: int, start_seq: int) -> None:
        self.turn = turn
        self.step = step
        self.start_seq = start_seq
        self.end_seq: int | None = None
        self.attempts: list[Attempt] = []
        self.messages: list[int] = []

    def untaken(self) -> Attempt | None:
        for attempt in reversed(self.attempts):
            if attempt.message is None:
                return attempt
        return None


def _shown(block: Any) -> str:
    if isinstance(block, ToolCallBlock):
        return f"tool-call {block.name}({_clip(block.arguments)}) [{block.id}]"
    if isinstance(block, (TextBlock, ReasoningBlock)):
        kind = "text" if isinstance(block, TextBlock) else "reasoning"
        return f"{kind} {_clip(block.text)!r}"
    return type(block).__name__


def _clip(text: str, limit: int = 60) -> str:
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
        return f"the message has {_shown(message)}, the chunks {_shown(chunks)}"
    if not same_kind or mine is None or theirs is None:
        return f"the message has {_shown(message)}, the chunks {_shown(chunks)}"
    at = next((k for k, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y), min(len(mine), len(theirs)))
    start = max(0, at - 20)
    what = _shown(message).split(" ", 1)[0]
    return (
        f"{what} differs at character {at}: the message has {_clip(mine[start : at + 40])!r}, "
        f"the chunks {_clip(theirs[start : at + 40])!r}"
    )


def _significant(blocks: Iterable[Any]) -> list[Any]:
    """Blocks that carry something: empty text and reasoning blocks are left out on both sides."""
    return [b for b in blocks if not (isinstance(b, (TextBlock, ReasoningBlock)) and not b.text)]


def content_difference(message: Sequence[Any], assembled: Sequence[Any], *, cut_short: bool) -> str | None:
    """Why a message's blocks are not what the chunks assemble to, or None when they are (see the module doc)."""
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
            return f"block {i} ({_shown(block)}) is not in the chunks"
        if want[j] != block:
            return f"block {i}: {_block_difference(block, want[j])}"
        j += 1
    rest = [b for b in want[j:] if not isinstance(b, ToolCallBlock)]
    if rest:
        return f"the chunks hold {_shown(rest[0])} after the message's last block"
    return None


def _channels(blocks: Iterable[Any]) -> tuple[str, str, list[list[str]]]:
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


def raw_difference(raw: RawResponse, logged: Sequence[Any], *, finish: str | None, partial: bool) -> str | None:
    """Why the provider's raw response does not carry what the agent logged, or None when it does.

    `partial`: the call was cut short on either side, so the log need only hold a prefix of what the provider sent.
    """
    text, reasoning, calls = _channels(logged)
    for name, mine, theirs in (("text", text, raw.text), ("reasoning", reasoning, raw.reasoning)):
        same = theirs.startswith(mine) if partial else theirs == mine
        if not same:
            return f"{name}: logged {_clip(mine)!r}, the provider sent {_clip(theirs)!r}"
    if partial:
        if len(calls) > len(raw.tool_calls) or any(
            a[0] != b[0] or a[1] != b[1] or not b[2].startswith(a[2])
            for a, b in zip(calls, raw.tool_calls, strict=False)
        ):
            return f"tool calls: logged {calls}, the provider sent {raw.tool_calls}"
    elif calls != raw.tool_calls:
        return f"tool calls: logged {calls}, the provider sent {raw.tool_calls}"
    if not partial and finish is not None and raw.finish is not None and finish != raw.finish:
        return f"finish: logged {finish!r}, the provider sent {raw.finish!r}"
    return None


# ---------------------------------------------------------------------------------------------- the auditor


class SessionAuditor:
    """The audit of one session, fed event by event; see the module docstring."""

    def __init__(self, session_id: str = "", *, model_aliases: Mapping[str, str] | None = None) -> None:
        self.session_id = session_id
        self.model_aliases = dict(model_aliases or {})
        self.findings: list[Finding] = []
        self.steps: dict[tuple[int, int], _Step] = {}
        self.events = 0
        self.raw_exchanges = 0
        self.raw_matched = 0
        self._step: _Step | None = None  # the open step
        self._attempt: Attempt | None = None  # the attempt chunks go to
        self._pending: list[RawExchange] = []
        self._seen_raw: set[str] = set()
        self._unstreamed: list[Event] = []  # messages that took no attempt
        self._totals = TokenCounts()
        self._by_model: dict[tuple[str, str], TokenCounts] = {}
        self._raw_totals = TokenCounts()
        self._raw_by_model: dict[tuple[str, str], TokenCounts] = {}
        self._wire = WireCache()

    # ------------------------------------------------------------------------------------------ feeding

    def feed(self, events: Iterable[bytes | Event], session: Session) -> None:
        """Append each event to `session` (the gate that validates it: a refused event raises and is not taken)
        and take it, as `add` does. The bulk of a stream, a text delta to the block the previous delta went to,
        is taken here inline, without a method call per chunk."""
        append = session.append
        text_delta = TextDeltaChunk
        for item in events:
            event = append(item)
            if event.type == "assistant/chunk":
                data = event.data
                chunk = data.chunk
                attempt = self._attempt
                if (
                    attempt is not None
                    and type(chunk) is text_delta
                    and chunk.index == attempt.last_index
                    and not attempt.closed
                    and attempt.step == data.step
                    and attempt.turn == data.turn
                ):
                    seq = event.seq
                    attempt.chunk_seqs.append(seq)
                    attempt.last_parts.append(chunk.text)
                    self.events = seq + 1
                    continue
            self.add(event, session)

    def add(self, event: Event, session: Session) -> None:
        """Take the next event; `session` is the log it was just appended to."""
        self.events = event.seq + 1
        kind = event.type
        if kind == "assistant/chunk":
            self._chunk(event, session)
        elif kind == "assistant/message":
            if not event.is_replace:
                self._message(event, session)
        elif kind == "step/start":
            step = _Step(event.data.turn, event.data.step, event.seq)
            self.steps[(step.turn, step.step)] = step
            self._step = step
        elif kind == "step/end" or kind == "turn/end":
            self._close_step(event.seq)
        elif kind == "llm/retry" and self._attempt is not None:
            self._settle(self._attempt)
            self._attempt = None

    def extend(self, events: Iterable[Event], session: Session) -> None:
        for event in events:
            self.add(event, session)

    def _chunk(self, event: Event, session: Session) -> None:
        data = event.data
        attempt = self._attempt
        if attempt is None or attempt.closed or attempt.step != data.step or attempt.turn != data.turn:
            attempt = self._open_attempt(event, session)
        attempt.chunk_seqs.append(event.seq)
        chunk = data.chunk
        kind = type(chunk)
        if kind is TextDeltaChunk:
            parts = attempt.block(chunk.index, "text").parts
            parts.append(chunk.text)
            attempt.last_index, attempt.last_parts = chunk.index, parts
            return
        attempt.last_index = -1
        if kind is ReasoningDeltaChunk:
            attempt.block(chunk.index, "reasoning").parts.append(chunk.text)
        elif kind is ToolCallDeltaChunk:
            block = attempt.block(chunk.index, "tool-call")
            block.parts.append(chunk.arguments_delta)
            block.id = chunk.id
            if chunk.name is not UNSET and not block.name:
                block.name = chunk.name
        elif kind is BlockStartChunk:
            attempt.block(chunk.index, chunk.block_type)
        elif kind is BlockEndChunk:
            block = attempt.block(chunk.index, _BLOCK_TYPES.get(type(chunk.block).__name__, "other"))
            block.end = chunk.block
            block.end_seq = event.seq
        elif kind is UsageChunk:
            attempt.usage = chunk.usage
        elif kind is FinishChunk:
            attempt.finish = chunk.reason.kind
            attempt.closed = True
            self._match_pending()

    def _open_attempt(self, event: Event, session: Session) -> Attempt:
        previous = self._attempt
        if previous is not None and not previous.closed:
            self._settle(previous)
        attempt = Attempt(event, session.derive_messages(), session.fold_request_header())
        step = self.steps.get((attempt.turn, attempt.step))
        if step is None:  # a log whose step/start this auditor never saw (it started mid-log)
            step = self.steps[(attempt.turn, attempt.step)] = _Step(attempt.turn, attempt.step, event.seq)
        step.attempts.append(attempt)
        self._attempt = attempt
        if attempt.header is None:
            self._find(
                REQUEST_NOT_REBUILDABLE,
                f"the request of step {attempt.turn}.{attempt.step} (first chunk at seq {event.seq}) has no "
                "request/header before it: its model, system prompt, tools and sampling are not in the log",
                event.seq,
                attempt.turn,
                attempt.step,
            )
        if self._pending:
            self._match_pending()
        return attempt

    def _settle(self, attempt: Attempt) -> None:
        attempt.closed = True
        if self._pending:
            self._match_pending()

    def _close_step(self, seq: int) -> None:
        step = self._step
        if step is not None:
            step.end_seq = seq
            for attempt in step.attempts:
                attempt.closed = True
                self._account(attempt)
        self._step = None
        self._attempt = None
        if self._pending:
            self._match_pending()

    # ------------------------------------------------------------------------------------------ messages

    def _message(self, event: Event, session: Session) -> None:
        data: AssistantMessageData = event.data
        step = self.steps.get((data.turn, data.step))
        attempt = step.untaken() if step is not None else None
        if step is not None:
            step.messages.append(event.seq)
        where = f"assistant/message at seq {event.seq} (step {data.turn}.{data.step})"
        seqs = event.source_event_seqs if isinstance(event.source_event_seqs, list) else []
        if step is not None and attempt is None and not seqs and data.message.source.kind == "model":
            self._whole_answer(event, step, session)
            return
        if step is None or attempt is None:
            self._unstreamed.append(event)
            if data.usage is not UNSET:
                self._charge(_source_model(event), data.usage)
            if seqs:
                self._find(
                    PROVENANCE_UNCOVERED,
                    f"{where}: sourceEventSeqs names {_seq_list(seqs)}, but the step has no chunks left for it",
                    event.seq,
                    data.turn,
                    data.step,
                )
            return
        attempt.message = event
        attempt.closed = True
        if self._attempt is attempt:
            self._attempt = None
        # Provenance: every chunk of its attempt, and nothing that is not a chunk of this step (chunks of the step's
        # attempts no message took may be named). A message names hundreds of chunks: compare lists and sets in C.
        own = attempt.chunk_seqs
        missing: list[int] = []
        foreign: list[int] = []
        if seqs != own:
            covered = set(seqs)
            if not covered.issuperset(own):
                missing = [s for s in own if s not in covered]
            rest = covered.difference(own)
            if rest:
                rest.difference_update(s for a in step.attempts if a.message is None for s in a.chunk_seqs)
                foreign = sorted(rest)
        if missing or foreign:
            parts = []
            if missing:
                parts.append(f"misses chunks {_seq_list(missing)}")
            if foreign:
                parts.append(f"names {_seq_list(foreign)}, which are not chunks of this step")
            self._find(
                PROVENANCE_UNCOVERED,
                f"{where}: sourceEventSeqs {' and '.join(parts)} (its chunks are {_seq_range(attempt.chunk_seqs)})",
                event.seq,
                data.turn,
                data.step,
            )
        difference = content_difference(data.message.content, attempt.assembled(), cut_short=attempt.cut_short)
        if difference is not None:
            self._find(
                MESSAGE_DIFFERS,
                f"{where} differs from its chunks ({_seq_range(attempt.chunk_seqs)}): {difference}",
                event.seq,
                data.turn,
                data.step,
            )
        if data.usage is not UNSET and attempt.usage is not None and data.usage != attempt.usage:
            self._find(
                MESSAGE_USAGE_DIFFERS,
                f"{where}: usage {usage_dict(data.usage)} is not the usage chunk's {usage_dict(attempt.usage)}",
                event.seq,
                data.turn,
                data.step,
            )
        self._account(attempt)
        if self._pending:
            self._match_pending()

    def _whole_answer(self, event: Event, step: _Step, session: Session) -> None:
        """A model's message that was not streamed: an attempt of its own, its blocks as it gives them, so a raw
        exchange that answered it is compared with it and the ledger counts it like a streamed one."""
        messages = session.derive_messages()
        if messages and messages[-1].seq == event.seq:  # the request is what the prefix before it derives
            before: Sequence[Any] = messages[: len(messages) - 1]
        else:
            before = messages
        attempt = Attempt(event, before, session.fold_request_header())  # type: ignore[arg-type]
        attempt.first_seq = event.seq
        for index, block in enumerate(event.data.message.content):
            attempt.block(index, _BLOCK_TYPES.get(type(block).__name__, "other")).end = block
        attempt.message = event
        attempt.closed = True
        attempt.whole = True
        step.attempts.append(attempt)
        self._account(attempt)
        if self._pending:
            self._match_pending()

    # ------------------------------------------------------------------------------------------ ledger

    def _account(self, attempt: Attempt) -> None:
        if attempt.accounted:
            return
        attempt.accounted = True
        usage = attempt.usage
        if usage is None and attempt.message is not None and attempt.message.data.usage is not UNSET:
            usage = attempt.message.data.usage
        if usage is not None:
            self._charge(attempt.model, usage)
        else:
            self._totals.count_request()
            self._model_counts(attempt.model).count_request()

    def _charge(self, model: tuple[str, str], usage: Usage) -> None:
        self._totals.add(usage)
        self._model_counts(model).add(usage)

    def _model_counts(self, model: tuple[str, str]) -> TokenCounts:
        counts = self._by_model.get(model)
        if counts is None:
            counts = self._by_model[model] = TokenCounts()
        return counts

    @property
    def chunks(self) -> int:
        """Chunks applied so far."""
        return sum(len(a.chunk_seqs) for s in self.steps.values() for a in s.attempts)

    def charged(self) -> Mapping[tuple[str, str], TokenCounts]:
        """The running totals per (provider, model), settled attempts only (what metrics export). Read only."""
        return self._by_model

    def ledger(self) -> Ledger:
        """The token ledger now. An attempt still in progress counts once its step moves on."""
        total = msgspec.structs.replace(self._totals)
        by_model = [
            ModelTokens(provider=p, model=m, tokens=msgspec.structs.replace(c))
            for (p, m), c in sorted(self._by_model.items())
        ]
        pending = [a for s in self.steps.values() for a in s.attempts if not a.accounted]
        for attempt in pending:  # not settled yet: counted in the answer, not in the running totals
            usage = attempt.usage
            entry = next((b for b in by_model if (b.provider, b.model) == attempt.model), None)
            if entry is None:
                entry = ModelTokens(provider=attempt.model[0], model=attempt.model[1], tokens=TokenCounts())
                by_model.append(entry)
            for counts in (total, entry.tokens):
                if usage is not None:
                    counts.add(usage)
                else:
                    counts.count_request()
        return Ledger(total=total, by_model=by_model)

    # ------------------------------------------------------------------------------------------ raw

    def add_raw(self, exchange: RawExchange) -> None:
        """A request the gateway forwarded; compared once the attempt it answered is complete in the log."""
        if exchange.request_id in self._seen_raw:
            return
        self._seen_raw.add(exchange.request_id)
        self.raw_exchanges += 1
        if exchange.status == 200:
            self._count_raw(exchange)
        self._pending.append(exchange)
        self._pending.sort(key=lambda x: x.session_seq)
        self._match_pending()

    def _count_raw(self, exchange: RawExchange) -> None:
        """The provider ledger: one request per answered exchange, its tokens from the usage the provider sent."""
        try:
            model = _raw_model_decoder.decode(exchange.request).model if exchange.request else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            model = None
        name = model if isinstance(model, str) and model else "unknown"
        name = next((logged for logged, sent in self.model_aliases.items() if sent == name), name)
        reported = usage_of(parse_raw_response(exchange.response).usage)
        counts = self._raw_by_model.setdefault(("raw", name), TokenCounts())
        for target in (self._raw_totals, counts):
            if reported is not None:
                target.add(msgspec.convert(reported, Usage))
            else:
                target.count_request()

    def provider_ledger(self) -> Ledger:
        by_model = [
            ModelTokens(provider=p, model=m, tokens=msgspec.structs.replace(c))
            for (p, m), c in sorted(self._raw_by_model.items())
        ]
        return Ledger(total=msgspec.structs.replace(self._raw_totals), by_model=by_model)

    def ledger_difference(self, logged: Ledger) -> list[str]:
        """What the provider was seen to answer (raw tee) and the log does not hold, or the reverse, in words."""
        if not self.raw_exchanges:
            return []
        raw, mine = self._raw_totals, logged.total
        out = []
        for what, theirs, ours in (
            ("requests", raw.requests, mine.requests),
            ("input tokens", raw.input_tokens, mine.input_tokens),
            ("output tokens", raw.output_tokens, mine.output_tokens),
        ):
            if theirs != ours:
                out.append(f"{what}: the provider answered {theirs:,} (raw tee), the log holds {ours:,}")
        return out

    def _attempt_after(self, seq: int) -> tuple[_Step | None, Attempt | None]:
        """The step open at `seq` and its first unmatched attempt that began after it."""
        for step in reversed(self.steps.values()):
            if step.start_seq <= seq and (step.end_seq is None or step.end_seq > seq):
                for attempt in step.attempts:
                    if attempt.first_seq > seq and not attempt.matched:
                        return step, attempt
                return step, None
            if step.start_seq <= seq:
                break
        return None, None

    def _match_pending(self) -> None:
        keep: list[RawExchange] = []
        for exchange in self._pending:
            step, attempt = self._attempt_after(exchange.session_seq)
            if attempt is not None:
                if not attempt.closed:
                    keep.append(exchange)  # still streaming: compare once it is complete
                    continue
                attempt.matched = True
                self.raw_matched += 1
                self._compare_raw(exchange, attempt)
            elif step is not None and step.end_seq is not None:
                self._unlogged(exchange, step)
            else:
                keep.append(exchange)
        self._pending = keep

    def _compare_raw(self, exchange: RawExchange, attempt: Attempt) -> None:
        step = f"{attempt.turn}.{attempt.step}"
        where = f"request {exchange.request_id} (step {step}, first chunk at seq {attempt.first_seq})"
        self._check_request(exchange, attempt, where)
        raw = parse_raw_response(exchange.response)
        logged = attempt.streamed()
        if exchange.status != 200:
            text, reasoning, calls = _channels(logged)
            if text or reasoning or calls:
                self._find(
                    RAW_STREAM_DIFFERS,
                    f"{where}: the provider answered HTTP {exchange.status}, but the log holds a response for it",
                    attempt.first_seq,
                    attempt.turn,
                    attempt.step,
                    exchange.request_id,
                )
            return
        partial = exchange.outcome != COMPLETE_OUTCOME or attempt.cut_short or raw.error is not None
        difference = raw_difference(raw, logged, finish=attempt.finish, partial=partial)
        if difference is not None:
            self._find(
                RAW_STREAM_DIFFERS,
                f"{where}: the provider's raw response differs from the logged chunks: {difference}",
                attempt.first_seq,
                attempt.turn,
                attempt.step,
                exchange.request_id,
            )
        if raw.usage is not None and attempt.usage is not None:
            usage_reason = provider_usage_difference(attempt.usage, raw.usage)
            if usage_reason is not None:
                self._find(
                    PROVIDER_USAGE_DIFFERS,
                    f"{where}: the provider reported other usage than the usage chunk: {usage_reason}",
                    attempt.first_seq,
                    attempt.turn,
                    attempt.step,
                    exchange.request_id,
                )

    def _check_request(self, exchange: RawExchange, attempt: Attempt, where: str) -> None:
        if attempt.header is None or not exchange.request:
            return  # already found (no header), or the tee holds no request bytes
        try:
            request = msgspec.json.decode(exchange.request)
        except msgspec.DecodeError:
            request = None
        if not isinstance(request, dict):
            self._find(
                REQUEST_NOT_REBUILDABLE,
                f"{where}: the raw request is not a JSON object",
                attempt.first_seq,
                attempt.turn,
                attempt.step,
                exchange.request_id,
            )
            return
        logged_model = attempt.header.header.config.model
        if request.get("model") != logged_model and request.get("model") == self.model_aliases.get(logged_model):
            request = {**request, "model": logged_model}  # the gateway's own rename of the logged model
        try:
            divergence = compare_request(request, attempt.messages, attempt.header, cache=self._wire)
        except SessionLogError as err:
            self._find(
                REQUEST_NOT_REBUILDABLE,
                f"{where}: the derivation has no wire form ({err.code}: {err.message})",
                attempt.first_seq,
                attempt.turn,
                attempt.step,
                exchange.request_id,
            )
            return
        if divergence is not None:
            self._find(
                REQUEST_NOT_REBUILDABLE,
                f"{where}: the request does not rebuild from the log prefix before seq {attempt.first_seq} "
                f"({divergence.code} at {divergence.path}): {divergence.message}",
                attempt.first_seq,
                attempt.turn,
                attempt.step,
                exchange.request_id,
            )

    def _unlogged(self, exchange: RawExchange, step: _Step) -> None:
        if exchange.status != 200:
            return  # a refused call: the agent may log a failed attempt or nothing
        raw = parse_raw_response(exchange.response)
        if raw.text or raw.reasoning or raw.tool_calls:
            self._find(
                RAW_STREAM_DIFFERS,
                f"request {exchange.request_id}: the provider answered in step {step.turn}.{step.step}, but the log "
                f"holds no chunks for it after seq {exchange.session_seq}",
                exchange.session_seq,
                step.turn,
                step.step,
                exchange.request_id,
            )

    # ------------------------------------------------------------------------------------------ reading

    def _find(
        self,
        code: str,
        message: str,
        seq: int | None,
        turn: int | None,
        step: int | None,
        request_id: str | None = None,
    ) -> None:
        self.findings.append(Finding(code=code, message=message, seq=seq, turn=turn, step=step, request_id=request_id))

    def step_report(self, turn: int, step: int) -> StepReport:
        found = self.steps.get((turn, step))
        if found is None:
            raise InvalidStep(f"session {self.session_id or '?'} has no step {turn}.{step}")
        attempts = found.attempts
        last = attempts[-1] if attempts else None
        text, reasoning, calls = _channels(last.assembled()) if last is not None else ("", "", [])
        return StepReport(
            turn=turn,
            step=step,
            attempts=len(attempts),
            chunks=sum(len(a.chunk_seqs) for a in attempts),
            first_chunk=attempts[0].first_seq if attempts else None,
            message=found.messages[-1] if found.messages else None,
            text=text,
            reasoning=reasoning,
            tool_calls=tuple((c[0], c[1], c[2]) for c in calls),
            usage=usage_dict(last.usage) if last is not None and last.usage is not None else None,
            finish=last.finish if last is not None else None,
            delta_mismatches=tuple(b.end_seq for a in attempts for b in a.blocks.values() if b.mismatched()),
        )

    def report(self) -> AuditReport:
        ledger = self.ledger()
        return AuditReport(
            session=self.session_id,
            seq=self.events - 1,
            events=self.events,
            chunks=self.chunks,
            steps=len(self.steps),
            ledger=ledger,
            findings=list(self.findings),
            raw_exchanges=self.raw_exchanges,
            raw_matched=self.raw_matched,
            provider_ledger=self.provider_ledger() if self.raw_exchanges else None,
            ledger_difference=self.ledger_difference(ledger),
        )


def _seq_list(seqs: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in seqs[:limit])
    return f"[{shown}{', ...' if len(seqs) > limit else ''}]"


def _seq_range(seqs: Sequence[int]) -> str:
    if not seqs:
        return "none"
    return f"seq {seqs[0]}" if len(seqs) == 1 else f"seqs {seqs[0]}-{seqs[-1]}"


def audit_session(
    session: Session,
    raw: Iterable[RawExchange] = (),
    *,
    session_id: str = "",
    model_aliases: Mapping[str, str] | None = None,
) -> SessionAuditor:
    """The audit of a whole log and the raw exchanges the gateway recorded for it."""
    auditor = SessionAuditor(session_id, model_aliases=model_aliases)
    auditor.feed(session, Session())
    for exchange in raw:
        auditor.add_raw(exchange)
    return auditor


# ---------------------------------------------------------------------------------------------- replay


def parse_step(text: str) -> tuple[int, int]:
    """`T.S` -> (turn, step)."""
    turn, dot, step = text.partition(".")
    if not dot or not turn.isdigit() or not step.isdigit() or int(turn) < 1 or int(step) < 1:
        raise InvalidStep(f"--step must be TURN.STEP (both from 1, for example 2.1), got {text!r}")
    return int(turn), int(step)


def step_chunks(session: Session, turn: int, step: int) -> list[Event]:
    """Every `assistant/chunk` of one step, in the order they were logged."""
    chunks = [e for e in session if e.type == "assistant/chunk" and e.data.turn == turn and e.data.step == step]
    if not chunks and not any(e.type == "step/start" and e.data.turn == turn and e.data.step == step for e in session):
        raise InvalidStep(f"the session has no step {turn}.{step}")
    return chunks


def chunk_delays(chunks: Sequence[Event]) -> Iterator[tuple[float, Event]]:
    """Each chunk with the seconds to wait before it to replay the step at its original pace (0 without times)."""
    previous: int | None = None
    for chunk in chunks:
        delay = 0.0
        if chunk.time is not None and previous is not None:
            delay = max(0.0, (chunk.time - previous) / 1000)
        if chunk.time is not None:
            previous = chunk.time
        yield delay, chunk


__all__ = [
    "FINDING_CODES",
    "MESSAGE_DIFFERS",
    "MESSAGE_USAGE_DIFFERS",
    "PROVENANCE_UNCOVERED",
    "PROVIDER_USAGE_DIFFERS",
    "RAW_STREAM_DIFFERS",
    "REQUEST_NOT_REBUILDABLE",
    "Attempt",
    "AuditReport",
    "Finding",
    "InvalidStep",
    "Ledger",
    "ModelTokens",
    "RawAssembler",
    "RawExchange",
    "RawResponse",
    "SessionAuditor",
    "StepReport",
    "TokenCounts",
    "audit_session",
    "chunk_delays",
    "content_difference",
    "parse_raw_response",
    "parse_step",
    "provider_usage_difference",
    "raw_difference",
    "raw_subject",
    "step_chunks",
    "usage_dict",
]
