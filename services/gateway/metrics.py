"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Invariant checks take microseconds to tens of milliseconds; provider calls take seconds.
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _histogram(name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, buckets=buckets, registry=registry)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sessionlog_gateway_requests",
            "Chat-completion requests by mode (proxy or derive) and outcome (forwarded, refused, upstream_error)",
            ["mode", "outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "sessionlog_gateway_refusals", "Requests refused before the provider, by error code", ["code"], registry=r
        )
        self.invariant_seconds = _histogram(
            "sessionlog_gateway_invariant_seconds",
            "Time to obtain the durable derivation and check the request against it",
            _FAST,
            r,
        )
        self.upstream_first_byte_seconds = _histogram(
            "sessionlog_gateway_upstream_first_byte_seconds",
            "Time from sending a request upstream to the provider's response headers",
            _SLOW,
            r,
        )
        self.upstream_seconds = _histogram(
            "sessionlog_gateway_upstream_seconds",
            "Time from sending a request upstream to the end of the provider's response",
            _SLOW,
            r,
        )
        self.upstream_errors = Counter(
            "sessionlog_gateway_upstream_errors", "Upstream failures by error code", ["code"], registry=r
        )
        self.derivations = Counter(
            "sessionlog_gateway_derivations", "Derivations by the source that answered", ["source"], registry=r
        )
        self.client_disconnects = Counter(
            "sessionlog_gateway_client_disconnects", "Client disconnects that cancelled an upstream call", registry=r
        )
        self.raw_tee_failures = Counter(
            "sessionlog_gateway_raw_tee_failures", "Raw audit publishes that failed", registry=r
        )
