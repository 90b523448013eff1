"""sessionlog.wireforms: the equivalence of OpenAI wire forms, their logged form, and the response assembler."""

from __future__ import annotations

import re
from typing import Any

import pytest

from sessionlog.errors import DerivationDiverges, UnsupportedContent
from sessionlog.events import decode_event, encode_new_event
from sessionlog.openai_wire import ChatCompletionChunk, ChunkChoice, Delta, chunk_decoder, parse_raw_response
from sessionlog.session import Session
from sessionlog.wire import WireCache, check_request, header_fields, to_wire
from sessionlog.wireforms import (
    ResponseAssembler,
    SseLines,
    canonical,
    config_key,
    logged_message,
    normal_message,
    request_header,
    system_message_text,
)

CALL = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("client", "canonical_form"),
    [
        ({"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "assistant", "content": "",
                                                                        "tool_calls": [CALL]}),
        ({"role": "assistant", "tool_calls": [{**CALL, "index": 0}], "refusal": None, "audio": None},
         {"role": "assistant", "content": "", "tool_calls": [CALL]}),
        ({"role": "assistant", "content": "hi", "tool_calls": []}, {"role": "assistant", "content": "hi"}),
        ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "user", "content": "ab"}),
        ({"role": "tool", "tool_call_id": "c1", "name": "read", "content": "out"},
         {"role": "tool", "tool_call_id": "c1", "content": "out"}),
        ({"role": "assistant", "content": None, "refusal": "I can't."}, {"role": "assistant", "content": "I can't."}),
    ],
    ids=["null-content", "sdk-echo-keys", "empty-tool-calls", "text-parts", "tool-name", "refusal-is-text"],
)  # fmt: skip
def test_client_wire_forms_have_one_canonical_form(client: dict[str, Any], canonical_form: dict[str, Any]) -> None:
    assert normal_message(client) == canonical_form


def test_integer_valued_floats_equal_integers_and_other_numbers_do_not() -> None:
    assert canonical({"temperature": 1.0, "n": [2.0]}) == canonical({"temperature": 1, "n": [2]})
    assert canonical({"temperature": 1.5}) != canonical({"temperature": 1})


def test_a_key_that_carries_something_keeps_a_message_different() -> None:
    assert normal_message({"role": "assistant", "content": "x", "audio": {"id": "a1"}})["audio"] == {"id": "a1"}
    assert normal_message({"role": "user", "content": "x", "refusal": "no"})["refusal"] == "no"  # a user's is not text


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]},
        {"role": "user", "content": 3},
        {"role": "tool", "content": "no id"},
        {"content": "no role"},
    ],
)
def test_what_cannot_be_logged_is_refused_not_dropped(message: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedContent):
        normal_message(message)


def test_a_logged_message_gives_the_client_message_back_through_to_wire() -> None:
    """Both directions: client form -> logged Message -> to_wire is the canonical client form."""
    header = request_header(
        {"model": "m", "temperature": 1, "max_tokens": 9, "parallel_tool_calls": False,
         "response_format": {"type": "json_object"},
         "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"},
                                                     "strict": True}}]},
        provider="p", system="sys",
    )  # fmt: skip
    assert header["config"]["maxTokens"] == 9 and header["tools"][0]["strict"] is True
    client = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "hmm"},
        {"role": "tool", "tool_call_id": "c1", "content": "out"},
    ]
    log = Session()

    def add(kind: str, data: Any, **surface: Any) -> None:
        log.append(decode_event(encode_new_event(kind, data, seq=len(log), time=0, **surface), len(log)))

    add("turn/start", {"turn": 1})
    add("step/start", {"turn": 1, "step": 1})
    add("request/header", {"header": header, "reason": "initial"})
    normal = [normal_message(m) for m in client]
    add("user/message", logged_message(normal[0], "u1"), surface_op="append")
    add("assistant/message", {"turn": 1, "step": 1, "message": logged_message(normal[1], "a1")},
        surface_op="append", source_event_seqs=[])  # fmt: skip
    add("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "read", "arguments": "{}"})
    add("tool/result", {"turn": 1, "step": 1, "message": logged_message(normal[2], "r1")}, surface_op="append",
        source_event_seqs=[5])  # fmt: skip
    folded = log.fold_request_header()
    assert folded is not None
    wire = to_wire(log.derive_messages(), folded)
    assert wire["messages"] == [{"role": "system", "content": "sys"}, *normal]
    _, fields = header_fields(folded)
    assert fields == {"model": "m", "temperature": 1, "max_tokens": 9, "parallel_tool_calls": False,
                      "response_format": {"type": "json_object"},
                      "tools": [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"},
                                                                  "strict": True}}]}  # fmt: skip


def _header_session(header: dict[str, Any]) -> Session:
    log = Session()
    for kind, data in (("turn/start", {"turn": 1}), ("step/start", {"turn": 1, "step": 1}),
                       ("request/header", {"header": header, "reason": "initial"})):  # fmt: skip
        log.append(decode_event(encode_new_event(kind, data, seq=len(log), time=0), len(log)))
    msg = logged_message(normal_message({"role": "user", "content": "hi"}), "u1")
    log.append(decode_event(encode_new_event("user/message", msg, seq=3, time=0, surface_op="append"), 3))
    return log


def test_a_developer_system_prompt_is_logged_with_its_role_and_sent_with_it() -> None:
    """`config.systemRole` "developer" sends the header's system prompt as a `developer` message, in `to_wire` and
    in the check's cached bytes alike; it is not a request field; check mode accepts that request and refuses the
    same prompt sent as `system` (the log says developer)."""
    header = request_header({"model": "m"}, provider="p", system="be terse", system_role="developer")
    assert header == {"config": {"provider": "p", "model": "m", "systemRole": "developer"}, "system": "be terse"}
    assert request_header({"model": "m"}, provider="p", system="s", system_role="system")["config"] == {
        "provider": "p", "model": "m"}  # fmt: skip
    log = _header_session(header)
    folded = log.fold_request_header()
    assert folded is not None
    wire = to_wire(log.derive_messages(), folded)
    assert wire == {"model": "m", "messages": [{"role": "developer", "content": "be terse"},
                                               {"role": "user", "content": "hi"}]}  # fmt: skip
    assert header_fields(folded) == ("be terse", {"model": "m"})
    check_request(canonical(wire), log.derive_messages(), folded, cache=WireCache())
    as_system = {**wire, "messages": [{"role": "system", "content": "be terse"}, wire["messages"][1]]}
    with pytest.raises(DerivationDiverges, match=r"\$\.messages\[0\]\.role"):
        check_request(canonical(as_system), log.derive_messages(), folded, cache=WireCache())


def test_a_system_role_the_wire_cannot_carry_and_a_field_that_would_take_its_key_are_refused() -> None:
    header = {"config": {"provider": "p", "model": "m", "systemRole": "assistant"}, "system": "x"}
    log = _header_session(header)
    folded = log.fold_request_header()
    assert folded is not None
    with pytest.raises(UnsupportedContent, match="systemRole"):
        to_wire(log.derive_messages(), folded)
    with pytest.raises(UnsupportedContent, match=r"\$\.system_role"):
        request_header({"model": "m", "system_role": "developer"}, provider="p", system=None)


def test_a_field_whose_name_the_wire_conversion_cannot_give_back_is_refused() -> None:
    assert config_key("top_logprobs") == "topLogprobs"
    assert config_key("enableThinking") is None
    with pytest.raises(UnsupportedContent):
        request_header({"model": "m", "enableThinking": True}, provider="p", system=None)


def test_the_assembler_turns_a_stream_and_a_completion_into_the_same_message() -> None:
    stream = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Look"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                            "function": {"name": "read", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 1}}},
    ]  # fmt: skip
    streamed = ResponseAssembler()
    chunks = [c for obj in stream for c in streamed.chunk(obj)]
    chunks += streamed.end()
    assert [c["type"] for c in chunks] == [
        "block-start", "reasoning-delta", "block-start", "text-delta", "block-start", "tool-call-delta",
        "tool-call-delta", "block-end", "block-end", "block-end", "usage", "finish",
    ]  # fmt: skip
    assert chunks[-1] == {"type": "finish", "reason": {"kind": "tool-calls"}}
    assert chunks[-2]["usage"] == {"inputTokens": 5, "outputTokens": 2, "cacheReadTokens": 1}
    whole = ResponseAssembler()
    whole.completion({"choices": [{"index": 0, "finish_reason": "tool_calls",
                                   "message": {"role": "assistant", "content": "Look", "reasoning_content": "think",
                                               "tool_calls": [CALL]}}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                "prompt_tokens_details": {"cached_tokens": 1}}})  # fmt: skip
    assert (
        whole.content()
        == streamed.content()
        == [
            {"type": "reasoning", "text": "think"},
            {"type": "text", "text": "Look"},
            {"type": "tool-call", "id": "c1", "name": "read", "arguments": "{}"},
        ]
    )
    assert whole.usage == streamed.usage and whole.finish == streamed.finish == "tool-calls"


def test_sse_lines_are_split_across_chunk_boundaries() -> None:
    lines = SseLines()
    assert lines.feed(b'data: {"a"') == []
    assert lines.feed(b': 1}\n\ndata: {"b": 2}\n') == [{"a": 1}, {"b": 2}]
    assert not lines.done
    assert lines.feed(b"data: [DONE]\n\n") == [] and lines.done
    typed = SseLines(chunk_decoder)
    assert typed.feed(b'data: {"choices": [{"delta": {"content": "hi"}}]}\ndata: {"choices": 3}\n') == [
        ChatCompletionChunk(choices=[ChunkChoice(delta=Delta(content="hi"))])
    ]  # the payload that is no chunk is skipped


def test_a_payload_that_is_not_a_chat_completions_chunk_is_named_not_half_read() -> None:
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
        b'data: {"choices": [{"index": 0, "delta": {"content": 5}}]}\n\ndata: [DONE]\n\n'
    )
    raw = parse_raw_response(body)
    assert (raw.text, raw.chunks) == ("ok", 1)
    assert raw.error is not None and "not a chat-completions chunk" in raw.error and "content" in raw.error
    assert ResponseAssembler().chunk({"choices": [{"delta": {"content": 5}}]}) == []
    assert parse_raw_response(b'{"choices": "no"}').error is not None


# ------------------------------------------------------------------- found by probing with the real SDKs (2026-12-05)


def test_a_field_whose_snake_case_name_would_not_come_back_is_refused_before_anything_is_logged() -> None:
    """`top_1_only` would be logged as `top1Only`, which the wire conversion gives back as `top1_only`: the request
    was logged, then refused as HEADER_DIVERGES on a field the client never sent."""
    assert config_key("top_1_only") is None
    assert config_key("top_logprobs") == "topLogprobs" and config_key("a_b2c") == "aB2c"
    with pytest.raises(UnsupportedContent, match=r"\$\.top_1_only"):
        request_header({"model": "m", "top_1_only": 1}, provider="p", system=None)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}], "legacy function calling"),
        ("function_call", "auto", "legacy function calling"),
        ("provider", {"order": ["A"]}, "config.provider holds the header's own provider"),
        ("system_role", "developer", "config.systemRole holds the header's own system prompt's role"),
        ("topK", 3, "lowercase words joined by single underscores"),
    ],
)
def test_a_request_field_the_header_cannot_keep_is_refused_saying_why(field: str, value: Any, why: str) -> None:
    """Legacy `functions` were accepted and their answer (`function_call`) logged as an empty message; OpenRouter's
    `provider` was refused without a reason (found probing record mode, 2026-12-05)."""
    with pytest.raises(UnsupportedContent, match=rf"^UNSUPPORTED_CONTENT: \$\.{field}: .*{re.escape(why)}"):
        request_header({"model": "m", field: value}, provider="p", system=None)


@pytest.mark.parametrize(
    "message",
    [
        {"role": "system", "content": "s", "name": "boss"},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "out", "extra": 1}]},
    ],
    ids=["key-on-a-system-message", "key-on-a-text-part", "key-on-a-tool-messages-part"],
)
def test_a_key_the_log_has_no_place_for_is_refused_not_dropped(message: dict[str, Any]) -> None:
    """A system message's `name`, a text part's `cache_control`: refused with a path, never dropped (they reached
    the provider as plain text)."""
    with pytest.raises(UnsupportedContent, match=r"\$\.messages\[0\]"):
        normal = normal_message(message, "$.messages[0]")
        if message["role"] == "system":
            system_message_text(normal, "$.messages[0]")


def test_a_tool_call_with_an_empty_id_and_its_result_are_the_same_call() -> None:
    """A provider may send `id: ""`; the echo's `tool_call_id: ""` must match it (it was refused as not a string,
    leaving the turn open for good)."""
    call = {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert normal_message({"role": "assistant", "content": None, "tool_calls": [call]})["tool_calls"] == [call]
    assert normal_message({"role": "tool", "tool_call_id": "", "content": "x"}) == {
        "role": "tool", "tool_call_id": "", "content": "x"}  # fmt: skip


def test_the_sdks_parsed_echo_of_its_own_content_is_the_message_without_it() -> None:
    """`chat.completions.parse()` returns the message with `parsed` (its content as JSON) and tool calls with
    `parsed_arguments`; both carry nothing the message does not, so the echo is the message. A `parsed` that is
    not the content still makes the message differ."""
    content = '{"city": "Paris", "n": 2}'
    echo = {"role": "assistant", "content": content, "parsed": {"city": "Paris", "n": 2}}
    assert normal_message(echo) == {"role": "assistant", "content": content}
    other = {"role": "assistant", "content": content, "parsed": {"city": "Rome"}}
    assert normal_message(other)["parsed"] == {"city": "Rome"}


@pytest.mark.parametrize(
    ("provider_finish", "logged"),
    [("tool_calls", "tool-calls"), ("stop", "tool-calls"), (None, "tool-calls"), ("length", "max-tokens"),
     ("content_filter", "content_filter")],
)  # fmt: skip
def test_an_answer_with_tool_calls_keeps_a_finish_that_says_it_was_cut_short(
    provider_finish: str | None, logged: str
) -> None:
    """An answer with tool calls finishes `tool-calls` when the provider said so, said `stop` or said nothing; a
    `length` finish is kept (`max-tokens`: the calls were cut short), so the log and the raw stream agree."""
    assembler = ResponseAssembler()
    delta = {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}
    assembler.chunk({"choices": [{"index": 0, "delta": delta}]})
    assembler.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": provider_finish}]})
    assert assembler.finish == logged


def test_what_a_second_probe_found_is_refused_clearly_never_dropped() -> None:
    """Found probing record mode (2026-12-05): a `reasoning_content` that is not a string was dropped silently; a
    content part without a type was called "a None content part"; a user message's extra field said "an user"."""
    with pytest.raises(UnsupportedContent, match=r"reasoning_content"):
        normal_message({"role": "assistant", "content": "x", "reasoning_content": {"text": "hm"}}, "$.messages[1]")
    with pytest.raises(UnsupportedContent, match="a content part without a type") as caught:
        normal_message({"role": "user", "content": [{"text": "hi"}]}, "$.messages[0]")
    assert "None" not in str(caught.value)
    with pytest.raises(UnsupportedContent, match=r"of a user message") as named:
        logged_message({"role": "user", "content": "hi", "name": "bob"}, "u1", "$.messages[0]")
    assert "an user" not in str(named.value)
