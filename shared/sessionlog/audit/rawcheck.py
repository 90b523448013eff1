"""The raw check: each exchange the gateway forwarded is paired with the attempt it answered, once that attempt is
complete in the log, and its request and response are compared with the log (`REQUEST_NOT_REBUILDABLE`,
`RAW_STREAM_DIFFERS`, `PROVIDER_USAGE_DIFFERS`)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from ..errors import SessionLogError
from ..openai_wire import parse_raw_response
from ..wire import WireCache, compare_request
from .attempts import Attempt, Step
from .content import channels
from .findings import (
    PROVIDER_USAGE_DIFFERS,
    RAW_STREAM_DIFFERS,
    REQUEST_NOT_REBUILDABLE,
    Findings,
)
from .ledger import TokenLedger
from .raw import COMPLETE_OUTCOME, RawExchange, provider_usage_difference, raw_difference


class RawMatcher:
    """Pairs raw exchanges with the attempts of `steps` (in any order relative to the log) and checks each pair."""

    def __init__(
        self, steps: dict[tuple[int, int], Step], findings: Findings, ledger: TokenLedger, aliases: Mapping[str, str]
    ) -> None:
        self.steps = steps
        self.findings = findings
        self.ledger = ledger
        self.model_aliases = aliases
        self.exchanges = 0
        self.matched = 0
        self.pending: list[RawExchange] = []
        self._seen: set[str] = set()
        self._wire = WireCache()

    def add(self, exchange: RawExchange) -> None:
        """A request the gateway forwarded; compared once the attempt it answered is complete in the log."""
        if exchange.request_id in self._seen:
            return
        self._seen.add(exchange.request_id)
        self.exchanges += 1
        if exchange.status == 200:
            self.ledger.count_raw(exchange)
        self.pending.append(exchange)
        self.pending.sort(key=lambda x: x.session_seq)
        self.match()

    def _attempt_after(self, seq: int) -> tuple[Step | None, Attempt | None]:
        """The step open at `seq` and its first unmatched attempt that began after it."""
        for step in reversed(self.steps.values()):
            if step.start_seq <= seq and (step.end_seq is None or step.end_seq > seq):
                for attempt in step.attempts:
                    if attempt.first_seq > seq and not attempt.matched:
                        return step, attempt
                return step, None
            if step.start_seq <= seq:
                break
        return None, None

    def match(self) -> None:
        """Compare every pending exchange whose attempt is now complete in the log."""
        keep: list[RawExchange] = []
        for exchange in self.pending:
            step, attempt = self._attempt_after(exchange.session_seq)
            if attempt is not None:
                if not attempt.closed:
                    keep.append(exchange)  # still streaming: compare once it is complete
                    continue
                attempt.matched = True
                self.matched += 1
                self._compare(exchange, attempt)
            elif step is not None and step.end_seq is not None:
                self._unlogged(exchange, step)
            else:
                keep.append(exchange)
        self.pending = keep

    def _compare(self, exchange: RawExchange, attempt: Attempt) -> None:
        step = f"{attempt.turn}.{attempt.step}"
        where = f"request {exchange.request_id} (step {step}, first chunk at seq {attempt.first_seq})"
        at = (attempt.first_seq, attempt.turn, attempt.step, exchange.request_id)
        self._check_request(exchange, attempt, where)
        raw = parse_raw_response(exchange.response)
        logged = attempt.streamed()  # the raw check is about what arrived: the deltas (sessionlog.assembly)
        if exchange.status != 200:
            text, reasoning, calls = channels(logged)
            if text or reasoning or calls:
                message = f"{where}: the provider answered HTTP {exchange.status}, but the log holds a response for it"
                self.findings.find(RAW_STREAM_DIFFERS, message, *at)
            return
        partial = exchange.outcome != COMPLETE_OUTCOME or attempt.cut_short or raw.error is not None
        difference = raw_difference(raw, logged, finish=attempt.finish, partial=partial)
        if difference is not None:
            message = f"{where}: the provider's raw response differs from the logged chunks: {difference}"
            self.findings.find(RAW_STREAM_DIFFERS, message, *at)
        if raw.usage is not None and attempt.usage is not None:
            usage_reason = provider_usage_difference(attempt.usage, raw.usage)
            if usage_reason is not None:
                message = f"{where}: the provider reported other usage than the usage chunk: {usage_reason}"
                self.findings.find(PROVIDER_USAGE_DIFFERS, message, *at)

    def _check_request(self, exchange: RawExchange, attempt: Attempt, where: str) -> None:
        if attempt.header is None or not exchange.request:
            return  # already found (no header), or the tee holds no request bytes
        at = (attempt.first_seq, attempt.turn, attempt.step, exchange.request_id)
        try:
            request = msgspec.json.decode(exchange.request)
        except msgspec.DecodeError:
            request = None
        if not isinstance(request, dict):
            self.findings.find(REQUEST_NOT_REBUILDABLE, f"{where}: the raw request is not a JSON object", *at)
            return
        logged_model = attempt.header.header.config.model
        if request.get("model") != logged_model and request.get("model") == self.model_aliases.get(logged_model):
            request = {**request, "model": logged_model}  # the gateway's own rename of the logged model
        try:
            divergence = compare_request(request, attempt.messages, attempt.header, cache=self._wire)
        except SessionLogError as err:
            message = f"{where}: the derivation has no wire form ({err.code}: {err.message})"
            self.findings.find(REQUEST_NOT_REBUILDABLE, message, *at)
            return
        if divergence is not None:
            message = (
                f"{where}: the request does not rebuild from the log prefix before seq {attempt.first_seq} "
                f"({divergence.code} at {divergence.path}): {divergence.message}"
            )
            self.findings.find(REQUEST_NOT_REBUILDABLE, message, *at)

    def _unlogged(self, exchange: RawExchange, step: Step) -> None:
        if exchange.status != 200:
            return  # a refused call: the agent may log a failed attempt or nothing
        raw = parse_raw_response(exchange.response)
        if raw.text or raw.reasoning or raw.tool_calls:
            message = (
                f"request {exchange.request_id}: the provider answered in step {step.turn}.{step.step}, but the log "
                f"holds no chunks for it after seq {exchange.session_seq}"
            )
            self.findings.find(RAW_STREAM_DIFFERS, message, exchange.session_seq, step.turn, step.step,
                               exchange.request_id)  # fmt: skip
