"""Builders and Hypothesis strategies for VALID session logs.

`SessionBuilder` writes one event at a time into a live `Session` (so every event it emits has passed the
library's rules), keeps the bytes, and records what the live session derived right before each step's first
`assistant/chunk` (a `Checkpoint`, the request the theorem of SPEC section 6 talks about).

`generated_sessions()` drives a builder with Hypothesis draws: turns with user messages, request headers that
sometimes change between steps, streamed steps (block-start, deltas, block-end, usage, finish) assembled into an
`assistant/message`, parallel tool calls whose results come back in any order, plugin and ignorable events
sprinkled in, compactions over tool-pair-safe ranges of the current surface (nested ones included), tool/result
content rewrites, and turns a crash cut short (closed by the repair closers and a `session/end-seed`, or, for the
last turn, left open).

The pairing and range computations here are written from the SPEC, not from the library's internals, so the
generator is an independent check of what "a tool-pair-safe compaction" means.

The event data builders (`user_message_data`, `assistant_message_data`, `tool_result_data`, ...) and the turns written
through a live `SessionWriter` (`closed_turn`, `streamed_turn`, `compact_all`) serve the tests against a server.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from sessionlog.events import Event, ToolCallBlock, ToolResultBlock
from sessionlog.log import SessionWriter
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session, messages_canonical, messages_json

T0 = 1_784_973_850_000
PROVIDER = "deepseek-official"

TEXTS = (
    "Hello.",
    "Read a.txt, then b.txt.",
    'She said "done"\n',
    "ünïcödé → ok",
    "tab\there",
    "",
    "{not json}",
    "a" * 40,
)

PLUGIN_EVENTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("session/title", {"title": "A title", "messageSeqs": [1], "source": {"kind": "fallback"}}),
    ("agent/inbox/spliced", {"target": "next-turn", "start": 0, "removedCount": 1, "inserted": []}),
    ("hook/invoked", {"hook": "pre-tool", "matcher": "*"}),
    ("approval/policy", {"policy": "never", "z": 1, "a": 2}),
    ("llm/retry", {"attempt": 1, "delayMs": 250}),
    ("tool-workflow/run-start", {"runId": "r-1"}),
    ("team/member-joined", {"member": "m"}),
    ("compaction/start", {"compactionId": "c"}),
)
IGNORABLE_EVENT = ("vendor/trace-span", {"span": "s-1", "nested": {"b": 1, "a": [1, 2]}})

_encode = msgspec.json.encode


def event_bytes(seq: int | None, kind: str, data: Any, *, time: int | None = None, **envelope: Any) -> bytes:
    """One event's bytes, keys in the order given: seq, time, type, data, then `envelope` (surfaceOp, ...)."""
    out: dict[str, Any] = {}
    if seq is not None:
        out["seq"] = seq
    if time is not None:
        out["time"] = time
    out["type"] = kind
    out["data"] = data
    out.update(envelope)
    return _encode(out)


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_call_block(call_id: str, name: str = "read", arguments: str = '{"file_path":"a.txt"}') -> dict[str, Any]:
    return {"type": "tool-call", "id": call_id, "name": name, "arguments": arguments}


def user_message_data(text: str, msg_id: str, source: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": msg_id, "role": "user", "content": [text_block(text)], "source": source or {"kind": "user"}}


def tool_result_data(
    turn: int,
    step: int,
    call_id: str,
    text: str = "ok",
    *,
    msg_id: str | None = None,
    is_error: bool | None = None,
    error: dict[str, str] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool-result", "toolCallId": call_id, "content": [text_block(text)]}
    if is_error is not None:
        block["isError"] = is_error
    data: dict[str, Any] = {
        "turn": turn,
        "step": step,
        "message": {
            "id": msg_id or f"result-{call_id}",
            "role": "user",
            "source": {"kind": "tool", "callId": call_id},
            "content": [block],
        },
    }
    if error is not None:
        data["error"] = error
    if meta is not None:
        data["meta"] = meta
    return data


def assistant_message_data(turn: int, step: int, blocks: list[dict[str, Any]], msg_id: str) -> dict[str, Any]:
    message = {"id": msg_id, "role": "assistant", "source": {"kind": "model", "provider": "p", "model": "m"}}
    return {"turn": turn, "step": step, "message": {**message, "content": blocks}}


NOT_STARTED_ERROR = {"name": "ToolNotStartedError", "code": "TOOL_NOT_STARTED"}


@dataclass(frozen=True)
class Checkpoint:
    """What the live session derived right before the first `assistant/chunk` of a step, which is at `seq`."""

    seq: int
    canonical: bytes
    raw: bytes
    header: bytes | None


class Crashed(Exception):
    """Raised by the builder when its armed crash point is reached (the event before it is durable)."""


class SessionBuilder:
    """Writes valid events into a live `Session`; every emitted event has been accepted by `Session.append`.

    Turn and step numbers come from the session itself, so a crash (or hand-written bytes appended with
    `append`) never leaves the builder out of step with the log.
    """

    def __init__(self, *, seqs: bool = True, time0: int = T0) -> None:
        self.session = Session()
        self.events: list[bytes] = []
        self.checkpoints: list[Checkpoint] = []
        self.seqs = seqs
        self.time = time0
        self._chunked = False
        self._headers = 0
        self._counter = 0
        self._crash_in: int | None = None

    # ------------------------------------------------------------------------------------------ basics

    @property
    def next_seq(self) -> int:
        return len(self.session)

    @property
    def turn(self) -> int:
        assert self.session.open_turn is not None, "no open turn"
        return self.session.open_turn

    @property
    def step(self) -> int:
        assert self.session.open_step is not None, "no open step"
        return self.session.open_step.number

    def fresh_id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def arm_crash(self, after_events: int | None) -> None:
        """Raise `Crashed` right after the `after_events`-th further event is appended (None disarms)."""
        self._crash_in = after_events

    def append(self, raw: bytes) -> int:
        """Append bytes made elsewhere (repair closers, hand-written events)."""
        event = self.session.append(raw)
        self.events.append(raw)
        if event.time is not None:
            self.time = event.time
        return event.seq

    def emit(self, kind: str, data: Any, **envelope: Any) -> int:
        seq = self.next_seq
        # Times never go backwards and sometimes repeat, as a fast writer's clock does.
        self.time += seq % 3 * 5
        raw = event_bytes(seq if self.seqs else None, kind, data, time=self.time if self.seqs else None, **envelope)
        self.append(raw)
        if self._crash_in is not None:
            self._crash_in -= 1
            if self._crash_in <= 0:
                self._crash_in = None
                raise Crashed(seq)
        return seq

    # ------------------------------------------------------------------------------------------ vocabulary

    def turn_start(self) -> int:
        return self.emit("turn/start", {"turn": self.session.last_turn + 1})

    def turn_end(self, reason: dict[str, Any] | None = None) -> int:
        return self.emit("turn/end", {"turn": self.turn, "reason": reason or {"kind": "completed"}})

    def step_start(self) -> int:
        self._chunked = False
        return self.emit("step/start", {"turn": self.turn, "step": self.session.last_step + 1})

    def step_end(self) -> int:
        return self.emit("step/end", {"turn": self.turn, "step": self.step})

    def user_message(self, text: str = "Hello.", *, source: dict[str, Any] | None = None) -> int:
        return self.emit("user/message", user_message_data(text, self.fresh_id("user"), source), surfaceOp="append")

    def request_header(
        self,
        *,
        model: str = "deepseek-v4-flash",
        temperature: float | None = None,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        reason: str | None = None,
    ) -> int:
        config: dict[str, Any] = {"provider": PROVIDER, "model": model}
        if temperature is not None:
            config["temperature"] = temperature
        header: dict[str, Any] = {"config": config}
        if system is not None:
            header["system"] = system
        if tools is not None:
            header["tools"] = tools
        self._headers += 1
        return self.emit(
            "request/header",
            {"header": header, "reason": reason or ("initial" if self._headers == 1 else "change")},
        )

    def plugin(self, kind: str, data: dict[str, Any], *, ignorable: bool = False) -> int:
        if ignorable:
            return self.emit(kind, data, ignorable=True)
        return self.emit(kind, data)

    def chunk(self, chunk: dict[str, Any]) -> int:
        if not self._chunked:
            derived = self.session.derive_messages()
            header = self.session.fold_request_header()
            self.checkpoints.append(
                Checkpoint(
                    seq=self.next_seq,
                    canonical=messages_canonical(derived),
                    raw=messages_json(derived),
                    header=header.raw if header is not None else None,
                )
            )
            self._chunked = True
        return self.emit("assistant/chunk", {"turn": self.turn, "step": self.step, "chunk": chunk})

    def stream(
        self,
        blocks: Sequence[dict[str, Any]],
        *,
        pieces: Callable[[int], int] = lambda index: 1,
        between: Callable[[], None] = lambda: None,
        finish: str | None = None,
    ) -> list[int]:
        """Stream `blocks` as chunks (block-start, deltas, block-end each), then usage and finish."""
        seqs: list[int] = []
        for index, block in enumerate(blocks):
            seqs.append(self.chunk({"type": "block-start", "index": index, "blockType": block["type"]}))
            between()
            n = max(1, pieces(index))
            if block["type"] == "tool-call":
                args = block["arguments"]
                cut = [len(args) * i // n for i in range(n + 1)]
                for i in range(n):
                    delta: dict[str, Any] = {"type": "tool-call-delta", "index": index, "id": block["id"]}
                    if i == 0:
                        delta["name"] = block["name"]
                    delta["argumentsDelta"] = args[cut[i] : cut[i + 1]]
                    seqs.append(self.chunk(delta))
            else:
                text = block["text"]
                cut = [len(text) * i // n for i in range(n + 1)]
                for i in range(n):
                    seqs.append(
                        self.chunk(
                            {"type": f"{block['type']}-delta", "index": index, "text": text[cut[i] : cut[i + 1]]}
                        )
                    )
            between()
            seqs.append(self.chunk({"type": "block-end", "index": index, "block": dict(block)}))
        seqs.append(self.chunk({"type": "usage", "usage": {"inputTokens": 10 * len(seqs), "outputTokens": len(seqs)}}))
        has_calls = any(b["type"] == "tool-call" for b in blocks)
        seqs.append(
            self.chunk({"type": "finish", "reason": {"kind": finish or ("tool-calls" if has_calls else "stop")}})
        )
        return seqs

    def assistant_message(
        self, blocks: Sequence[dict[str, Any]], *, source_seqs: Sequence[int] | None = None, usage: bool = True
    ) -> int:
        data: dict[str, Any] = {
            "turn": self.turn,
            "step": self.step,
            "message": {
                "id": self.fresh_id("assistant"),
                "role": "assistant",
                "content": list(blocks),
                "source": {"kind": "model", "provider": PROVIDER, "model": "deepseek-v4-flash"},
            },
        }
        if usage:
            data["usage"] = {"inputTokens": 100, "outputTokens": 7}
        envelope: dict[str, Any] = {"surfaceOp": "append"}
        if source_seqs is not None:
            envelope["sourceEventSeqs"] = list(source_seqs)
        return self.emit("assistant/message", data, **envelope)

    def tool_call(self, call_id: str, name: str = "read", arguments: str = "{}") -> int:
        return self.emit(
            "tool/call", {"turn": self.turn, "step": self.step, "callId": call_id, "name": name, "arguments": arguments}
        )

    def tool_result(
        self,
        call_id: str,
        text: str = "ok",
        *,
        call_seq: int | None = None,
        is_error: bool | None = None,
        error: dict[str, str] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> int:
        data = tool_result_data(self.turn, self.step, call_id, text, is_error=is_error, error=error, meta=meta)
        envelope: dict[str, Any] = {"surfaceOp": "append"}
        if call_seq is not None:
            envelope["sourceEventSeqs"] = [call_seq]
        return self.emit("tool/result", data, **envelope)

    def not_started_result(self, call_id: str) -> int:
        return self.tool_result(call_id, "did not start", is_error=True, error=dict(NOT_STARTED_ERROR))

    def tool_step(self, call_ids: Sequence[str], *, text: str = "") -> dict[str, int]:
        """A whole step: stream and announce `call_ids` (after an optional text block), then call and answer each.

        Returns the seqs: "message", f"call:{id}", f"result:{id}".
        """
        self.step_start()
        blocks = ([text_block(text)] if text else []) + [tool_call_block(c) for c in call_ids]
        chunk_seqs = self.stream(blocks)
        seqs = {"message": self.assistant_message(blocks, source_seqs=chunk_seqs)}
        for c in call_ids:
            seqs[f"call:{c}"] = self.tool_call(c)
        for c in call_ids:
            seqs[f"result:{c}"] = self.tool_result(c, f"contents for {c}", call_seq=seqs[f"call:{c}"])
        self.step_end()
        return seqs

    def text_step(self, text: str = "Done.") -> int:
        """A whole step that answers with text; returns the assistant/message seq."""
        self.step_start()
        blocks = [text_block(text)]
        seq = self.assistant_message(blocks, source_seqs=self.stream(blocks))
        self.step_end()
        return seq

    def replace(
        self,
        start: int,
        end: int,
        *,
        text: str = "Summary of earlier context.",
        sources: Sequence[int] | None = None,
        kind: str = "user/message",
    ) -> int:
        """A compaction: a summary replaces surface nodes `start`..`end`; provenance defaults to the shadowed nodes."""
        nodes = self.session.surface.nodes
        shadowed = nodes[nodes.index(start) : nodes.index(end) + 1]
        envelope = {
            "surfaceOp": {"op": "replace", "start": start, "end": end},
            "sourceEventSeqs": list(shadowed if sources is None else sources),
        }
        if kind == "user/message":
            source = {"kind": "plugin", "plugin": "compact", "compactionId": self.fresh_id("compaction")}
            return self.emit("user/message", user_message_data(text, self.fresh_id("summary"), source), **envelope)
        step = self.session.open_step.number if self.session.open_step else max(1, self.session.last_step)
        data = {
            "turn": self.turn,
            "step": step,
            "message": {
                "id": self.fresh_id("summary"),
                "role": "assistant",
                "content": [text_block(text)],
                "source": {"kind": "plugin", "plugin": "compact"},
            },
        }
        return self.emit("assistant/message", data, **envelope)

    def rewrite_result(self, target: int, text: str = "[output pruned]") -> int:
        """A tool/result replacement that changes only the content of the result block of node `target`."""
        data = rewritten_result_data(self.session, target, text)
        return self.emit(
            "tool/result", data, surfaceOp={"op": "replace", "start": target, "end": target}, sourceEventSeqs=[target]
        )

    def close_interrupted(self) -> tuple[bytes, ...]:
        closers = interrupted_turn_closers(self.session)
        for raw in closers:
            self.append(raw)
        return closers

    def end_seed(self) -> int:
        return self.emit("session/end-seed", {})


def rewritten_result_data(session: Session, target: int, text: str) -> dict[str, Any]:
    """The data of tool/result node `target` (as logged) with only its result block's content changed."""
    data: dict[str, Any] = msgspec.json.decode(session[target].raw)["data"]
    data["message"]["content"][0]["content"] = [text_block(text)]
    return data


# ---------------------------------------------------------------------------------------------- pairing


def message_of(session: Session, seq: int) -> Any:
    event = session[seq]
    return event.data if event.type == "user/message" else event.data.message


def surface_pairs(session: Session) -> list[tuple[int, int]]:
    """Surface positions (call, result) of every tool call whose call and result are both current nodes."""
    calls: dict[str, int] = {}
    results: dict[str, int] = {}
    for position, seq in enumerate(session.surface.nodes):
        for block in message_of(session, seq).content:
            if isinstance(block, ToolCallBlock):
                calls[block.id] = position
            elif isinstance(block, ToolResultBlock):
                results[block.tool_call_id] = position
    return sorted((min(calls[c], results[c]), max(calls[c], results[c])) for c in calls.keys() & results.keys())


def safe_range_ends(session: Session, first: int) -> list[int]:
    """Surface positions `last` >= `first` such that replacing first..last splits no tool pair."""
    pairs = surface_pairs(session)
    out = []
    for last in range(first, len(session.surface)):
        if all((first <= a <= last) == (first <= b <= last) for a, b in pairs):
            out.append(last)
    return out


def tool_result_nodes(session: Session) -> list[int]:
    return [seq for seq in session.surface.nodes if session[seq].type == "tool/result"]


def derived_pairing(session: Session) -> tuple[list[str], list[str]]:
    """The tool-call ids and the tool-result ids of the derived messages, in order."""
    calls: list[str] = []
    results: list[str] = []
    for message in session.derive_messages():
        for block in message.message.content:
            if isinstance(block, ToolCallBlock):
                calls.append(block.id)
            elif isinstance(block, ToolResultBlock):
                results.append(block.tool_call_id)
    return calls, results


# ---------------------------------------------------------------------------------------------- strategy


@dataclass(frozen=True)
class GeneratedSession:
    """A valid log, the live session that accepted it, and the live derivations before each step's first chunk."""

    events: tuple[bytes, ...]
    session: Session
    checkpoints: tuple[Checkpoint, ...]

    def __repr__(self) -> str:
        lines = b"\n".join(self.events).decode()
        return f"GeneratedSession({len(self.events)} events, {len(self.checkpoints)} checkpoints):\n{lines}"


class _Player:
    """Drives a `SessionBuilder` with Hypothesis draws. Every choice shrinks towards a plainer session."""

    def __init__(self, draw: Any, builder: SessionBuilder, max_steps: int) -> None:
        self.draw = draw
        self.b = builder
        self.max_steps = max_steps

    def chance(self, one_in: int) -> bool:
        """True with probability about 1/one_in; shrinks to False."""
        return self.draw(st.integers(0, one_in - 1)) == one_in - 1

    def pick(self, options: Sequence[Any]) -> Any:
        return options[self.draw(st.integers(0, len(options) - 1))]

    def gap(self) -> None:
        if self.chance(6):
            if self.chance(4):
                self.b.plugin(*IGNORABLE_EVENT, ignorable=True)
            else:
                self.b.plugin(*self.pick(PLUGIN_EVENTS))

    def header(self) -> None:
        tools = self.pick(
            (None, [], [{"name": "read", "description": "Read a file", "parameters": {"type": "object"}}])
        )
        self.b.request_header(
            model=self.pick(("deepseek-v4-flash", "deepseek-v4-pro")),
            temperature=self.pick((None, 0.0, 0.7)),
            system=self.pick((None, "", "You are a careful agent.")),
            tools=tools,
        )

    def compact(self) -> None:
        b = self.b
        if self.chance(4) and len(b.session.surface):
            first = self.draw(st.integers(0, len(b.session.surface) - 1))
            ends = safe_range_ends(b.session, first)
            if ends:
                last = self.pick(ends)
                nodes = b.session.surface.nodes
                shadowed = list(nodes[first : last + 1])
                # Provenance may name more than the shadowed nodes (here: every event of the span).
                sources = list(range(min(shadowed), max(shadowed) + 1)) if self.chance(3) else shadowed
                kind = "assistant/message" if self.chance(5) else "user/message"
                b.replace(nodes[first], nodes[last], sources=sources, kind=kind, text=f"Summary of {shadowed}.")
        if self.chance(5):
            results = tool_result_nodes(b.session)
            if results:
                b.rewrite_result(self.pick(results), self.pick(("[output pruned]", "", "short")))

    def turn(self) -> None:
        b = self.b
        b.turn_start()
        self.gap()
        b.user_message(self.pick(TEXTS))
        if self.chance(4):
            b.user_message(
                "Current runtime context.",
                source={"kind": "plugin", "plugin": "ctx", "form": "snapshot", "sections": [{"name": "s"}]},
            )
        if b.session.fold_request_header() is None or self.chance(3):
            self.header()
        if self.chance(5):
            b.emit("request/context", {"provider": PROVIDER, "model": "deepseek-v4-flash", "contextWindow": 128000})
        if self.chance(6):
            b.emit("todo/write", {"todos": [{"content": "read files", "status": "in_progress"}]})
        self.compact()
        steps = self.draw(st.integers(1, self.max_steps))
        for number in range(1, steps + 1):
            announced = self.step()
            if number < steps:
                self.gap()
                if self.chance(3):
                    self.header()
                self.compact()
            elif not announced and self.chance(2):
                break
        self.gap()
        reason = self.pick(
            (
                {"kind": "completed"},
                {"kind": "aborted", "reason": {"kind": "user"}},
                {"kind": "error", "error": {"message": "boom", "code": "E_PROVIDER", "status": 500}},
                {"kind": "max-tokens"},
                {"kind": "blocked"},
            )
        )
        b.turn_end(reason)

    def step(self) -> bool:
        """One step; returns whether its message announced tool calls."""
        b = self.b
        b.step_start()
        self.gap()
        if self.chance(4):
            self.header()
        self.compact()
        if self.chance(10):  # cancelled before the model streamed anything
            b.step_end()
            return False
        kinds = self.draw(st.lists(st.sampled_from(("text", "reasoning", "tool-call")), max_size=3))
        blocks: list[dict[str, Any]] = []
        for kind in kinds:
            if kind == "tool-call":
                blocks.append(tool_call_block(b.fresh_id("call"), self.pick(("read", "bash")), '{"path":"a.txt"}'))
            else:
                blocks.append({"type": kind, "text": self.pick(TEXTS) or "x"})
        chunk_seqs = b.stream(blocks, pieces=lambda _i: self.draw(st.integers(1, 3)), between=self.gap)
        # A usage-only message (no blocks) derives to nothing; its provenance may even be empty.
        sources = [] if not blocks and self.chance(2) else chunk_seqs
        b.assistant_message(blocks, source_seqs=sources, usage=self.chance(2))
        self.tools([blk for blk in blocks if blk["type"] == "tool-call"])
        b.step_end()
        return any(blk["type"] == "tool-call" for blk in blocks)

    def tools(self, calls: list[dict[str, Any]]) -> None:
        if not calls:
            return
        b = self.b
        ids = [c["id"] for c in calls]
        started = {i: not self.chance(8) for i in ids}
        order = self.draw(st.permutations(ids))
        call_seq: dict[str, int] = {}

        def result(call_id: str) -> None:
            if not started[call_id]:
                b.not_started_result(call_id)
                return
            failed = self.chance(4)
            b.tool_result(
                call_id,
                self.pick(TEXTS),
                call_seq=call_seq[call_id],
                is_error=True if failed else self.pick((None, False)),
                error={"name": "ToolError", "code": "E_TOOL"} if failed and self.chance(2) else None,
                meta={"durationMs": 3, "truncated": False} if self.chance(3) else None,
            )

        if self.chance(3):  # sequential: each call answered before the next starts
            for call_id in order:
                if started[call_id]:
                    call_seq[call_id] = b.tool_call(call_id)
                result(call_id)
        else:  # parallel: every call recorded, then the results as they finish
            for call_id in order:
                if started[call_id]:
                    call_seq[call_id] = b.tool_call(call_id)
                    self.gap()
            for call_id in self.draw(st.permutations(ids)):
                result(call_id)

    def play(self, max_turns: int) -> None:
        b = self.b
        self.gap()
        turns = self.draw(st.integers(1, max_turns))
        leave_open = self.chance(4)
        for number in range(1, turns + 1):
            last = number == turns
            crash = self.chance(5) or (last and leave_open)
            b.arm_crash(self.draw(st.integers(1, 40)) if crash else None)
            try:
                self.turn()
            except Crashed:
                if last and leave_open:
                    return
                b.close_interrupted()
                b.end_seed()
            b.arm_crash(None)
            self.gap()
            if self.chance(6):
                b.end_seed()  # a resume point between turns


@st.composite
def generated_sessions(draw: Any, max_turns: int = 5, max_steps: int = 4) -> GeneratedSession:
    """A valid session log built event by event (see the module docstring)."""
    builder = SessionBuilder()
    _Player(draw, builder, max_steps).play(max_turns)
    return GeneratedSession(
        events=tuple(builder.events), session=builder.session, checkpoints=tuple(builder.checkpoints)
    )


# ---------------------------------------------------------------------------------------------- a live writer


BRIEF_HEADER: dict[str, Any] = {"config": {"provider": "p", "model": "m"}, "system": "be brief"}


async def user_turn(writer: SessionWriter, text: str, header: dict[str, Any] = BRIEF_HEADER) -> int:
    """A turn left open at a step, ready for a request: the turn before it closed, a user message, step/start (and
    the header on the first turn); the seq flushed."""
    turn = writer.session.last_turn + 1
    if turn > 1:
        await writer.emit("step/end", {"turn": turn - 1, "step": 1})
        await writer.emit("turn/end", {"turn": turn - 1, "reason": {"kind": "completed"}})
    await writer.emit("turn/start", {"turn": turn})
    if turn == 1:
        await writer.emit("request/header", {"header": header, "reason": "initial"})
    await writer.emit("user/message", user_message_data(text, f"u{turn}"), surface_op="append")
    await writer.emit("step/start", {"turn": turn, "step": 1})
    return await writer.flush()


async def closed_turn(writer: SessionWriter, text: str = "Hello.") -> list[Event]:
    """One whole turn: a user message, a step that answers with text."""
    turn = writer.session.last_turn + 1
    return [
        await writer.emit("turn/start", {"turn": turn}),
        await writer.emit("user/message", user_message_data(text, f"u{turn}"), surface_op="append"),
        await writer.emit("step/start", {"turn": turn, "step": 1}),
        await writer.emit(
            "assistant/message",
            assistant_message_data(turn, 1, [text_block(f"answer {turn}")], f"a{turn}"),
            surface_op="append",
            source_event_seqs=[],
        ),
        await writer.emit("step/end", {"turn": turn, "step": 1}),
        await writer.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}}),
    ]


async def streamed_turn(writer: SessionWriter, text: str, *, deltas: int = 5, tools: int = 1) -> None:
    """One whole turn as an agent writes it: header, streamed chunks, an assistant message that calls tools, the
    calls and results, then a step that answers; flushed where an agent flushes (before requests and tools)."""
    session = writer.session
    turn = session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    await writer.emit("user/message", user_message_data(text, f"u{turn}-{uuid.uuid4().hex[:6]}"), surface_op="append")
    await writer.emit("step/start", {"turn": turn, "step": 1})
    if session.fold_request_header() is None or turn % 3 == 0:
        header = {"config": {"provider": "p", "model": "m", "temperature": 0.1 * (turn % 5)}, "system": f"sys {turn}"}
        reason = "initial" if session.fold_request_header() is None else "change"
        await writer.emit("request/header", {"header": header, "reason": reason})
    await writer.flush()  # before the provider request
    first = writer.next_seq
    await writer.emit(
        "assistant/chunk", {"turn": turn, "step": 1, "chunk": {"type": "block-start", "index": 0, "blockType": "text"}}
    )
    for i in range(deltas):
        await writer.emit(
            "assistant/chunk", {"turn": turn, "step": 1, "chunk": {"type": "text-delta", "index": 0, "text": f"t{i} "}}
        )
    said = "".join(f"t{i} " for i in range(deltas))
    await writer.emit(
        "assistant/chunk",
        {"turn": turn, "step": 1, "chunk": {"type": "block-end", "index": 0, "block": text_block(said)}},
    )
    calls = [tool_call_block(f"c{turn}-{i}", "read", f'{{"path":"f{i}"}}') for i in range(tools)]
    await writer.emit(
        "assistant/message",
        assistant_message_data(turn, 1, [text_block(said), *calls], f"a{turn}"),
        surface_op="append",
        source_event_seqs=list(range(first, writer.next_seq)),
    )
    for call in calls:
        data = {"turn": turn, "step": 1, "callId": call["id"], "name": "read", "arguments": call["arguments"]}
        call_seq = (await writer.emit("tool/call", data)).seq
        await writer.flush()  # before the tool body
        await writer.emit(
            "tool/result",
            tool_result_data(turn, 1, call["id"], "ok " * 5, msg_id=f"r-{call['id']}"),
            surface_op="append",
            source_event_seqs=[call_seq],
        )
    await writer.emit("step/end", {"turn": turn, "step": 1})
    await writer.emit("step/start", {"turn": turn, "step": 2})
    await writer.emit(
        "assistant/message",
        assistant_message_data(turn, 2, [text_block(f"done {turn}")], f"a{turn}b"),
        surface_op="append",
        source_event_seqs=[],
    )
    await writer.emit("step/end", {"turn": turn, "step": 2})
    await writer.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}})


async def compact_all(writer: SessionWriter) -> None:
    """A turn whose compaction replaces every surface node so far (a new generation)."""
    session = writer.session
    turn = session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    nodes = list(session.surface.nodes)
    await writer.compact(nodes[0], nodes[-1], f"summary of {len(nodes)} nodes")
    await writer.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}})
