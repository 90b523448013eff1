"""The event vocabulary (SPEC sections 2 and 3) as msgspec Structs, and the one decoder of event bytes.

The bytes an event arrived as are the truth. `decode_event` validates them against the envelope and the
type's schema and returns an `Event`: the original bytes plus a typed view of `data`. Nothing here ever
re-encodes an event that came from outside; events the library creates itself (closers, end-seeds) are
encoded once by `encode_new_event` and are bytes from then on.

Unknown keys inside `data` are allowed (the Structs ignore them, the bytes keep them); unknown keys in the
envelope are not (`INVALID_EVENT`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from .errors import EventTooDeep, InvalidEvent, UnknownEventType
from .eventbytes import MAX_EVENT_DEPTH as MAX_EVENT_DEPTH  # re-exported: readers of events know the limit here
from .eventbytes import check_depth, check_utf8
from .eventbytes import nests_deeper_than as nests_deeper_than

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]


class _Wire(Struct, frozen=True, rename="camel", omit_defaults=True, gc=False):
    """Base of wire Structs: camelCase names, absent optional fields stay absent when encoded.

    gc=False (as `Event`): a session holder keeps every event it applied, and while their data were tracked objects
    every full garbage collection walked the whole log (pauses of 100 ms and more in a deriver holding 200,000
    events). Data decoded from JSON, or built from JSON-encodable values, forms no reference cycles.
    """


# ---------------------------------------------------------------------------------------------- content


class TextBlock(_Wire, frozen=True, tag="text", tag_field="type"):
    text: str


class ReasoningBlock(_Wire, frozen=True, tag="reasoning", tag_field="type"):
    text: str


class ImageBlock(_Wire, frozen=True, tag="image", tag_field="type"):
    attachment: dict[str, Any]


class ToolCallBlock(_Wire, frozen=True, tag="tool-call", tag_field="type"):
    id: str
    name: str
    arguments: str


class ToolResultBlock(_Wire, frozen=True, tag="tool-result", tag_field="type"):
    tool_call_id: str
    is_error: bool | UnsetType = UNSET
    content: tuple[Block, ...] = ()


Block = TextBlock | ReasoningBlock | ImageBlock | ToolCallBlock | ToolResultBlock


class Source(_Wire, frozen=True):
    """Where a message came from. Other keys dsh writes here (form, sections, rpcId, ...) stay in the bytes."""

    kind: str
    provider: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    call_id: str | UnsetType = UNSET
    plugin: str | UnsetType = UNSET


class Message(_Wire, frozen=True):
    id: str
    role: str
    source: Source
    content: tuple[Block, ...]


class Usage(_Wire, frozen=True):
    input_tokens: NonNegInt
    output_tokens: NonNegInt
    cache_read_tokens: NonNegInt | UnsetType = UNSET
    cache_write_tokens: NonNegInt | UnsetType = UNSET
    reasoning_tokens: NonNegInt | UnsetType = UNSET


# ---------------------------------------------------------------------------------------------- chunks


class BlockStartChunk(_Wire, frozen=True, tag="block-start", tag_field="type"):
    index: NonNegInt
    block_type: str


class TextDeltaChunk(_Wire, frozen=True, tag="text-delta", tag_field="type"):
    index: NonNegInt
    text: str


class ReasoningDeltaChunk(_Wire, frozen=True, tag="reasoning-delta", tag_field="type"):
    index: NonNegInt
    text: str


class ToolCallDeltaChunk(_Wire, frozen=True, tag="tool-call-delta", tag_field="type"):
    index: NonNegInt
    id: str
    name: str | UnsetType = UNSET
    arguments_delta: str = ""


class BlockEndChunk(_Wire, frozen=True, tag="block-end", tag_field="type"):
    index: NonNegInt
    block: Block


class UsageChunk(_Wire, frozen=True, tag="usage", tag_field="type"):
    usage: Usage


class FinishReason(_Wire, frozen=True):
    kind: str


class FinishChunk(_Wire, frozen=True, tag="finish", tag_field="type"):
    reason: FinishReason


Chunk = (
    BlockStartChunk
    | TextDeltaChunk
    | ReasoningDeltaChunk
    | ToolCallDeltaChunk
    | BlockEndChunk
    | UsageChunk
    | FinishChunk
)

# ---------------------------------------------------------------------------------------------- turn/end


class AbortReason(_Wire, frozen=True):
    kind: Literal["user", "parent", "hook", "disposed", "legacy"]


class ErrorInfo(_Wire, frozen=True):
    message: str
    code: str
    status: int | UnsetType = UNSET


class Completed(_Wire, frozen=True, tag="completed", tag_field="kind"):
    pass


class Aborted(_Wire, frozen=True, tag="aborted", tag_field="kind"):
    reason: AbortReason


class Blocked(_Wire, frozen=True, tag="blocked", tag_field="kind"):
    pass


class Errored(_Wire, frozen=True, tag="error", tag_field="kind"):
    error: ErrorInfo


class MaxTokens(_Wire, frozen=True, tag="max-tokens", tag_field="kind"):
    pass


class Interrupted(_Wire, frozen=True, tag="interrupted", tag_field="kind"):
    pass


TurnEndReason = Completed | Aborted | Blocked | Errored | MaxTokens | Interrupted

# ---------------------------------------------------------------------------------------------- data


class TurnStartData(_Wire, frozen=True):
    turn: PosInt


class TurnEndData(_Wire, frozen=True):
    turn: PosInt
    reason: TurnEndReason


class StepData(_Wire, frozen=True):
    """`step/start` and `step/end`; every step-scoped event's data begins with these two fields."""

    turn: PosInt
    step: PosInt


class AssistantChunkData(StepData, frozen=True):
    chunk: Chunk


class AssistantMessageData(StepData, frozen=True):
    message: Message
    usage: Usage | UnsetType = UNSET
    interrupted: bool | UnsetType = UNSET


class ToolCallData(StepData, frozen=True):
    call_id: str
    name: str
    arguments: str


class ToolError(_Wire, frozen=True):
    name: str
    code: str


class ToolResultData(StepData, frozen=True):
    message: Message
    error: ToolError | UnsetType = UNSET
    meta: dict[str, Any] | UnsetType = UNSET


class ToolSpec(_Wire, frozen=True):
    name: str
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET


class RequestConfig(_Wire, frozen=True):
    """Provider and model are required; sampling fields (temperature, maxTokens, stop, ...) stay in the bytes."""

    provider: str
    model: str


class RequestHeader(_Wire, frozen=True):
    config: RequestConfig
    adapter_defaults: dict[str, Any] | UnsetType = UNSET
    system: str | UnsetType = UNSET
    tools: list[ToolSpec] | UnsetType = UNSET


class RequestHeaderData(_Wire, frozen=True):
    header: RequestHeader
    reason: Literal["initial", "resume", "change"]


class RequestContextData(_Wire, frozen=True):
    provider: str
    model: str
    context_window: NonNegInt | UnsetType = UNSET


class Todo(_Wire, frozen=True):
    content: str
    status: str


class TodoWriteData(_Wire, frozen=True):
    todos: list[Todo]


class EndSeedData(_Wire, frozen=True):
    pass


class _MessageBytes(Struct):
    """Cuts the original bytes of `data.message` out of an event's data without re-encoding."""

    message: Raw


# ---------------------------------------------------------------------------------------------- types

SURFACE_TYPES: Final = frozenset({"user/message", "assistant/message", "tool/result"})
STEP_SCOPED_TYPES: Final = frozenset({"assistant/chunk", "assistant/message", "tool/call", "tool/result"})
TURN_SCOPED_TYPES: Final = frozenset({"request/header", "request/context", "todo/write"})

CORE_DATA_TYPES: Final[dict[str, type[Struct]]] = {
    "turn/start": TurnStartData,
    "turn/end": TurnEndData,
    "step/start": StepData,
    "step/end": StepData,
    "user/message": Message,
    "assistant/chunk": AssistantChunkData,
    "assistant/message": AssistantMessageData,
    "tool/call": ToolCallData,
    "tool/result": ToolResultData,
    "request/header": RequestHeaderData,
    "request/context": RequestContextData,
    "todo/write": TodoWriteData,
    "session/end-seed": EndSeedData,
}

# dsh's plugin events: known, kept byte for byte, never model-visible.
PLUGIN_TYPES: Final = frozenset(
    {
        "session/title",
        "agent/inbox/spliced",
        "approval/asked",
        "approval/decided",
        "approval/policy",
        "hook/invoked",
        "hook/result",
        "compaction/start",
        "compaction/summary",
        "compaction/end",
        "compaction/prune",
        "subagent/descriptor",
        "goal/change",
        "plan/mode",
        "sandbox/mode",
        "permission/preset",
        "command/run",
        "command/done",
        "llm/retry",
        "llm/retry-started",
        "tool/code-dispatch",
        "tool/code-dispatch-start",
        "feedback/record",
        "schedule/change",
        "agent-preset/selected",
        "session/title-llm-request",
        "web/deepseek-search-llm-request",
    }
)
PLUGIN_TYPE_PREFIXES: Final = ("tool-workflow/", "team/")


def is_known_type(event_type: str) -> bool:
    return event_type in CORE_DATA_TYPES or event_type in PLUGIN_TYPES or event_type.startswith(PLUGIN_TYPE_PREFIXES)


# ---------------------------------------------------------------------------------------------- envelope


class Envelope(Struct, frozen=True, forbid_unknown_fields=True):
    """The envelope exactly as SPEC section 2 allows it. `surfaceOp` and `sourceEventSeqs` are decoded
    loosely here: their shape is checked by the session, in the order of SPEC section 10."""

    type: str
    data: Raw | UnsetType = UNSET
    seq: int | UnsetType = UNSET
    time: int | UnsetType = UNSET
    surfaceOp: Any = UNSET
    sourceEventSeqs: Any = UNSET
    ignorable: bool | UnsetType = UNSET


class Event(Struct, frozen=True, gc=False):
    """One validated event: its original bytes and a typed view of its data.

    `seq` is the event's position in its log: the envelope's `seq` when it has one, else its position (a
    recorder snapshot). `has_seq` says which, so writers keep a log's style. `data` is the typed Struct for
    core types and the raw data bytes for plugin and ignorable types.
    """

    seq: int
    type: str
    raw: bytes
    data: Any
    time: int | None
    has_seq: bool
    surface_op: Any
    source_event_seqs: Any
    ignorable: bool

    @property
    def is_surface(self) -> bool:
        return self.type in SURFACE_TYPES

    @property
    def is_replace(self) -> bool:
        return isinstance(self.surface_op, dict)


def _typed_envelope(tag: str, data_type: type[Struct]) -> type[Struct]:
    """The envelope of one core type, with its data Struct inline, so a core event decodes in one call."""
    return msgspec.defstruct(
        "Envelope_" + re.sub(r"\W", "_", tag),
        [
            ("data", data_type),
            ("seq", int | UnsetType, UNSET),
            ("time", int | UnsetType, UNSET),
            ("surfaceOp", Any, UNSET),
            ("sourceEventSeqs", Any, UNSET),
            ("ignorable", bool | UnsetType, UNSET),
        ],
        tag=tag,
        tag_field="type",
        forbid_unknown_fields=True,
        frozen=True,
    )


_TYPED_ENVELOPES: Final = {tag: _typed_envelope(tag, cls) for tag, cls in CORE_DATA_TYPES.items()}
_TAG_OF: Final = {cls: tag for tag, cls in _TYPED_ENVELOPES.items()}
_core_decoder: Final = msgspec.json.Decoder(Union[tuple(_TYPED_ENVELOPES.values())])  # noqa: UP007
_envelope_decoder: Final = msgspec.json.Decoder(Envelope)
_data_decoders: Final = {name: msgspec.json.Decoder(cls) for name, cls in CORE_DATA_TYPES.items()}
_message_bytes_decoder: Final = msgspec.json.Decoder(_MessageBytes)
_PATH_RE: Final = re.compile(r"`\$")


def decode_event(raw: bytes, position: int) -> Event:
    """Validate one event's bytes and return its typed view.

    `position` is where the event would stand in its log; it is the seq of an event without one and the seq
    named in errors. Raises `EventTooDeep`, `InvalidEvent` or `UnknownEventType`.
    """
    if raw.count(b"[") + raw.count(b"{") > MAX_EVENT_DEPTH:  # the cheap bound first: most events stop here
        check_depth(raw, position)
    if not raw.isascii():
        check_utf8(raw, position)
    try:
        typed: Any = _core_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _decode_slow(raw, position, exc)
    kind = _TAG_OF[type(typed)]
    data = typed.data
    has_seq = typed.seq is not UNSET
    seq = typed.seq if has_seq else position
    if kind == "tool/result":
        _check_tool_result_message(data, seq)
    elif kind == "user/message" and data.role != "user":
        raise InvalidEvent(f"user/message: role must be 'user', got {data.role!r}", seq=seq)
    return Event(
        seq=seq,
        type=kind,
        raw=raw if type(raw) is bytes else bytes(raw),
        data=data,
        time=typed.time if typed.time is not UNSET else None,
        has_seq=has_seq,
        surface_op=typed.surfaceOp,
        source_event_seqs=typed.sourceEventSeqs,
        ignorable=typed.ignorable is True,
    )


def _decode_slow(raw: bytes, position: int, fast_error: Exception) -> Event:
    """Plugin and ignorable types, and every refusal: decode the envelope alone, then the data by type, so the
    error names the type and the field."""
    try:
        env = _envelope_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(f"envelope: {exc}", seq=position) from None
    except msgspec.DecodeError as exc:
        raise InvalidEvent(f"not a JSON object: {exc}", seq=position) from None
    has_seq = env.seq is not UNSET
    seq = env.seq if isinstance(env.seq, int) else position
    kind = env.type
    data: Any
    decoder = _data_decoders.get(kind)
    if decoder is not None:
        if env.data is UNSET:
            raise InvalidEvent(f"{kind}: missing required field `data`", seq=seq)
        try:
            data = decoder.decode(env.data)
        except msgspec.ValidationError as exc:
            raise InvalidEvent(f"{kind}: {_PATH_RE.sub('`$.data', str(exc))}", seq=seq) from None
        except msgspec.DecodeError as exc:  # invalid UTF-8 inside `data`, which the envelope kept as raw bytes
            raise InvalidEvent(f"{kind}: `data`: {exc}", seq=seq) from None
        # Envelope and data each decode alone but not together: a key given twice, read differently by the two.
        raise InvalidEvent(f"{kind}: the event does not decode as one envelope ({fast_error})", seq=seq)
    if is_known_type(kind):
        if env.data is UNSET or not bytes(env.data).lstrip().startswith(b"{"):
            raise InvalidEvent(f"{kind}: `data` must be an object", seq=seq)
        data = env.data
    elif env.ignorable is True:
        data = env.data
    else:
        raise UnknownEventType(
            f'unknown event type {kind!r} without "ignorable": true (it may shape reconstruction, so '
            "it is not skipped silently)",
            seq=seq,
        )
    return Event(
        seq=seq,
        type=kind,
        raw=bytes(raw),
        data=data,
        time=env.time if isinstance(env.time, int) else None,
        has_seq=has_seq,
        surface_op=env.surfaceOp,
        source_event_seqs=env.sourceEventSeqs,
        ignorable=env.ignorable is True,
    )


def _check_tool_result_message(data: ToolResultData, seq: int) -> None:
    blocks = data.message.content
    if len(blocks) != 1 or not isinstance(blocks[0], ToolResultBlock):
        raise InvalidEvent(
            f"tool/result: message must hold exactly one tool-result block, got {[type(b).__name__ for b in blocks]}",
            seq=seq,
        )


def message_bytes(event: Event) -> bytes:
    """The original bytes of the message a surface event carries (its data for user/message)."""
    if event.type == "user/message":
        return _data_bytes(event)
    return bytes(_message_bytes_decoder.decode(_data_bytes(event)).message)


class _DataBytes(Struct):
    data: Raw


_data_bytes_decoder: Final = msgspec.json.Decoder(_DataBytes)


def _data_bytes(event: Event) -> bytes:
    return bytes(_data_bytes_decoder.decode(event.raw).data)


def data_bytes(event: Event) -> bytes:
    """The original bytes of an event's `data`."""
    return _data_bytes(event)


# ---------------------------------------------------------------------------------------------- creating


class _OrderedNewEvent(Struct, frozen=True, omit_defaults=True):
    seq: int | UnsetType = UNSET
    time: int | UnsetType = UNSET
    type: str = ""
    data: Any = None
    surfaceOp: Any = UNSET
    sourceEventSeqs: Any = UNSET


_encoder: Final = msgspec.json.Encoder()


def encode_new_event(
    event_type: str,
    data: Any,
    *,
    seq: int | None,
    time: int | None,
    surface_op: Any = UNSET,
    source_event_seqs: Any = UNSET,
) -> bytes:
    """Encode an event this library creates, once: `seq`, `time`, `type`, `data`, then the surface keys.

    `seq` or `time` of None leaves the key out (a log in recorder style has neither). Data too deep to encode is
    `EVENT_TOO_DEEP`, like bytes too deep to decode.
    """
    event = _OrderedNewEvent(
        seq=UNSET if seq is None else seq,
        time=UNSET if time is None else time,
        type=event_type,
        data=data,
        surfaceOp=surface_op,
        sourceEventSeqs=source_event_seqs,
    )
    try:
        return _encoder.encode(event)
    except RecursionError:
        raise EventTooDeep(
            f"{event_type}: data nests deeper than the encoder can go (the limit is {MAX_EVENT_DEPTH} levels)", seq=seq
        ) from None


def canonical_json(value: Any) -> bytes:
    """Canonical JSON: sorted keys, compact separators, UTF-8. Raw bytes are decoded first."""
    if isinstance(value, (bytes, bytearray, memoryview, Raw)):
        value = msgspec.json.decode(bytes(value))
    return msgspec.json.encode(value, order="sorted")
