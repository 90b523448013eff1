"""The token audit: per step, the raw chunk stream and what it assembles to; per session and model, a token ledger;
and findings, as data, wherever the log disagrees with itself or with the provider's raw bytes. Pure: no I/O.

`SessionAuditor` is fed a session's events in order (`add(event, session)`, the `Session` the event was just
appended to; or `feed(events, session)`, which appends a batch to the session, the gate that validates, and takes
each) and the gateway's raw exchanges (`add_raw`), in any order relative to each other. It assembles every attempt
chunk by chunk: a text delta costs two list appends. `audit_session(session, raw)` is the same for a whole log.

The package, one concern a module: `findings` (codes and result Structs), `attempts` (steps and attempts, assembled
by `sessionlog.assembly`), `content` (how a message differs from its chunks), `auditor` (`SessionAuditor`), `ledger`
(token ledgers), `raw` (raw exchanges and how a raw answer differs), `rawcheck` (pairing and checking them) and
`replay` (a step's chunks at their pace). The raw responses are decoded by `sessionlog.openai_wire`.

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
  is about what arrived, uses the deltas. The rule is `sessionlog.assembly`'s, which the transcript shares.
- Provider usage: `prompt_tokens` may count cache hits or not (DeepSeek's `prompt_cache_hit_tokens`, OpenAI's
  `prompt_tokens_details.cached_tokens`), so the logged input matches when it equals `prompt_tokens` or
  `prompt_tokens` minus the cache hits; output must equal `completion_tokens`; reasoning and cache reads are
  compared when both sides report them.
"""

from ..errors import InvalidStep
from ..openai_wire import RawResponse, parse_raw_response
from ..record import raw_subject
from .attempts import Attempt, Step
from .auditor import SessionAuditor, audit_session
from .content import content_difference
from .findings import (
    FINDING_CODES,
    MESSAGE_DIFFERS,
    MESSAGE_USAGE_DIFFERS,
    PROVENANCE_UNCOVERED,
    PROVIDER_USAGE_DIFFERS,
    RAW_STREAM_DIFFERS,
    REQUEST_NOT_REBUILDABLE,
    AuditReport,
    Finding,
    Ledger,
    ModelTokens,
    StepReport,
    TokenCounts,
    usage_dict,
)
from .raw import COMPLETE_OUTCOME, RawAssembler, RawExchange, provider_usage_difference, raw_difference
from .replay import chunk_delays, parse_step, step_chunks

__all__ = [
    "COMPLETE_OUTCOME",
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
    "Step",
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
