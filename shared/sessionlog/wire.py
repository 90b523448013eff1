"""The gateway wire conversion and the invariant's comparison: derived messages and the folded header to an
OpenAI-compatible chat-completions request, and a request checked against them. Pure: no I/O.

This is the one documented conversion (ARCHITECTURE.md, "Gateway wire conversion") that the gateway and clients
share; a client that builds its request with `to_wire` passes the gateway's check by construction.

Messages, in order:

- `header.system` (when not empty) becomes the first message `{"role": "system", "content": system}`, or
  `{"role": "developer", ...}` when `config.systemRole` is `"developer"` (record mode logs a client's first
  developer message so; the key is not a request field, and any other value is `UNSUPPORTED_CONTENT`).
- An assistant message becomes `{"role": "assistant", "content": text}`: its text blocks concatenated with no
  separator, the empty string (never null: DeepSeek rejects null) when there are none; its `tool-call` blocks
  become `tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]` and its reasoning blocks,
  concatenated, `reasoning_content`. Either key is present only when the message has such blocks.
- A message holding `tool-result` blocks (a `tool/result` event's message) becomes one
  `{"role": "tool", "tool_call_id", "content": text}` per block, `content` being the result's text blocks
  concatenated; text blocks beside them (none in a valid tool/result) follow as one user message.
- Any other message (`user`, and `system` or `developer` when a plugin writes one) becomes
  `{"role": role, "content": text}`, its text blocks concatenated with no separator (as DeepSeek's client does).
- Image blocks carry only an attachment id; until the blob store supplies the bytes they are refused with
  `UNSUPPORTED_CONTENT`, as is any block with no place on the wire (reasoning or a tool call outside an assistant
  message, a tool result inside one) and any other role: nothing model-visible is dropped silently.

The rest of the request comes from the folded header:

- `model` is `config.model`; `config.provider` chooses the gateway's route and is not sent, nor is
  `config.systemRole`.
- Every other config key is sent under its snake_case name: `temperature`, `max_tokens` (`maxTokens`), `top_p`
  (`topP`), `stop`, `reasoning_effort` (`reasoningEffort`), and any other sampling field the header holds. A null
  value counts as absent (a JavaScript `undefined` that reached the log). `adapterDefaults` only says which values
  the adapter filled in; the values themselves are in `config`.
- `header.tools` (when not empty) become `[{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}]`, `description`, `parameters` and `strict` only when the tool has them.

The comparison is on canonical JSON (sorted keys, compact separators, UTF-8). The `messages` array, system message
included, is compared as a whole: any difference there is `DERIVATION_DIVERGES`. Every other request field must
equal what the header gives, so a `tool_choice`, `seed` or `response_format` that the log does not hold is
`HEADER_DIVERGES`; only the transport fields (`stream`, `stream_options`) are left out of the comparison. When the
bytes differ, the request is compared again under `sessionlog.wireforms`' equivalence (null content, text-part
arrays, a tool message's `name`, `1.0` for `1`): only what really differs is refused. Dropped reasoning is a
difference here (the client wrote the log itself); record mode, whose client did not, accepts it.

Speed: a `WireCache` (one per session) keeps the canonical wire fragment of every surface node (keyed by the logged
message bytes, so a message is converted and encoded once) and the joined `messages` bytes of the last derivation it
saw, extended by the new nodes only while the generation stays the same. On the request side, `parse_request(body,
lazy=True)` leaves `messages` as the bytes it arrived as; the cache remembers the previous request's array and its
canonical bytes, and when the new array starts with those same bytes (an agent's next request repeats its context
and adds to it) only the added messages are decoded and encoded. That memo is a pure function of the bytes, never of
the log: every request is still compared in full, byte for byte, with the derivation it is checked against. Only
when the bytes differ are both sides walked to name the JSON path of the first difference (`$.messages[3].content`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from .errors import DerivationDiverges, HeaderDiverges, InvalidRequest, SessionLogError, UnsupportedContent
from .events import ImageBlock, ReasoningBlock, TextBlock, ToolCallBlock, ToolResultBlock
from .session import DerivedMessage, DerivedMessages, FoldedHeader
from .wireforms import SYSTEM_ROLE_KEY, SYSTEM_ROLES, normal_message, wire_tool
from .wireforms import canonical as normal_canonical

TRANSPORT_FIELDS: Final = frozenset({"stream", "stream_options"})
# The deepest request body the gateway reads. Past Python's recursion limit (about 1,000) every decoder and the
# comparison raise RecursionError (a 500); 128 leaves room for tools' JSON schemas nested 60 properties deep.
PHRASE: Final = "diverges from the dispatch-time durable derivation"

_encoder: Final = msgspec.json.Encoder(order="sorted")
_top_decoder: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
# What may follow the last element of a JSON array's prefix: whitespace, then the next element's comma or the end.
_ARRAY_GOES_ON: Final = re.compile(rb"[ \t\n\r]*([,\]])")
_CAMEL_RE: Final = re.compile(r"(?<=[a-z0-9])([A-Z])")
_PLAIN_ROLES: Final = frozenset({"user", "system", "developer"})


def canonical(value: Any) -> bytes:
    """Canonical JSON of plain data: sorted keys, compact separators, UTF-8."""
    return _encoder.encode(value)


def snake_case(name: str) -> str:
    """`maxTokens` -> `max_tokens`; names already in snake_case stay as they are."""
    return _CAMEL_RE.sub(r"_\1", name).lower()


# ---------------------------------------------------------------------------------------------- conversion


def _text_of(blocks: Sequence[Any], seq: int, where: str) -> str:
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ImageBlock):
            raise UnsupportedContent(
                f"{where}: an image block (attachment {msgspec.json.encode(block.attachment).decode()}) cannot be "
                "sent until the blob store supplies its bytes; it is refused rather than dropped",
                seq=seq,
            )
        else:
            raise UnsupportedContent(f"{where}: a {type(block).__name__} has no place on the wire here", seq=seq)
    return "".join(parts)


def wire_messages(message: DerivedMessage) -> list[dict[str, Any]]:
    """The wire messages one derived message becomes (usually one; a message of tool results gives one each)."""
    msg = message.message
    seq = message.seq
    if msg.role == "assistant":
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in msg.content:
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ReasoningBlock):
                reasoning.append(block.text)
            elif isinstance(block, ToolCallBlock):
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.arguments}}
                )
            else:
                _text_of((block,), seq, f"assistant message {msg.id!r}")
        out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            out["tool_calls"] = calls
        if reasoning:
            out["reasoning_content"] = "".join(reasoning)
        return [out]
    results = [b for b in msg.content if isinstance(b, ToolResultBlock)]
    if results:
        wire = [
            {
                "role": "tool",
                "tool_call_id": r.tool_call_id,
                "content": _text_of(r.content, seq, f"tool result {r.tool_call_id!r}"),
            }
            for r in results
        ]
        rest = [b for b in msg.content if not isinstance(b, ToolResultBlock)]
        if rest:
            wire.append({"role": "user", "content": _text_of(rest, seq, f"message {msg.id!r}")})
        return wire
    if msg.role not in _PLAIN_ROLES:
        raise UnsupportedContent(f"message {msg.id!r}: role {msg.role!r} has no wire form", seq=seq)
    return [{"role": msg.role, "content": _text_of(msg.content, seq, f"{msg.role} message {msg.id!r}")}]


def header_fields(header: FoldedHeader) -> tuple[str | None, dict[str, Any]]:
    """The system prompt (None when absent) and every request field other than `messages` the header gives."""
    system, fields = header_parts(header)
    return (system["content"] if system is not None else None), fields


def header_parts(header: FoldedHeader) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The system message the header gives (None when it has no system prompt; its role is `config.systemRole`,
    `system` by default) and every request field other than `messages`. Raises `UNSUPPORTED_CONTENT` for a
    `systemRole` that is neither `system` nor `developer`."""
    data = header.to_builtins()
    config: dict[str, Any] = data.get("config", {})
    out: dict[str, Any] = {"model": config.get("model")}
    tools = data.get("tools")
    if tools:
        out["tools"] = [wire_tool(tool) for tool in tools]
    for key, value in config.items():
        if key in ("provider", "model", SYSTEM_ROLE_KEY) or value is None:
            continue
        out[snake_case(key)] = value
    role = config.get(SYSTEM_ROLE_KEY) or "system"
    if role not in SYSTEM_ROLES:
        raise UnsupportedContent(
            f"request/header: config.{SYSTEM_ROLE_KEY} {role!r} has no wire form (system or developer)",
            seq=header.seq if header.seq >= 0 else None,
        )
    system = data.get("system")
    return (system_message(system, role) if isinstance(system, str) and system else None), out


def system_message(system: str, role: str = "system") -> dict[str, Any]:
    return {"role": role, "content": system}


def to_wire(messages: Sequence[DerivedMessage], header: FoldedHeader) -> dict[str, Any]:
    """The OpenAI-compatible request (plain data, no transport fields) for these derived messages and header."""
    system, fields = header_parts(header)
    wire: list[dict[str, Any]] = [system] if system is not None else []
    for message in messages:
        wire.extend(wire_messages(message))
    return {"model": fields.pop("model"), "messages": wire, **fields}


# ---------------------------------------------------------------------------------------------- cache


class WireCache:
    """Canonical wire bytes per derived message and per header, and the last request's canonical `messages`.

    Fragments are keyed by the logged bytes (a message's wire form is a pure function of them), so they are correct
    across generations and sources; the cache forgets messages that left the surface when it grows past twice the
    surface. The joined expected bytes are reused for the same derivation view and extended for a longer view of
    the same generation (`DerivedMessages.extends`); any other sequence of messages is joined afresh.
    """

    __slots__ = ("_expected", "_fragments", "_header", "_sent")

    def __init__(self) -> None:
        self._fragments: dict[bytes, bytes] = {}
        self._header: tuple[bytes, bytes | None, bytes, dict[str, Any]] | None = None
        # (header entry, the derivation's messages, their joined canonical bytes)
        self._expected: tuple[object, Sequence[DerivedMessage], bytes] | None = None
        # (the last request's `messages` bytes as sent, where its closing bracket is, its canonical bytes)
        self._sent: tuple[bytes, int, bytes] | None = None

    def __len__(self) -> int:
        return len(self._fragments)

    def fragment(self, message: DerivedMessage) -> bytes:
        """The message's wire messages as canonical JSON, comma-joined (an array's inside)."""
        key = message.raw
        frag = self._fragments.get(key)
        if frag is None:
            frag = b",".join(_encoder.encode(m) for m in wire_messages(message))
            self._fragments[key] = frag
        return frag

    def _header_entry(self, header: FoldedHeader) -> tuple[bytes, bytes | None, bytes, dict[str, Any]]:
        entry = self._header
        if entry is None or entry[0] != header.raw:
            system, fields = header_parts(header)
            sys_frag = _encoder.encode(system) if system is not None else None
            entry = (header.raw, sys_frag, _encoder.encode(fields), fields)
            self._header = entry
        return entry

    def expected_messages(self, messages: Sequence[DerivedMessage], header: FoldedHeader) -> bytes:
        """Canonical JSON of the request's `messages` array as the derivation gives it."""
        entry = self._header_entry(header)
        last = self._expected
        if last is not None and last[0] is entry:
            _, seen, joined = last
            if seen is messages:
                return joined
            if isinstance(messages, DerivedMessages) and isinstance(seen, DerivedMessages) and messages.extends(seen):
                new = [self.fragment(messages[i]) for i in range(len(seen), len(messages))]
                if new:  # one copy of the old bytes, not one per concatenation
                    joined = b"".join((memoryview(joined)[:-1], b"," if len(joined) > 2 else b"", b",".join(new), b"]"))
                self._expected = (entry, messages, joined)
                return joined
        sys_frag = entry[1]
        frags = [self.fragment(m) for m in messages]
        if sys_frag is not None:
            frags.insert(0, sys_frag)
        if len(self._fragments) > 2 * len(messages) + 64:
            keep = {m.raw for m in messages}
            self._fragments = {k: v for k, v in self._fragments.items() if k in keep}
        joined = b"[" + b",".join(frags) + b"]"
        self._expected = (entry, messages, joined)
        return joined

    def expected_fields(self, header: FoldedHeader) -> tuple[bytes, dict[str, Any]]:
        """Canonical JSON of every non-message field the header gives, and those fields as plain data."""
        _, _, fields_bytes, fields = self._header_entry(header)
        return fields_bytes, fields

    def sent_messages(self, sent: bytes) -> bytes | None:
        """Canonical JSON of a request's `messages` array given as the bytes it arrived as (already known to be
        well-formed JSON), or None when it is not an array.

        When `sent` starts with the previous request's array up to its closing bracket, and what follows is that
        bracket or a comma (so the prefix ends on an element boundary), the prefix's canonical bytes are reused and
        only the elements after it are decoded and encoded. Those prefix bytes were decoded in full before, so
        reusing them validates nothing less.
        """
        last = self._sent
        canonical: bytes | None = None
        if last is not None:
            before, close, before_canonical = last
            if sent == before:
                return before_canonical
            if sent.startswith(memoryview(before)[:close]):
                goes_on = _ARRAY_GOES_ON.match(sent, close)
                if goes_on is not None:
                    if goes_on.group(1) == b"]":
                        if sent[goes_on.end() :].strip():
                            raise InvalidRequest("the request's messages are not one JSON array")
                        canonical = before_canonical
                    else:
                        added = msgspec.json.decode(b"[" + sent[goes_on.end() :])
                        tail = memoryview(_encoder.encode(added))[1:]
                        canonical = b"".join((memoryview(before_canonical)[:-1], b",", tail))
        if canonical is None:
            value = msgspec.json.decode(sent)
            if not isinstance(value, list):
                return None
            canonical = _encoder.encode(value)
        # An empty array has no element for a later one to follow with a comma: it is not remembered.
        self._sent = (sent, len(sent.rstrip()) - 1, canonical) if len(canonical) > 2 else None
        return canonical

    def _share(self, expected: bytes) -> None:
        """The last `sent_messages` result was found equal to `expected`: keep one copy of those bytes, not two."""
        last = self._sent
        if last is not None and last[2] is not expected:
            self._sent = (last[0], last[1], expected)


# ---------------------------------------------------------------------------------------------- comparison


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first difference between a request and the derivation: its code, JSON path and a readable message."""

    code: str
    path: str
    message: str
    seq: int | None = None

    def error(self) -> SessionLogError:
        cls = DerivationDiverges if self.code == DerivationDiverges.code else HeaderDiverges
        return cls(self.message, seq=self.seq)


_MISSING: Final = object()


def _show(value: Any, limit: int = 120) -> str:
    if value is _MISSING:
        return "nothing"
    text = msgspec.json.encode(value, order="sorted").decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    # bool is an int and 1 == 1.0 in Python; JSON tells them apart
    return type(a) is type(b) and a == b


def first_difference(expected: Any, actual: Any, path: str = "$") -> tuple[str, Any, Any] | None:
    """The JSON path of the first place `actual` differs from `expected`, with both values there; None if equal.

    Objects are walked in sorted key order (as canonical JSON lists them), arrays by index.
    """
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(expected.keys() | actual.keys()):
            sub = f"{path}.{key}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else f"{path}[{_show(key)}]"
            if key not in actual:
                return sub, expected[key], _MISSING
            if key not in expected:
                return sub, _MISSING, actual[key]
            found = first_difference(expected[key], actual[key], sub)
            if found is not None:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(e, a, f"{path}[{i}]")
            if found is not None:
                return found
        if len(expected) != len(actual):
            i = min(len(expected), len(actual))
            return (
                f"{path}[{i}]",
                expected[i] if i < len(expected) else _MISSING,
                actual[i] if i < len(actual) else _MISSING,
            )
        return None
    if isinstance(expected, dict | list) or isinstance(actual, dict | list) or not _same(expected, actual):
        return path, expected, actual
    return None


def _message_seq(messages: Sequence[DerivedMessage], header: FoldedHeader, index: int) -> int | None:
    """The seq of the derived message that wire message `index` comes from (None for the system message)."""
    system, _ = header_fields(header)
    position = 1 if system is not None else 0
    if index < position:
        return header.seq if header.seq >= 0 else None
    for message in messages:
        position += len(wire_messages(message))
        if index < position:
            return message.seq if message.seq >= 0 else None
    return None


def parse_request(body: bytes | Mapping[str, Any], *, lazy: bool = False) -> dict[str, Any]:
    """The request body as plain data; refused (`INVALID_REQUEST`) when it is not a JSON object.

    With `lazy`, `messages` stays as the bytes it arrived as (a `msgspec.Raw`, which `compare_request` reads with
    the cache's memo and `msgspec.json.encode` writes back unchanged); every other field is decoded.
    """
    if isinstance(body, Mapping):
        return dict(body)
    try:
        request = _parse_body(body, lazy)
    except RecursionError:
        raise too_deep() from None
    _check_transport(request)
    return request


def _check_transport(request: Mapping[str, Any]) -> None:
    """`stream` a boolean and `stream_options` an object (or null): a provider would read `"yes"` as it pleases,
    and the gateway relays a stream only for `true`."""
    stream = request.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"$.stream: expected true or false, got {stream!r}")
    options = request.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest(f"$.stream_options: expected an object, got {options!r}")


def too_deep() -> InvalidRequest:
    """A body nested deeper than the decoders (or the comparison) recurse. Caught where it happens rather than
    scanned for up front: a scan of every body cost two decodes (2026-12-03, bench_gateway)."""
    return InvalidRequest("the request body nests JSON objects and arrays too deeply")


# Half of a UTF-16 surrogate pair as a JSON escape: a high half not followed by a low one, or a low half alone.
_LONE_SURROGATE: Final = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def not_json(what: str, body: bytes, exc: msgspec.DecodeError) -> InvalidRequest:
    """The refusal of JSON that does not decode: half a surrogate pair named as such (msgspec may say "Input data
    was truncated" of it; JavaScript's JSON.stringify writes one for a string cut inside an emoji)."""
    lone = _LONE_SURROGATE.search(body)
    if lone is not None:
        return InvalidRequest(
            f"{what} is not JSON: the escape {lone.group().decode()} at byte {lone.start()} is half of a UTF-16 "
            "surrogate pair, which is not a character (a string cut inside an emoji?)"
        )
    return InvalidRequest(f"{what} is not JSON: {exc}")


def _parse_body(body: bytes, lazy: bool) -> dict[str, Any]:
    if lazy:
        try:
            fields = _top_decoder.decode(body)
        except msgspec.DecodeError:
            pass  # not JSON, or not an object: the plain parse below names the problem
        else:
            try:
                return {k: v if k == "messages" else msgspec.json.decode(v) for k, v in fields.items()}
            except msgspec.DecodeError as exc:  # invalid UTF-8 inside a string, which skipping does not check
                raise not_json("the request body", body, exc) from None
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise not_json("the request body", body, exc) from None
    if not isinstance(request, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(request).__name__}")
    return request


def checked_body(request: Mapping[str, Any], expected_messages: bytes) -> bytes:
    """The bytes to forward for a request that passed the check: its fields re-encoded from what was compared, and
    its `messages` as the derivation's canonical bytes (equal to the request's, or the check would have refused).
    A provider then reads exactly what was checked, whatever duplicate keys or spacing the caller's bytes held."""
    fields = {key: value for key, value in request.items() if key != "messages"}
    fields["messages"] = msgspec.Raw(expected_messages)
    return _encoder.encode(fields)


def compare_request(
    request: Mapping[str, Any],
    messages: Sequence[DerivedMessage],
    header: FoldedHeader,
    *,
    cache: WireCache | None = None,
) -> Divergence | None:
    """The first divergence of a parsed request from the derivation, or None when it matches exactly.

    `request["messages"]` may be plain data or, from `parse_request(..., lazy=True)`, the bytes it arrived as.
    Raises `UNSUPPORTED_CONTENT` when the derivation holds content the conversion cannot carry, and
    `INVALID_REQUEST` when `messages` is missing, not JSON, or not an array of objects with a `role`.
    """
    cache = cache if cache is not None else WireCache()
    expected_messages = cache.expected_messages(messages, header)
    actual_messages = request.get("messages", _MISSING)
    if isinstance(actual_messages, msgspec.Raw):
        try:
            actual_bytes = cache.sent_messages(bytes(actual_messages))
            if actual_bytes == expected_messages:
                cache._share(expected_messages)
                return _compare_fields(request, header, cache)
            if actual_bytes is not None and _equivalent_messages(msgspec.json.decode(actual_bytes), expected_messages):
                return _compare_fields(request, header, cache)
            actual_messages = msgspec.json.decode(actual_messages)  # only to name the difference
        except msgspec.DecodeError as exc:
            raise not_json("the request body", bytes(actual_messages), exc) from None
    _check_messages_shape(actual_messages)
    if _encoder.encode(actual_messages) != expected_messages and not _equivalent_messages(
        actual_messages, expected_messages
    ):
        expected_list = msgspec.json.decode(expected_messages)
        found = first_difference(expected_list, actual_messages, "$.messages")
        if found is None:  # pragma: no cover - equal plain data always encodes equally
            found = ("$.messages", expected_list, actual_messages)
        path, want, got = found
        index_match = re.match(r"\$\.messages\[(\d+)\]", path)
        seq = _message_seq(messages, header, int(index_match.group(1))) if index_match else None
        count = ""
        if len(expected_list) != len(actual_messages):
            count = f" (the request has {len(actual_messages)} messages, the derivation {len(expected_list)})"
        where = f" (the derived message at seq {seq})" if seq is not None else ""
        return Divergence(
            DerivationDiverges.code,
            path,
            f"request {PHRASE} at {path}{where}: expected {_show(want)}, got {_show(got)}{count}",
            seq,
        )
    return _compare_fields(request, header, cache)


def _equivalent_messages(actual: Any, expected: bytes) -> bool:
    """Whether a request's messages, which are not byte-equal to the derivation's, carry the same thing in other
    wire forms (`sessionlog.wireforms`: null content, text-part arrays, a tool `name`, `1.0` for `1`). Reasoning
    stays strict here: a client that wrote its log itself sends what it logged."""
    if not isinstance(actual, list):
        return False
    try:
        normal = [normal_message(m) for m in actual]
    except SessionLogError:
        return False
    return normal_canonical(normal) == normal_canonical(msgspec.json.decode(expected))


def _check_messages_shape(messages: Any) -> None:
    """Refuse (`INVALID_REQUEST`) a `messages` that is no chat-completions messages array at all: that is a bad
    request, which no log could derive, not a divergence from this log."""
    if messages is _MISSING:
        raise InvalidRequest("the request has no `messages` ($.messages): a chat-completions request needs an array")
    if not isinstance(messages, list):
        raise InvalidRequest(f"$.messages must be an array of messages, got {_show(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"$.messages[{i}] must be an object with a string `role`, got {_show(message)}")


def _compare_fields(request: Mapping[str, Any], header: FoldedHeader, cache: WireCache) -> Divergence | None:
    """The first divergence of the request's fields other than `messages` from the header, or None."""
    expected_bytes, expected_fields = cache.expected_fields(header)
    rest = {k: v for k, v in request.items() if k != "messages" and k not in TRANSPORT_FIELDS}
    if _encoder.encode(rest) != expected_bytes and normal_canonical(rest) != normal_canonical(expected_fields):
        found = first_difference(expected_fields, rest)
        if found is None:  # pragma: no cover
            found = ("$", expected_fields, rest)
        path, want, got = found
        where_header = f"the request/header at seq {header.seq}" if header.seq >= 0 else "the folded request/header"
        hint = ""
        if want is _MISSING:
            hint = " (the request/header holds no such field: model-visible input must be logged first)"
        return Divergence(
            HeaderDiverges.code,
            path,
            f"request {PHRASE} at {path} ({where_header}): expected {_show(want)}, got {_show(got)}{hint}",
            header.seq if header.seq >= 0 else None,
        )
    return None


def check_request(
    request: bytes | Mapping[str, Any],
    messages: Sequence[DerivedMessage],
    header: FoldedHeader,
    *,
    cache: WireCache | None = None,
) -> dict[str, Any]:
    """Check a request against the derivation; return it parsed, or raise `DERIVATION_DIVERGES` /
    `HEADER_DIVERGES` (naming the JSON path of the first difference), `UNSUPPORTED_CONTENT` or
    `INVALID_REQUEST`."""
    parsed = parse_request(request)
    divergence = compare_request(parsed, messages, header, cache=cache)
    if divergence is not None:
        raise divergence.error()
    return parsed


__all__ = [
    "PHRASE",
    "TRANSPORT_FIELDS",
    "Divergence",
    "InvalidRequest",
    "WireCache",
    "canonical",
    "check_request",
    "compare_request",
    "first_difference",
    "header_fields",
    "header_parts",
    "not_json",
    "parse_request",
    "snake_case",
    "system_message",
    "to_wire",
    "wire_messages",
]
