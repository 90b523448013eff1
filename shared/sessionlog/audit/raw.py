"""The gateway's raw exchanges: the tee's messages joined back into `RawExchange`s, and how a provider's raw answer
(assembled by `sessionlog.openai_wire`) differs from what the agent logged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..events import Usage
from ..openai_wire import ChatUsage, RawResponse, parse_raw_response
from ..record import (
    H_RAW_KIND,
    H_RAW_OUTCOME,
    H_RAW_PART,
    H_RAW_PARTS,
    H_RAW_REQUEST_ID,
    H_RAW_SESSION_SEQ,
    H_RAW_STATUS,
)
from .content import channels, clip

COMPLETE_OUTCOME: Final = "complete"


@dataclass(slots=True)
class RawExchange:
    """One request the gateway forwarded, from the raw audit stream: the exact bytes sent and received."""

    request_id: str
    session_seq: int  # the last seq of the durable log the gateway checked the request at
    request: bytes
    response: bytes
    status: int = 200
    outcome: str = COMPLETE_OUTCOME  # complete | client_disconnected | upstream_error


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
    if not partial and finish is not None and raw.finish is not None and finish != raw.finish:
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
