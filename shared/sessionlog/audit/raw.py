"""The gateway's raw exchanges: the tee's messages joined back into `RawExchange`s, and how a provider's raw answer
(assembled by `sessionlog.openai_wire`) differs from what the agent logged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..events import Usage
from ..lru import LRU
from ..openai_wire import ChatUsage, RawResponse, parse_raw_response
from ..record import (
    H_RAW_BASE,
    H_RAW_BASE_PREFIX,
    H_RAW_KIND,
    H_RAW_OUTCOME,
    H_RAW_PART,
    H_RAW_PARTS,
    H_RAW_REQUEST_ID,
    H_RAW_ROOT_SEQ,
    H_RAW_SESSION_SEQ,
    H_RAW_SIZE,
    H_RAW_STATUS,
)
from .content import channels, clip

COMPLETE_OUTCOME: Final = "complete"


@dataclass(slots=True)
class RawExchange:
    """One request the gateway forwarded, from the raw audit stream: the exact bytes sent and received."""

    request_id: str
    session_seq: int  # the last seq of the durable log the gateway checked the request at
    request: bytes  # empty when the tee holds no request bytes (lost, or a delta whose base is gone)
    response: bytes
    status: int = 200
    outcome: str = COMPLETE_OUTCOME  # complete | client_disconnected | upstream_error


@dataclass(slots=True)
class _Delta:
    """A request entry stored as a delta whose base body this assembler does not have (yet)."""

    base: str  # the base request's id
    prefix: int  # leading bytes of the base's body kept
    size: int  # the whole body's size
    root_seq: int  # where the session's subject holds the whole entry the chain starts from
    data: bytes  # the bytes after the prefix
    paired: bool  # a request of the exchanges read (not a base read again)


class RawAssembler:
    """Turns raw-tee messages back into `RawExchange`s: parts joined, deltas rebuilt on their bases, the request
    paired with its response.

    Messages are taken in stream order (`take`), so a delta's base has come before it (the tee publishes a delta
    only once its base is acknowledged). A reader that started in the middle of a session's subject, or forgot a
    base (at most `max_base_bytes` of bodies are kept), lacks it: `wanted()` then says from which stream seq to read
    the subject again, and `take_base` takes those messages for their request bodies only; `give_up()` ends what
    still lacks its base with empty request bytes (its root is no longer on the stream)."""

    def __init__(self, max_open: int = 4096, max_base_bytes: int = 64 * 1024 * 1024) -> None:
        self._parts: dict[tuple[str, str], list[bytes | None]] = {}
        self._base_parts: dict[tuple[str, str], list[bytes | None]] = {}
        self._requests: dict[str, bytes] = {}
        # Request bodies by request id, at most `max_base_bytes` of them: the bases of the deltas still to come.
        self._bodies: LRU[str, bytes] = LRU(max_base_bytes, weigh=len)
        self._deltas: dict[str, _Delta] = {}  # request id -> a delta waiting for its base
        self._held: dict[str, tuple[Mapping[str, str], bytes]] = {}  # responses whose request waits for its base
        self._max_open = max_open

    # ---------------------------------------------------------------------------------- taking messages

    def take(self, headers: Mapping[str, str], data: bytes) -> list[RawExchange]:
        """Take one tee message; return the exchanges it completes (none, one, or those a base it was completed).
        Messages that are not tee entries are ignored."""
        entry = _joined(self._parts, headers, data)
        if entry is None:
            return []
        request_id, kind, body = entry
        if kind == "response":
            if request_id in self._deltas:
                self._held[request_id] = (headers, body)
                self._bound(self._held)
                return []
            return _exchange(headers, self._requests.pop(request_id, b""), body)
        delta = _delta_of(headers, body, paired=True)
        if delta is None:
            return self._request(request_id, body, paired=True)
        whole = self._rebuilt(delta)
        if whole is None:
            self._deltas[request_id] = delta
            if len(self._deltas) > self._max_open:  # bases that never come: their requests end without bytes
                oldest = next(iter(self._deltas))
                return self._resolved(oldest, b"")
            return []
        return self._request(request_id, whole, paired=True)

    def take_base(self, headers: Mapping[str, str], data: bytes) -> list[RawExchange]:
        """Take a message read again for the bases `wanted()` asked for: only a request's body is kept."""
        entry = _joined(self._base_parts, headers, data)
        if entry is None or entry[1] != "request":
            return []
        request_id, _, body = entry
        delta = _delta_of(headers, body, paired=False)
        if delta is None:
            return self._request(request_id, body, paired=False)
        whole = self._rebuilt(delta)
        if whole is None:
            if request_id not in self._deltas:
                self._deltas[request_id] = delta
            return []
        if request_id in self._deltas:  # a delta that was waiting, read again: rebuilt now
            return self._resolved(request_id, whole)
        return self._request(request_id, whole, paired=False)

    def wanted(self) -> int | None:
        """The stream seq from which the session's subject is to be read again for a missing base, or None."""
        return min((d.root_seq for d in self._deltas.values()), default=None)

    def give_up(self) -> list[RawExchange]:
        """Every delta still without its base ends with empty request bytes; the exchanges that completes."""
        out: list[RawExchange] = []
        for request_id in list(self._deltas):
            if request_id in self._deltas:
                out += self._resolved(request_id, b"")
        return out

    # ---------------------------------------------------------------------------------- inside

    def _rebuilt(self, delta: _Delta) -> bytes | None:
        """The delta's whole body; None while its base is not here; empty when it can never be rebuilt."""
        if not delta.base:  # unreadable headers: no base named
            return b""
        base = self._bodies.get(delta.base)
        if base is None or len(base) < delta.prefix:
            return None
        whole = base[: delta.prefix] + delta.data
        return whole if len(whole) == delta.size else b""  # not what the tee stored: no request bytes

    def _request(self, request_id: str, body: bytes, *, paired: bool) -> list[RawExchange]:
        """A request's whole body is known: keep it as a base, pair it, and rebuild the deltas waiting for it."""
        out: list[RawExchange] = []
        if body:
            self._bodies.put(request_id, body)
        if paired:
            self._requests[request_id] = body
            self._bound(self._requests)
        for waiting, delta in list(self._deltas.items()):
            if delta.base == request_id and waiting in self._deltas:
                whole = self._rebuilt(delta)
                if whole is not None:
                    out += self._resolved(waiting, whole)
        return out

    def _resolved(self, request_id: str, body: bytes) -> list[RawExchange]:
        delta = self._deltas.pop(request_id)
        held = self._held.pop(request_id, None)  # its response came meanwhile: the exchange is complete
        out = self._request(request_id, body, paired=delta.paired and held is None)
        if held is not None:
            out += _exchange(held[0], body, held[1])
        return out

    def _bound(self, entries: dict[str, Any]) -> None:
        while len(entries) > self._max_open:  # requests whose response never came, responses whose base never did
            entries.pop(next(iter(entries)))


def _joined(
    parts: dict[tuple[str, str], list[bytes | None]], headers: Mapping[str, str], data: bytes
) -> tuple[str, str, bytes] | None:
    """A tee entry's request id, kind and data once all its parts came, else None (or not a tee entry)."""
    request_id = headers.get(H_RAW_REQUEST_ID)
    kind = headers.get(H_RAW_KIND)
    if not request_id or kind not in ("request", "response"):
        return None
    try:
        part = int(headers.get(H_RAW_PART, "0"))
        count = int(headers.get(H_RAW_PARTS, "1"))
    except ValueError:
        return None
    if count < 1 or not 0 <= part < count:
        return None
    if count == 1:
        return request_id, kind, data
    slots = parts.setdefault((request_id, kind), [None] * count)
    if len(slots) != count:
        return None
    slots[part] = data
    if any(s is None for s in slots):
        return None
    del parts[(request_id, kind)]
    return request_id, kind, b"".join(s for s in slots if s is not None)


def _delta_of(headers: Mapping[str, str], data: bytes, *, paired: bool) -> _Delta | None:
    base = headers.get(H_RAW_BASE)
    if not base:
        return None
    try:
        prefix = int(headers.get(H_RAW_BASE_PREFIX, ""))
        size = int(headers.get(H_RAW_SIZE, ""))
        root = int(headers.get(H_RAW_ROOT_SEQ, ""))
    except ValueError:
        prefix, size, root = -1, -1, 0
    if prefix < 0 or size != prefix + len(data):  # unreadable (no base named): it can never be rebuilt
        return _Delta(base="", prefix=0, size=0, root_seq=1, data=b"", paired=paired)
    return _Delta(base=base, prefix=prefix, size=size, root_seq=max(root, 1), data=data, paired=paired)


def _exchange(headers: Mapping[str, str], request: bytes, response: bytes) -> list[RawExchange]:
    """The exchange a response completes (none when its headers are unreadable)."""
    try:
        session_seq = int(headers.get(H_RAW_SESSION_SEQ, "-1"))
        status = int(headers.get(H_RAW_STATUS, "200"))
    except ValueError:
        return []
    exchange = RawExchange(
        request_id=headers.get(H_RAW_REQUEST_ID, ""),
        session_seq=session_seq,
        request=request,
        response=response,
        status=status,
        outcome=headers.get(H_RAW_OUTCOME, COMPLETE_OUTCOME),
    )
    return [exchange]


def provider_usage_difference(logged: Usage, reported: ChatUsage) -> str | None:
    """Why the provider's reported usage is not the logged usage chunk, or None when they agree."""
    prompt, completion = reported.prompt_tokens, reported.completion_tokens
    cached, reasoning = reported.cached, reported.reasoning
    reasons: list[str] = []
    if prompt is not None:
        accepted = {prompt} | ({prompt - cached} if cached is not None else set())
        if logged.input_tokens not in accepted:
            reasons.append(f"input: logged {logged.input_tokens}, provider {prompt} prompt tokens")
    if completion is not None and logged.output_tokens != completion:
        reasons.append(f"output: logged {logged.output_tokens}, provider {completion}")
    if cached is not None and type(logged.cache_read_tokens) is int and logged.cache_read_tokens != cached:
        reasons.append(f"cache read: logged {logged.cache_read_tokens}, provider {cached}")
    if reasoning is not None and type(logged.reasoning_tokens) is int and logged.reasoning_tokens != reasoning:
        reasons.append(f"reasoning: logged {logged.reasoning_tokens}, provider {reasoning}")
    return "; ".join(reasons) or None


def raw_difference(raw: RawResponse, logged: Sequence[Any], *, finish: str | None, partial: bool) -> str | None:
    """Why the provider's raw response does not carry what the agent logged, or None when it does.

    `partial`: the call was cut short on either side, so the log need only hold a prefix of what the provider sent.
    """
    text, reasoning, calls = channels(logged)
    for name, mine, theirs in (("text", text, raw.text), ("reasoning", reasoning, raw.reasoning)):
        same = theirs.startswith(mine) if partial else theirs == mine
        if not same:
            return f"{name}: logged {clip(mine)!r}, the provider sent {clip(theirs)!r}"
    if partial:
        if len(calls) > len(raw.tool_calls) or any(
            a[0] != b[0] or a[1] != b[1] or not b[2].startswith(a[2])
            for a, b in zip(calls, raw.tool_calls, strict=False)
        ):
            return f"tool calls: logged {calls}, the provider sent {raw.tool_calls}"
    elif calls != raw.tool_calls:
        return f"tool calls: logged {calls}, the provider sent {raw.tool_calls}"
    # A step that called tools finishes `tool-calls` in the log, whatever finish the provider gave its calls
    # (some OpenAI-compatible servers say `stop`): that is what such a finish means, not a difference.
    called = finish == "tool-calls" and raw.tool_calls and raw.finish in ("stop", "tool-calls")
    if not partial and finish is not None and raw.finish is not None and finish != raw.finish and not called:
        return f"finish: logged {finish!r}, the provider sent {raw.finish!r}"
    return None


__all__ = [
    "COMPLETE_OUTCOME",
    "RawAssembler",
    "RawExchange",
    "RawResponse",
    "parse_raw_response",
    "provider_usage_difference",
    "raw_difference",
]
