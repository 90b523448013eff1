"""The gateway: the only road from an agent to a model provider, with the invariant before every request.

`serve(settings)` runs it on its own (`python -m services.gateway`; `sessionlog serve gateway` runs `run.start`);
`build_app(settings, ...)` gives the ASGI app.
"""

from __future__ import annotations

import logging

from sessionlog.asgi import serve_until_cancelled
from sessionlog.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from sessionlog.record import raw_subject
from sessionlog.settings import Settings

from .app import Gateway, build_app
from .config import GatewayConfig
from .derivation import ContextDeriverClient, Derivation, DerivationSource, StreamSource
from .scripted import ScriptedProvider, load_script
from .serving import ServerThread
from .upstream import UpstreamConfig

log = logging.getLogger("sessionlog.gateway")


async def serve(settings: Settings, config: GatewayConfig | None = None) -> None:
    """Run the gateway until cancelled; it serves `/healthz` and `/metrics` on its own port too."""
    config = config or GatewayConfig.from_settings(settings)
    app = build_app(settings, config)
    log.info("gateway on http://%s:%d, upstream %s", config.host, config.port, config.upstream.base_url)
    await serve_until_cancelled(app, config.host, config.port, name="the gateway")


__all__ = [
    "ContextDeriverClient",
    "Derivation",
    "DerivationSource",
    "Gateway",
    "GatewayConfig",
    "ScriptedProvider",
    "ServerThread",
    "StreamSource",
    "UpstreamConfig",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "build_app",
    "load_script",
    "raw_subject",
    "serve",
]
