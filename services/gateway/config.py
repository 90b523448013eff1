"""The gateway's configuration, taken from the shared `Settings` (the only place settings are read and defaulted)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from sessionlog.settings import Settings

from .upstream import UpstreamConfig

DerivationMode = Literal["auto", "stream", "context-deriver"]


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How one gateway runs: where it listens, its key, its upstream routes and how it obtains derivations.

    `routes` maps a `config.provider` name to its upstream; any other provider goes to `upstream`.
    `derivation`: "auto" asks the context-deriver and falls back to the stream; "stream" reads the stream only.
    """

    host: str = "127.0.0.1"
    port: int = 8470
    api_key: str | None = field(default=None, repr=False)
    upstream: UpstreamConfig = field(default_factory=lambda: UpstreamConfig("default", "https://api.deepseek.com"))
    routes: Mapping[str, UpstreamConfig] = field(default_factory=dict)
    derivation: DerivationMode = "auto"
    derive_wait_s: float = 5.0
    deriver_timeout_s: float = 1.0
    raw_stream: str = "SESSIONLOG_RAW"
    raw_tee: bool = True
    metrics_port: int = 0
    max_sessions: int = 1024

    def with_(self, **changes: Any) -> GatewayConfig:
        return replace(self, **changes)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> GatewayConfig:
        key = settings.provider_api_key.get_secret_value() if settings.provider_api_key is not None else None
        upstream = UpstreamConfig(
            name="default",
            base_url=settings.provider_base_url,
            api_key=key,
            model_map=dict(settings.provider_model_map),
            timeout_s=settings.gateway_upstream_timeout_s,
            connect_timeout_s=settings.gateway_upstream_connect_timeout_s,
        )
        taken = {name: getattr(settings, setting) for name, setting in _SETTINGS.items()}
        return replace(cls(upstream=upstream, **taken), **overrides)


# GatewayConfig's fields taken as they are from the settings of these names
_SETTINGS: Final = dict(
    host="gateway_host", port="gateway_port", api_key="gateway_api_key", derivation="gateway_derivation",
    derive_wait_s="gateway_derive_wait_s", deriver_timeout_s="gateway_deriver_timeout_s", raw_stream="raw_stream",
    raw_tee="gateway_raw_tee", metrics_port="metrics_port",
)  # fmt: skip
