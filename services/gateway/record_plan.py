"""Record mode's plan of one request, made before anything is written: which of the client's messages extend the
log's derivation, whether the rest is a history edit and how it is logged (a view replacement whose provenance
names every shadowed node), which tool messages answer the open step, and the request header. A request refused
here leaves the log unchanged, and a first request refused here creates no session.

The client's messages are matched under `sessionlog.wireforms`' equivalence. `Known` is what the plan keeps of a
session between requests (the wire cache, the last request's messages bytes, the folded header's canonical form),
so that an agent's next request, which repeats its context, costs O(new messages).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from sessionlog.errors import DerivationDiverges, EventTooLarge, InvalidRequest, UnsupportedContent
from sessionlog.events import ToolCallBlock, ToolResultBlock
from sessionlog.session import DerivedMessage, Session
from sessionlog.surface import ReplaceOp
from sessionlog.wire import PHRASE, WireCache, not_json
from sessionlog.wireforms import (
    SYSTEM_ROLES,
    canonical,
    logged_message,
    normal_message,
    request_header,
    system_message_text,
    without_reasoning,
)

_msg_decoder: Final = msgspec.json.Decoder(list[Any])


def _decode_messages(raw: bytes) -> list[Any]:
    try:
        return _msg_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"$.messages must be an array of messages: {exc}") from None
    except msgspec.DecodeError as exc:
        raise not_json("$.messages", raw, exc) from None


Replace = tuple[int, int, list[int]]  # a view replacement: its start and end seqs, and the seqs it shadows


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass(slots=True)
class Known:
    """What the plan keeps of one session between its requests."""

    cache: WireCache = field(default_factory=WireCache)
    # The last request's messages bytes, where its closing bracket is, its message count and system message, and
    # the generation its messages were all logged in: the next request that starts with those bytes (an agent's
    # next request repeats its context) is matched from there, so a request costs O(new messages).
    memo: tuple[bytes, int, int, dict[str, Any] | None, int] | None = None
    header: tuple[bytes, bytes] | None = None  # the folded header's bytes and their canonical form


@dataclass(slots=True)
class Client:
    """A request's messages: the system message, and the conversation (only its tail decoded on a memo hit)."""

    system: dict[str, Any] | None
    known: int  # conversation messages known to equal the derivation's first `known`
    tail: list[dict[str, Any]]  # the rest, in canonical wire form
    raw: bytes

    @property
    def count(self) -> int:
        return self.known + len(self.tail)


@dataclass(slots=True)
class New:
    """One message to log: its role on the wire, its logged Message, an assistant message's tool calls and a tool
    message's call id."""

    role: str
    message: dict[str, Any]
    calls: list[dict[str, str]]  # an assistant message's tool calls, logged as tool/call after it
    call_id: str = ""  # a tool message's call


@dataclass(slots=True)
class Plan:
    """What one request logs: `leading` tool results answer the open step's calls (logged in that step), then the
    request's own step, its header when it changed (`initial` for a session's first), then `rest`, the first of
    which is the replacement when `replace` is set."""

    client: Client
    fields: dict[str, Any]  # the request's fields besides `messages`
    leading: list[New]
    rest: list[New]
    replace: Replace | None
    header: dict[str, Any] | None
    initial: bool


class Planner:
    """Plans requests against a session's state; it writes nothing."""

    def __init__(self, *, history_edits: str, provider: str, max_message_bytes: int | None = None) -> None:
        self.history_edits = history_edits
        self.provider = provider
        # A client's message larger than this is refused by the plan (EVENT_TOO_LARGE), before anything is
        # queued: its event, with its envelope, would not fit in a record (the gateway sets it once connected).
        self.max_message_bytes = max_message_bytes

    def plan(self, known: Known, session: Session, parsed: dict[str, Any]) -> Plan:
        """The plan of a request (`parsed` with its `messages` raw) against `session`; refusals raise."""
        raw = parsed.get("messages")
        if not isinstance(raw, msgspec.Raw):
            raise InvalidRequest("a chat-completions request needs a `messages` array")
        client = self._client(known, session, bytes(raw))
        if client.count == 0:
            raise InvalidRequest("$.messages: a request needs at least one message besides the system message")
        derived = session.derive_messages()
        p = client.known
        while p < len(derived) and p < client.count and self._matches(known.cache, client.tail[p - client.known],
                                                                           derived[p]):  # fmt: skip
            p += 1
        system = system_message_text(client.system, "$.messages[0]") if client.system is not None else None
        # An empty system message is none, as the derivation writes none (logged as "", it was a header change at
        # every request, and the provider never received it either way).
        if system == "":
            system = None
        # A field given as null, or `tools: []`, is the field not given (the OpenAI SDKs send `null` for None, and
        # frameworks an empty tools array): the header leaves them out, and so does what it is compared with.
        fields = {k: v for k, v in parsed.items() if k != "messages" and v is not None and (k != "tools" or v != [])}
        if fields.get("n", 1) != 1:
            raise UnsupportedContent(
                f"$.n: {fields['n']!r} choices cannot be logged: a step logs one answer (the provider would answer "
                "each, and the log keep the first only); ask one at a time"
            )
        role = client.system.get("role", "system") if client.system is not None else "system"
        header = request_header(fields, provider=self.provider, system=system, system_role=role)
        folded = session.fold_request_header()
        if folded is not None and (known.header is None or known.header[0] != folded.raw):
            known.header = (folded.raw, canonical(folded.to_builtins()))
        header_changed = folded is None or known.header is None or canonical(header) != known.header[1]
        keeps_tail = False
        replace: Replace | None = None
        if p < len(derived):
            if self.history_edits == "refuse":
                offset = 1 if client.system is not None else 0
                raise DerivationDiverges(
                    f"request {PHRASE} at $.messages[{p + offset}] (the derived message at seq {derived[p].seq}): "
                    "the client's messages do not extend the log (a compaction, truncation or edit), and this "
                    "gateway refuses history edits (SESSIONLOG_GATEWAY_HISTORY_EDITS=refuse)",
                    seq=derived[p].seq,
                )
            summary = self._summary_edit(known.cache, derived, client, p)
            replace, new = summary if summary is not None else self._edit(session, derived, client, p)
            keeps_tail = summary is not None
        else:
            new = [self._to_log(m, client.known + i) for i, m in enumerate(client.tail[p - client.known :])]
        leading, rest = _pair(session, new, replace, keeps_tail=keeps_tail)
        return Plan(client, fields, leading, rest, replace, header if header_changed else None, folded is None)

    @staticmethod
    def remember(known: Known, plan: Plan, session: Session) -> None:
        """After the plan is durably logged: the next request that repeats these messages is matched from there."""
        client = plan.client
        known.memo = (client.raw, len(client.raw.rstrip()) - 1, client.count, client.system, session.generation)

    def _client(self, known: Known, session: Session, raw: bytes) -> Client:
        memo = known.memo
        if memo is not None and memo[4] == session.generation:
            before, close, count, system, _ = memo
            if raw == before:
                return Client(system, count, [], raw)
            if raw.startswith(memoryview(before)[:close]):
                rest = raw[close:].lstrip()
                if rest.startswith(b","):
                    tail = _decode_messages(b"[" + rest[1:])
                    return Client(system, count, [loggable(m, f"$.messages[{count + i + (system is not None)}]")
                                                   for i, m in enumerate(tail)], raw)  # fmt: skip
        messages = _decode_messages(raw)
        system = None
        if messages and isinstance(messages[0], dict) and messages[0].get("role") in SYSTEM_ROLES:
            system = normal_message(messages[0], "$.messages[0]")
            messages = messages[1:]
        offset = 1 if system is not None else 0
        return Client(system, 0, [loggable(m, f"$.messages[{i + offset}]") for i, m in enumerate(messages)], raw)

    @staticmethod
    def _matches(cache: WireCache, message: dict[str, Any], derived: DerivedMessage) -> bool:
        fragment = cache.fragment(derived)
        mine = canonical(message)
        if mine == fragment:
            return True
        if message.get("role") != "assistant" or "reasoning_content" in message:
            return False
        # A client need not echo reasoning: the logged message with it is the one the client holds without it.
        return mine == canonical(without_reasoning(msgspec.json.decode(fragment)))

    def _to_log(self, wire: dict[str, Any], index: int) -> New:
        where = f"$.messages[{index}]"
        role = wire["role"]
        prefix = {"user": "user", "tool": "result", "assistant": "client"}.get(role, "msg")
        message = logged_message(wire, new_id(prefix), where)
        if self.max_message_bytes is not None:
            size = len(msgspec.json.encode(message))
            if size > self.max_message_bytes:
                raise EventTooLarge(
                    f"{where}: the message is {size} bytes logged; an event carries at most {self.max_message_bytes} "
                    "bytes of message (a record's limit less the event's envelope)"
                )
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in wire.get("tool_calls") or ()]  # fmt: skip
        return New(role, message, calls, wire.get("tool_call_id", ""))

    @staticmethod
    def _relog(derived: DerivedMessage) -> New:
        """A message the client kept, logged again (in a replacement's range) from the logged bytes. An assistant
        message's source becomes `client` (with `relogOf`, the seq it repeats): the client supplied it in this
        request, and the audit must not take it for a new answer of the model."""
        message = msgspec.json.decode(derived.raw)
        message["id"] = new_id("relog")
        blocks = derived.message.content
        results = [b for b in blocks if isinstance(b, ToolResultBlock)]
        if results:
            return New("tool", message, [], results[0].tool_call_id)
        if derived.message.role == "assistant":
            message["source"] = {"kind": "client", "relogOf": derived.seq}
        calls = [{"id": b.id, "name": b.name, "arguments": b.arguments} for b in blocks if isinstance(b, ToolCallBlock)]
        return New(derived.message.role, message, calls)

    def _summary_edit(self, cache: WireCache, derived: Any, client: Client, p: int) -> tuple[Replace, list[New]] | None:
        """The usual compaction: the client put one message (a summary) where derived messages `p..j-1` were and
        kept `j..` as they are, then maybe added new ones. That is one replacement of exactly those nodes, and the
        kept messages stay on the surface as the same events (never logged twice). None when the request is not of
        that shape, or when the range would split a tool call from its result (the general edit handles those)."""
        count, n = client.count, len(derived)
        summary = client.tail[p - client.known] if p < count else None
        if summary is None or summary.get("role") not in ("user", "assistant") or summary.get("tool_calls"):
            return None

        def kept_from(j: int) -> bool:
            kept = n - j
            return p + 1 + kept <= count and all(
                self._matches(cache, client.tail[p + 1 + i - client.known], derived[j + i]) for i in range(kept)
            )

        # A kept tail is at most as long as what the client sent after the summary: only those starts can be it.
        end = next((j for j in range(max(p + 1, n - (count - p - 1)), n) if kept_from(j)), None)
        if end is None:
            return None
        inside = range(p, end)
        calls = {b.id for i in inside for b in derived[i].message.content if isinstance(b, ToolCallBlock)}
        results = {b.tool_call_id for i in inside for b in derived[i].message.content if isinstance(b, ToolResultBlock)}
        answered_after = {
            b.tool_call_id for i in range(end, n) for b in derived[i].message.content if isinstance(b, ToolResultBlock)
        }
        added_results = {str(m.get("tool_call_id")) for m in client.tail[p + 1 + n - end - client.known :]}
        if calls != results or calls & (answered_after | added_results):
            return None  # a pair would be split (or a call answered outside the range): not this simple shape
        shadowed = [derived[i].seq for i in inside]
        new = [self._to_log(summary, p)]
        new += [self._to_log(m, p + 1 + n - end + i)
                for i, m in enumerate(client.tail[p + 1 + n - end - client.known :])]  # fmt: skip
        return (derived[p].seq, derived[end - 1].seq, shadowed), new

    def _edit(self, session: Session, derived: Any, client: Client, p: int) -> tuple[Replace, list[New]]:
        """The replacement for a history edit that first differs at conversation message `p`: the node range it
        shadows, its provenance, and the messages to log from there."""
        count = client.count
        calls_at: dict[str, int] = {}  # call id -> index of the derived assistant message that announced it
        result_call: list[int] = []  # per derived message: index of its call's message (-1: not a tool result)
        for i, message in enumerate(derived):
            found = -1
            for block in message.message.content:
                if isinstance(block, ToolCallBlock):
                    calls_at[block.id] = i
                elif isinstance(block, ToolResultBlock):
                    found = calls_at.get(block.tool_call_id, -1)
            result_call.append(found)
        s = min(p, count - 1)

        def role(i: int) -> str:
            if i >= client.known:
                return str(client.tail[i - client.known]["role"])
            return "tool" if result_call[i] >= 0 or is_result(derived[i]) else derived[i].message.role

        while s >= 0:
            split = min((result_call[j] for j in range(s, len(derived)) if 0 <= result_call[j] < s), default=s)
            if split < s:
                s = split
            elif role(s) == "tool":
                s -= 1
            else:
                break
        if s < 0:
            raise DerivationDiverges(
                f"request {PHRASE} at $.messages: the history edit cannot be logged as a view replacement (it would "
                "start with a tool result whose call is not in the request)",
                seq=derived[p].seq if p < len(derived) else None,
            )
        nodes = session.surface.nodes
        start, end = derived[s].seq, nodes[-1]
        plan = session.surface.plan_replace(len(session), ReplaceOp(start=start, end=end))
        # Messages before the first difference are logged again from the log's own bytes (reasoning included).
        new = [self._relog(derived[i]) if i < p else self._to_log(client.tail[i - client.known], i)
               for i in range(s, count)]  # fmt: skip
        return (start, end, sorted(plan.shadowed)), new


def _pair(
    session: Session, new: list[New], replace: Replace | None, *, keeps_tail: bool
) -> tuple[list[New], list[New]]:
    """Split the messages to log into the tool results that answer the open step's calls (logged in that step) and
    the rest, and refuse a tool message whose call neither the open step nor this request made.

    With `keeps_tail` (a summary edit), `new[0]` replaces a range in the middle and the nodes after it stay, so
    tool results answering the open step's calls are logged in that step first, like an extension's."""
    step = session.open_step
    first = 1 if keeps_tail else 0
    lead = first
    if (replace is None or keeps_tail) and step is not None:
        answered = set(step.results)
        while lead < len(new) and new[lead].role == "tool" and new[lead].call_id in step.calls:
            if new[lead].call_id in answered:
                break
            answered.add(new[lead].call_id)
            lead += 1
    leading = new[first:lead]
    rest = new[:first] + new[lead:]
    announced: set[str] = set()
    # calls already answered: in the open step (logged, or leading in this request), then in this request
    answered = {n.call_id for n in leading} | (set(step.results) if step is not None else set())
    for item in rest:
        if item.role == "assistant":
            announced.update(c["id"] for c in item.calls)
            answered -= {c["id"] for c in item.calls}
        elif item.role == "tool":
            if item.call_id in answered:
                raise DerivationDiverges(
                    f"request {PHRASE} at $.messages: a second tool result for call {item.call_id!r}, which has a "
                    "result already"
                )
            if item.call_id not in announced:
                raise DerivationDiverges(
                    f"request {PHRASE} at $.messages: a tool message answers call {item.call_id!r}, which no "
                    "assistant message of the open step or of this request made"
                )
            answered.add(item.call_id)
    return leading, rest


def loggable(message: Any, where: str) -> dict[str, Any]:
    """A conversation message's canonical wire form, refused here (named by its index in the request) when it has
    no logged form: a second system message, a field no Message carries."""
    wire = normal_message(message, where)
    logged_message(wire, "", where)
    return wire


def is_result(derived: DerivedMessage) -> bool:
    return any(isinstance(b, ToolResultBlock) for b in derived.message.content)
