"""The token ledgers: the log's (every attempt counted once, charged to the model of its request header) and the
provider's (every exchange the provider answered, from the raw tee), and what differs between the two."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
from msgspec import UNSET

from ..events import Usage
from ..openai_wire import parse_raw_response, request_decoder
from .attempts import Attempt
from .findings import Ledger, ModelTokens, TokenCounts
from .raw import RawExchange


class TokenLedger:
    """Running token totals: settled attempts of the log per (provider, model), and the raw tee's per model."""

    def __init__(self, model_aliases: Mapping[str, str]) -> None:
        self.model_aliases = model_aliases  # logged model -> the name the gateway sends
        self._totals = TokenCounts()
        self._by_model: dict[tuple[str, str], TokenCounts] = {}
        self._raw_totals = TokenCounts()
        self._raw_by_model: dict[tuple[str, str], TokenCounts] = {}
        self.charges = 0  # how many times the running totals of the log changed (`charged` is new when it moved)

    def account(self, attempt: Attempt) -> None:
        """Count a settled attempt once: its (last) usage chunk, else its message's usage, else one request."""
        if attempt.accounted:
            return
        attempt.accounted = True
        usage = attempt.usage
        if usage is None and attempt.message is not None and attempt.message.data.usage is not UNSET:
            usage = attempt.message.data.usage
        if usage is not None:
            self.charge(attempt.model, usage)
        else:
            self.charges += 1
            self._totals.count_request()
            self._model_counts(attempt.model).count_request()

    def charge(self, model: tuple[str, str], usage: Usage) -> None:
        self.charges += 1
        self._totals.add(usage)
        self._model_counts(model).add(usage)

    def _model_counts(self, model: tuple[str, str]) -> TokenCounts:
        counts = self._by_model.get(model)
        if counts is None:
            counts = self._by_model[model] = TokenCounts()
        return counts

    def charged(self) -> Mapping[tuple[str, str], TokenCounts]:
        """The running totals per (provider, model), settled attempts only (what metrics export). Read only."""
        return self._by_model

    def ledger(self, attempts: Iterable[Attempt]) -> Ledger:
        """The ledger now; `attempts` not settled yet are counted in the answer, not in the running totals."""
        total = msgspec.structs.replace(self._totals)
        by_model = [
            ModelTokens(provider=p, model=m, tokens=msgspec.structs.replace(c))
            for (p, m), c in sorted(self._by_model.items())
        ]
        for attempt in attempts:
            if attempt.accounted:
                continue
            usage = attempt.usage
            entry = next((b for b in by_model if (b.provider, b.model) == attempt.model), None)
            if entry is None:
                entry = ModelTokens(provider=attempt.model[0], model=attempt.model[1], tokens=TokenCounts())
                by_model.append(entry)
            for counts in (total, entry.tokens):
                if usage is not None:
                    counts.add(usage)
                else:
                    counts.count_request()
        return Ledger(total=total, by_model=by_model)

    # ------------------------------------------------------------------------------------------ the provider's

    def count_raw(self, exchange: RawExchange) -> None:
        """One request per answered exchange, its tokens from the usage the provider sent, by the model sent."""
        try:
            model = request_decoder.decode(exchange.request).model if exchange.request else None
        except msgspec.DecodeError:
            model = None
        name = model or "unknown"
        name = next((logged for logged, sent in self.model_aliases.items() if sent == name), name)
        reported = parse_raw_response(exchange.response).usage
        logged = reported.logged() if reported is not None else None
        counts = self._raw_by_model.setdefault(("raw", name), TokenCounts())
        for target in (self._raw_totals, counts):
            if logged is not None:
                target.add(msgspec.convert(logged, Usage))
            else:
                target.count_request()

    def provider_ledger(self) -> Ledger:
        by_model = [
            ModelTokens(provider=p, model=m, tokens=msgspec.structs.replace(c))
            for (p, m), c in sorted(self._raw_by_model.items())
        ]
        return Ledger(total=msgspec.structs.replace(self._raw_totals), by_model=by_model)

    def difference(self, logged: Ledger) -> list[str]:
        """What the provider was seen to answer (raw tee) and the log does not hold, or the reverse, in words."""
        raw, mine = self._raw_totals, logged.total
        out = []
        for what, theirs, ours in (
            ("requests", raw.requests, mine.requests),
            ("input tokens", raw.input_tokens, mine.input_tokens),
            ("output tokens", raw.output_tokens, mine.output_tokens),
        ):
            if theirs != ours:
                out.append(f"{what}: the provider answered {theirs:,} (raw tee), the log holds {ours:,}")
        return out
