"""The upstream provider: an OpenAI-compatible chat-completions endpoint reached with the gateway's client (`http1`).

An `Upstream` knows its base URL, API key, model map and timeouts. `open()` sends the exact bytes it is given and
returns the response with its body still unread (streamed or not), or raises a typed error that the gateway maps to
an OpenAI-style error: `UPSTREAM_TIMEOUT` (504), `UPSTREAM_UNREACHABLE` (502), `UPSTREAM_ERROR` (the provider
answered an error status). The client's own `Authorization` (the gateway's key) never goes upstream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sessionlog.errors import SessionLogError, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from sessionlog.wire import checked_body

from .http1 import ConnectionPool, Origin, Response, UpstreamIOError, UpstreamReadTimeout


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """One route to a provider. `model_map` rewrites the logged model name into the provider's."""

    name: str
    base_url: str
    api_key: str | None = field(default=None, repr=False)
    model_map: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


def upstream_error_message(status: int, body: bytes) -> str:
    """A readable summary of a provider's error body (OpenAI-style `{"error": {"message"}}` or anything else)."""
    detail = body[:500].decode("utf-8", "replace").strip()
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            detail = error["message"]
        elif isinstance(error, str):
            detail = error
    return f"the upstream provider answered HTTP {status}: {detail or '(empty body)'}"


def gateway_status_for(upstream_status: int) -> int:
    """What the gateway answers for a provider error: a client error passes through (the request is at fault),
    except an auth failure, which is the gateway's own configuration; a server error is a bad gateway."""
    if upstream_status in (401, 403) or upstream_status >= 500:
        return 502
    return upstream_status


def upstream_transport() -> ConnectionPool:
    """The connection pool every route shares (HTTP/1.1 keep-alive)."""
    return ConnectionPool(max_idle=64)


class Upstream:
    """Sends chat-completions requests to one provider.

    Each request is written whole (head and body in one write) on a kept-alive connection of the shared pool. No
    cookies are kept, redirects are not followed and proxy environment variables are not read (settings are the
    only configuration). `accept-encoding: identity` because the response bytes are relayed and teed exactly as they
    arrive, which a compressed body would not survive.
    """

    def __init__(self, config: UpstreamConfig, pool: ConnectionPool) -> None:
        self.config = config
        self._pool = pool
        self._origin = Origin.parse(config.url)
        headers = {
            "host": self._origin.host_header,
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "accept-encoding": "identity",
            "user-agent": "sessionlog-gateway",
        }
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
        self._post = f"POST {self._origin.path} HTTP/1.1\r\n".encode("latin-1") + self._head

    @property
    def name(self) -> str:
        return self.config.name

    def forward_body(self, request: Mapping[str, Any], messages: bytes) -> bytes:
        """The bytes to send for a request that passed the check: its fields as compared (the model mapped to the
        provider's name) and `messages` as the checked canonical bytes. Never the request's own `messages`, which a
        lazy parse keeps as the caller's bytes, duplicate keys and all."""
        model = request.get("model")
        mapped = self.config.model_map.get(model) if isinstance(model, str) else None
        if mapped is not None and mapped != model:
            request = {**request, "model": mapped}
        return checked_body(request, messages)

    async def _send(self, data: bytes) -> Response:
        config = self.config
        try:
            return await self._pool.request(
                self._origin, data, connect_timeout_s=config.connect_timeout_s, timeout_s=config.timeout_s
            )
        except UpstreamReadTimeout as exc:
            raise UpstreamTimeout(
                f"the upstream provider {self.name!r} did not answer within {config.timeout_s}s ({exc})"
            ) from None
        except UpstreamIOError as exc:
            raise UpstreamUnreachable(f"the upstream provider {self.name!r} cannot be reached: {exc}") from None

    async def open(self, body: bytes) -> Response:
        """Send the request; the response's body is left unread. Raises `UPSTREAM_TIMEOUT` / `UPSTREAM_UNREACHABLE`."""
        return await self._send(self._post + b"content-length: %d\r\n\r\n" % len(body) + body)

    async def models(self) -> bytes:
        """The provider's model list (`GET {base}/models`), as it answers it; a typed error otherwise."""
        path = self._origin.path.removesuffix("/chat/completions") + "/models"
        response = await self._send(f"GET {path} HTTP/1.1\r\n".encode("latin-1") + self._head + b"\r\n")
        try:
            data = await response.aread()
        except UpstreamIOError as exc:
            raise stream_error(exc, self.name, self.config.timeout_s) from None
        if response.status_code != 200:
            raise UpstreamError(
                upstream_error_message(response.status_code, data),
                status=gateway_status_for(response.status_code),
                upstream_status=response.status_code,
            )
        return data


def stream_error(exc: BaseException, name: str, timeout_s: float) -> SessionLogError:
    """The typed error for a failure while reading a response body that had started."""
    if isinstance(exc, UpstreamReadTimeout):
        return UpstreamTimeout(f"the upstream provider {name!r} sent nothing for {timeout_s}s in the middle of a reply")
    return UpstreamUnreachable(
        f"the upstream provider {name!r} dropped the connection in the middle of a reply ({type(exc).__name__})"
    )
