"""OpenAI wire forms and logged messages, in both directions: the one place where "the same message" is defined
when there is no byte to keep. Pure: no I/O.

`sessionlog.wire.to_wire` writes one canonical wire form per logged message. Clients write others that carry the
same thing; a provider reads them alike, so they are the same message. A client message is brought to the canonical
form by `normal_message`, and two messages are equivalent when their canonical forms are byte-equal (canonical
JSON). The rules, each one a form that carries nothing the canonical form does not:

- Content: `null`, an absent `content` and `""` are the same empty text. An array of content parts whose parts are
  all text (`{"type": "text", "text"}`) is its texts concatenated with no separator, as the wire conversion joins a
  message's text blocks. Any other part (an image, audio, a file), and a text part with any other key
  (`cache_control`), is `UNSUPPORTED_CONTENT` until the log has a place for it: it is refused, never dropped.
- Assistant messages: `tool_calls` absent, `null` or `[]` are the same; in a call, `type` defaults to `"function"`
  and keys other than `id`, `type`, `function.name` and `function.arguments` (a streaming `index`) are dropped.
  Keys whose value is `null` or empty (`refusal`, `audio`, `function_call`, `annotations`, as SDKs echo them) are
  dropped; any other key stays and makes the message differ. A `refusal` string (OpenAI sends it instead of
  content) is text after the content: the answer's text as the log holds it, since a refusal is what the model
  said.
- An assistant message's `parsed` (what the SDKs' `parse()` return beside the content it was read from) is
  dropped when it equals the content read as JSON.
- Tool messages: `name` is dropped (the call's name is logged with the call); `tool_call_id` may be `""`.
- The first system (or developer) message: a key besides its role and content (`name`) is refused
  (`system_message_text`): the header holds the prompt's text only.
- Numbers: an integer-valued float equals the integer (`1.0` is `1`): JavaScript cannot tell them apart, so a
  Node client echoes `1` where Python sent `1.0`. This applies to every value compared, header fields included.
- Request fields: one given as `null`, and `tools: []`, is the field not given (the OpenAI SDKs send `null` for a
  parameter set to None, frameworks an empty tools array): `request_header` leaves them out, and record mode's plan
  compares the request without them.
- Reasoning: a client need not echo `reasoning_content`. Record mode accepts an assistant message without it as the
  logged message that has it (`reasoning_optional`); the provider then receives the derivation, reasoning included.
  Check mode keeps reasoning strict: the client wrote the log itself, so a request without it really differs.

In the other direction, `logged_message` turns a client message into the logged Message (SPEC 3) whose wire form is
its canonical form, and `request_header` turns a request's model, system message, tools and sampling fields into
the `request/header` whose `header_fields` give them back (tools keep `strict`; a field is logged under its
camelCase name, which the wire conversion turns back into the client's snake_case name).

Responses are not here: the OpenAI response Structs and `ResponseAssembler` live in `sessionlog.openai_wire`
(re-exported here for the callers that import them from this module).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from .errors import UnsupportedContent
from .openai_wire import OPENAI_FINISH, ResponseAssembler, SseLines, usage_of

_encoder: Final = msgspec.json.Encoder(order="sorted")

TRANSPORT_FIELDS: Final = frozenset({"stream", "stream_options"})
# The config key of a request/header that says which role the system prompt is sent with: absent (or "system"), a
# `system` message; "developer", a `developer` message (what OpenAI's reasoning models take instead). It is not a
# request field, so a request field that would be logged under this name is refused.
SYSTEM_ROLE_KEY: Final = "systemRole"
SYSTEM_ROLES: Final = ("system", "developer")
# A request field's name that the wire conversion gives back from its camelCase config key: lower case, and a letter
# after each underscore (`top_1_only` would be logged as `top1Only` and come back as `top1_only`).
_SNAKE_FIELD: Final = re.compile(r"^[a-z][a-z0-9]*(_[a-z][a-z0-9]*)*$")
_TOOL_KEYS: Final = ("name", "description", "parameters", "strict")


def normal_numbers(value: Any) -> Any:
    """The value with every integer-valued float made an integer (`1.0` -> `1`), recursively."""
    if type(value) is float:
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {k: normal_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normal_numbers(v) for v in value]
    return value


def canonical(value: Any) -> bytes:
    """Canonical JSON (sorted keys, compact, UTF-8) of the value with its numbers made normal."""
    return _encoder.encode(normal_numbers(value))


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def content_text(content: Any, where: str) -> str:
    """A message's `content` as the one text it carries (null, absent and text-part arrays included)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                extra = sorted(k for k, v in part.items() if k not in ("type", "text") and v is not None)
                if extra:
                    raise UnsupportedContent(
                        f"{where}.content[{i}]: a text part's {', '.join(extra)} cannot be logged (only its text "
                        "can); it is refused rather than dropped"
                    )
                parts.append(part["text"])
                continue
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            what = f"a {kind!r} content part" if kind is not None else "a content part without a type"
            raise UnsupportedContent(
                f"{where}.content[{i}]: {what} cannot be logged yet (only text parts are); it is refused rather "
                "than dropped"
            )
        return "".join(parts)
    raise UnsupportedContent(f"{where}.content: expected a string, null or an array of parts, got {content!r}")


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str):
        raise UnsupportedContent(f"{where}: a tool call needs an `id` and a `function` object")
    if call.get("type", "function") != "function":
        raise UnsupportedContent(f"{where}: tool call type {call.get('type')!r} is not supported (only function)")
    arguments = function.get("arguments")
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": function.get("name"), "arguments": "" if arguments is None else arguments},
    }


def normal_message(message: Any, where: str = "$.messages[?]") -> dict[str, Any]:
    """The canonical wire form of one client message (see the module doc); refuses what cannot be logged."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise UnsupportedContent(f"{where}: a message must be an object with a string `role`")
    role = message["role"]
    rest = {k: v for k, v in message.items() if k not in ("role", "content") and not _empty(v)}
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), where)}
    if role == "assistant":
        calls = rest.pop("tool_calls", None)
        if calls:
            if not isinstance(calls, list):
                raise UnsupportedContent(f"{where}.tool_calls: expected an array")
            out["tool_calls"] = [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
        reasoning = rest.pop("reasoning_content", None)
        if reasoning is not None and not isinstance(reasoning, str):
            raise UnsupportedContent(f"{where}.reasoning_content: expected a string, got {type(reasoning).__name__}")
        if reasoning:
            out["reasoning_content"] = reasoning
        refusal = rest.get("refusal")
        if isinstance(refusal, str):  # what the model said instead of content: logged as its text
            out["content"] += rest.pop("refusal")
        if "parsed" in rest and _parsed_content(out["content"]) == normal_numbers(rest["parsed"]):
            del rest["parsed"]  # an SDK's `parse()` echo: the content as JSON, nothing the content does not carry
    elif role == "tool":
        rest.pop("name", None)
        rest.pop("tool_call_id", None)
        call_id = message.get("tool_call_id")  # "" too: a provider may give a call the empty id
        if not isinstance(call_id, str):
            raise UnsupportedContent(f"{where}: a tool message needs a string `tool_call_id`")
        out["tool_call_id"] = call_id
    out.update(rest)  # anything else stays, and makes the message differ from every logged one
    return out


def _parsed_content(content: str) -> Any:
    try:
        return normal_numbers(msgspec.json.decode(content))
    except msgspec.DecodeError:
        return _NOT_JSON


_NOT_JSON: Final = object()


def system_message_text(normal: Mapping[str, Any], where: str) -> str:
    """The text of a first system (or developer) message in canonical form; a key besides its role and content
    (a `name`) has no place in the header and is refused rather than dropped."""
    extra = sorted(k for k in normal if k not in ("role", "content"))
    if extra:
        raise UnsupportedContent(f"{where}: a system message's {', '.join(extra)} cannot be logged (only its text "
                                 "can); it is refused rather than dropped")  # fmt: skip
    return str(normal["content"])


def without_reasoning(wire: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k != "reasoning_content"}


# ---------------------------------------------------------------------------------------------- to the log


def logged_message(wire: Mapping[str, Any], message_id: str, where: str = "$.messages[?]") -> dict[str, Any]:
    """The logged Message (SPEC 3) a canonical client message becomes: its wire form is `wire` again.

    A user message is `role: user`, source `user`; a tool message is the `tool-result` message of a `tool/result`
    (role user, source `tool`); an assistant message the client supplied (not one the provider answered through
    the gateway) has source `client`. Other roles have no logged form yet (`UNSUPPORTED_CONTENT`).
    """
    role = wire["role"]
    text = wire.get("content", "")
    extra = sorted(set(wire) - {"role", "content", "tool_calls", "reasoning_content", "tool_call_id"})
    if extra:
        article = "an" if role[:1] in ("a", "e", "i", "o") else "a"  # an assistant, a user, a tool
        raise UnsupportedContent(
            f"{where}: field(s) {', '.join(extra)} of {article} {role} message have no logged form"
        )
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    if role == "user":
        return {"id": message_id, "role": "user", "source": {"kind": "user"}, "content": blocks}
    if role == "tool":
        call_id = wire["tool_call_id"]
        return {
            "id": message_id,
            "role": "user",
            "source": {"kind": "tool", "callId": call_id},
            "content": [{"type": "tool-result", "toolCallId": call_id, "content": blocks}],
        }
    if role == "assistant":
        content: list[dict[str, Any]] = []
        if wire.get("reasoning_content"):
            content.append({"type": "reasoning", "text": wire["reasoning_content"]})
        content += blocks
        calls = wire.get("tool_calls") or ()
        if (i := first_repeat(call["id"] for call in calls)) is not None:
            raise UnsupportedContent(
                f"{where}.tool_calls[{i}].id: a second tool call with id {calls[i]['id']!r} in one message; no tool "
                "result could say which of the two it answers"
            )
        for call in calls:
            function = call["function"]
            content.append(
                {"type": "tool-call", "id": call["id"], "name": function["name"], "arguments": function["arguments"]}
            )
        return {"id": message_id, "role": "assistant", "source": {"kind": "client"}, "content": content}
    raise UnsupportedContent(f"{where}: role {role!r} has no logged form (only a first system or developer "
                             "message, user, assistant and tool messages do)")  # fmt: skip


def first_repeat(ids: Iterable[str]) -> int | None:
    """The index of the first id that came before in `ids` (two tool calls of one message with one id), or None."""
    seen: set[str] = set()
    for i, one in enumerate(ids):
        if one in seen:
            return i
        seen.add(one)
    return None


# OpenAI's function calling before tools: the answer's `function_call` is not a tool call and nothing logs it.
_LEGACY_FUNCTION_FIELDS: Final = frozenset({"functions", "function_call"})
_OWN_KEYS: Final = {"provider": "provider (the one the gateway calls)", "model": "model",
                    SYSTEM_ROLE_KEY: "system prompt's role"}  # fmt: skip


def config_key(field: str) -> str | None:
    """The camelCase config key a request field is logged under (`max_tokens` -> `maxTokens`), or None when the
    wire conversion could not give the field's name back (it holds capitals or odd characters)."""
    if not _SNAKE_FIELD.match(field):
        return None
    head, *tail = field.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in tail)


def request_header(
    request: Mapping[str, Any], *, provider: str, system: str | None, system_role: str = "system"
) -> dict[str, Any]:
    """The `request/header` header a request's fields become (messages and transport fields aside).

    `model` and `provider` go to `config`; every other field with a value goes to `config` under its camelCase
    name; `tools` become header tools with `name`, `description`, `parameters` and `strict` (the function object's
    keys); a first system message becomes `system`, and a first `developer` message too, with `config.systemRole`
    `"developer"`. Raises `UNSUPPORTED_CONTENT` for what has no logged form.
    """
    config: dict[str, Any] = {"provider": provider, "model": request.get("model")}
    if not isinstance(config["model"], str) or not config["model"]:
        raise UnsupportedContent("$.model: a request needs a model name")
    header: dict[str, Any] = {"config": config}
    for field, value in request.items():
        if field in ("model", "messages", "tools") or field in TRANSPORT_FIELDS or value is None:
            continue
        if field in _LEGACY_FUNCTION_FIELDS:
            raise UnsupportedContent(
                f"$.{field}: legacy function calling cannot be logged (an answer's function_call has no logged "
                "form); send tools and tool_choice instead"
            )
        key = config_key(field)
        if key is None:
            raise UnsupportedContent(f"$.{field}: a request field by this name cannot be logged in request/header: "
                                     "its config key (camelCase) would not give the name back; a field name is "
                                     "lowercase words joined by single underscores")  # fmt: skip
        if key in _OWN_KEYS:
            raise UnsupportedContent(f"$.{field}: a request field by this name cannot be logged in request/header: "
                                     f"config.{key} holds the header's own {_OWN_KEYS[key]}")  # fmt: skip
        config[key] = value
    if system is not None:
        header["system"] = system
        if system_role != "system":
            config[SYSTEM_ROLE_KEY] = system_role
    tools = request.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise UnsupportedContent("$.tools: expected an array")
        header["tools"] = [_header_tool(tool, f"$.tools[{i}]") for i, tool in enumerate(tools)]
    return header


def _header_tool(tool: Any, where: str) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise UnsupportedContent(f"{where}: only function tools can be logged")
    extra = sorted(set(tool) - {"type", "function"}) + sorted(set(function) - set(_TOOL_KEYS))
    if extra or not isinstance(function.get("name"), str):
        what = f"keys {', '.join(extra)}" if extra else "no string name"
        raise UnsupportedContent(f"{where}: a tool with {what} cannot be logged")
    return {k: function[k] for k in _TOOL_KEYS if function.get(k) is not None}


def wire_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A header tool's wire form: `{"type": "function", "function": {name, description?, parameters?, strict?}}`."""
    function = {k: tool[k] for k in _TOOL_KEYS if tool.get(k) is not None}
    return {"type": "function", "function": function}


__all__ = [
    "OPENAI_FINISH",
    "ResponseAssembler",
    "SseLines",
    "canonical",
    "config_key",
    "content_text",
    "first_repeat",
    "logged_message",
    "normal_message",
    "normal_numbers",
    "request_header",
    "usage_of",
    "wire_tool",
    "without_reasoning",
]
