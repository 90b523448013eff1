"""Synthetic session logs for benchmarks: realistic turns with streamed chunks, tool calls and results."""

from __future__ import annotations

from typing import Any

from sessionlog.events import encode_new_event


class LogBuilder:
    """Builds a valid log event by event, with seq and time."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.turn = 0
        self.surface: list[int] = []  # seqs of the messages the derived view holds now
        self.compactions = 0

    def add(self, event_type: str, data: Any, **surface: Any) -> int:
        seq = len(self.events)
        self.events.append(encode_new_event(event_type, data, seq=seq, time=1_780_000_000_000 + seq, **surface))
        if surface.get("surface_op") == "append":
            self.surface.append(seq)
        return seq

    def _chunk(self, turn: int, chunk: dict[str, Any]) -> None:
        self.add("assistant/chunk", {"turn": turn, "step": 1, "chunk": chunk})

    def compact(self) -> None:
        """In an open turn: one summary message replaces every message so far (a `replace` surface op)."""
        self.compactions += 1
        summary = {
            "id": f"sum{self.compactions}",
            "role": "user",
            "source": {"kind": "plugin", "plugin": "compact"},
            "content": [{"type": "text", "text": "summary of the conversation so far " * 4}],
        }
        nodes = self.surface
        op = {"op": "replace", "start": nodes[0], "end": nodes[-1]}
        seq = self.add("user/message", summary, surface_op=op, source_event_seqs=sorted(nodes))
        self.surface = [seq]

    def turn_with_tools(self, *, deltas: int = 40, tools: int = 2, compact: bool = False) -> None:
        """One turn: a user message, a step that streams text and calls tools, a step that answers; with `compact`,
        the turn opens with a compaction of everything before it."""
        self.turn += 1
        t = self.turn
        self.add("turn/start", {"turn": t})
        if compact and self.surface:
            self.compact()
        msg = {
            "id": f"u{t}",
            "role": "user",
            "source": {"kind": "user"},
            "content": [{"type": "text", "text": "q" * 80}],
        }
        self.add("user/message", msg, surface_op="append")
        self.add("step/start", {"turn": t, "step": 1})
        if t == 1:
            header = {"config": {"provider": "p", "model": "m", "temperature": 0.2}, "system": "be brief"}
            self.add("request/header", {"header": header, "reason": "initial"})
        calls = [
            {"type": "tool-call", "id": f"c{t}-{i}", "name": "read", "arguments": '{"path":"a"}'} for i in range(tools)
        ]
        usage = {"inputTokens": 100, "outputTokens": deltas}
        text = "tok " * deltas
        first = len(self.events)
        # What a faithful agent streams: the text's deltas, each tool call's, then every block's end, the usage and
        # the finish; its message is what they assemble to (the token-auditor finds nothing).
        self._chunk(t, {"type": "block-start", "index": 0, "blockType": "text"})
        for _ in range(deltas):
            self._chunk(t, {"type": "text-delta", "index": 0, "text": "tok "})
        for i, c in enumerate(calls, start=1):
            self._chunk(t, {"type": "block-start", "index": i, "blockType": "tool-call"})
            self._chunk(t, {"type": "tool-call-delta", "index": i, "id": c["id"], "name": c["name"],
                            "argumentsDelta": c["arguments"]})  # fmt: skip
        for i, block in enumerate([{"type": "text", "text": text}, *calls]):
            self._chunk(t, {"type": "block-end", "index": i, "block": block})
        self._chunk(t, {"type": "usage", "usage": usage})
        self._chunk(t, {"type": "finish", "reason": {"kind": "tool-calls" if calls else "stop"}})
        message = {
            "id": f"a{t}",
            "role": "assistant",
            "source": {"kind": "model", "provider": "p", "model": "m"},
            "content": [{"type": "text", "text": text}, *calls],
        }
        self.add(
            "assistant/message",
            {"turn": t, "step": 1, "message": message, "usage": usage},
            surface_op="append",
            source_event_seqs=list(range(first, len(self.events))),
        )
        call_seqs = [
            self.add(
                "tool/call", {"turn": t, "step": 1, "callId": c["id"], "name": "read", "arguments": c["arguments"]}
            )
            for c in calls
        ]
        for c, call_seq in zip(calls, call_seqs, strict=True):
            result = {
                "id": f"r-{c['id']}",
                "role": "user",
                "source": {"kind": "tool", "callId": c["id"]},
                "content": [
                    {"type": "tool-result", "toolCallId": c["id"], "content": [{"type": "text", "text": "x" * 200}]}
                ],
            }
            self.add(
                "tool/result",
                {"turn": t, "step": 1, "message": result},
                surface_op="append",
                source_event_seqs=[call_seq],
            )
        self.add("step/end", {"turn": t, "step": 1})
        self.add("step/start", {"turn": t, "step": 2})
        answer = {
            "id": f"a{t}b",
            "role": "assistant",
            "source": {"kind": "model", "provider": "p", "model": "m"},
            "content": [{"type": "text", "text": "done"}],
        }
        self.add(
            "assistant/message", {"turn": t, "step": 2, "message": answer}, surface_op="append", source_event_seqs=[]
        )
        self.add("step/end", {"turn": t, "step": 2})
        self.add("turn/end", {"turn": t, "reason": {"kind": "completed"}})


def synthetic_log(n_events: int, *, deltas: int = 40, tools: int = 2, compact_every: int = 0) -> list[bytes]:
    """Whole turns until at least `n_events`; with `compact_every`, every that many turns the next turn opens
    with a compaction."""
    builder = LogBuilder()
    while len(builder.events) < n_events:
        due = bool(compact_every) and builder.turn > 0 and builder.turn % compact_every == 0
        builder.turn_with_tools(deltas=deltas, tools=tools, compact=due)
    return builder.events


HEADER = b'{"type":"session","version":0,"id":"bench","createdAt":1780000000000,"delegationDepth":0}'
