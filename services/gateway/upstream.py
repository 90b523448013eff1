"""The upstream provider: an OpenAI-compatible chat-completions endpoint reached with httpx.

An `Upstream` knows its base URL, API key, model map and timeouts. `open()` sends the exact bytes it is given and
returns the response with its body still unread (streamed or not), or raises a typed error that the gateway maps to
an OpenAI-style error: `UPSTREAM_TIMEOUT` (504), `UPSTREAM_UNREACHABLE` (502), `UPSTREAM_ERROR` (the provider
answered an error status). The client's own `Authorization` (the gateway's key) never goes upstream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from sessionlog.errors import SessionLogError, UpstreamTimeout, UpstreamUnreachable
from sessionlog.wire import checked_body


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


def upstream_transport() -> httpx.AsyncHTTPTransport:
    """The connection pool every route shares (HTTP/1.1 keep-alive)."""
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))


class Upstream:
    """Sends chat-completions requests to one provider.

    Requests go straight to an httpx transport, not through `httpx.AsyncClient`: the client's layers (URL and header
    merging, auth and redirect flows, a cookie jar fed from every response) cost about 0.2 ms a request and do
    nothing here. So no cookies are kept, redirects are not followed (as before) and proxy environment variables are
    not read (settings are the only configuration). `accept-encoding: identity` because the response bytes are
    relayed and teed exactly as they arrive, which a compressed body would not survive.
    """

    def __init__(self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport) -> None:
        self.config = config
        self._transport = transport
        self._url = httpx.URL(config.url)
        timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
        self._extensions = {"timeout": timeout.as_dict()}
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "accept-encoding": "identity",
            "user-agent": f"python-httpx/{httpx.__version__}",  # what httpx.AsyncClient sent
        }
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        self._headers = headers

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

    async def open(self, body: bytes) -> httpx.Response:
        """Send the request; the response's body is left unread. Raises `UPSTREAM_TIMEOUT` / `UPSTREAM_UNREACHABLE`."""
        request = httpx.Request("POST", self._url, content=body, headers=self._headers, extensions=self._extensions)
        try:
            response = await self._transport.handle_async_request(request)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(
                f"the upstream provider {self.name!r} did not answer within {self.config.timeout_s}s "
                f"({type(exc).__name__})"
            ) from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(
                f"the upstream provider {self.name!r} cannot be reached: {type(exc).__name__}: {exc}"
            ) from None
        response.request = request
        return response


def stream_error(exc: BaseException, name: str, timeout_s: float) -> SessionLogError:
    """The typed error for a failure while reading a response body that had started."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"the upstream provider {name!r} sent nothing for {timeout_s}s in the middle of a reply")
    return UpstreamUnreachable(
        f"the upstream provider {name!r} dropped the connection in the middle of a reply ({type(exc).__name__})"
    )
