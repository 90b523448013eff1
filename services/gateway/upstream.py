"""The upstream provider: an OpenAI-compatible chat-completions endpoint reached with aiohttp's client.

An `Upstream` knows its base URL, API key, model map and timeouts. `open()` sends the exact bytes it is given and
returns the response with its body still unread (streamed or not), or raises a typed error that the gateway maps to
an OpenAI-style error: `UPSTREAM_TIMEOUT` (504), `UPSTREAM_UNREACHABLE` (502), `UPSTREAM_ERROR` (the provider
answered an error status). The client's own `Authorization` (the gateway's key) never goes upstream. Every route of
a gateway shares one `UpstreamClient` (one aiohttp session, its keep-alive connector), closed when the gateway stops.
"""

from __future__ import annotations

import errno
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import certifi
import msgspec
from multidict import CIMultiDictProxy
from yarl import URL

from sessionlog.errors import SessionLogError, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from sessionlog.wire import checked_body

# aiohttp pauses reading from the provider past twice this many buffered response bytes (backpressure: 256 KiB)
_READ_BUFSIZE: Final = 128 * 1024


class UpstreamIOError(Exception):
    """The provider could not be reached, or broke the connection or HTTP in the middle of an exchange."""


class UpstreamReadTimeout(UpstreamIOError):
    """Nothing arrived within the timeout (connecting, waiting for the head, or between body bytes)."""


def _io_error(exc: BaseException) -> UpstreamIOError:
    if isinstance(exc, TimeoutError):  # aiohttp's connect and socket-read timeouts are TimeoutErrors
        return UpstreamReadTimeout("no answer within the timeout")
    return UpstreamIOError(str(exc) or type(exc).__name__)


async def _on_reuse(_session: aiohttp.ClientSession, context: Any, _params: Any) -> None:
    context.trace_request_ctx["reused"] = True


# Tells a request whether it went out on a kept-alive connection (aiohttp says so only through tracing).
_REUSE: Final = aiohttp.TraceConfig()
_REUSE.on_connection_reuseconn.append(_on_reuse)
_REUSE.freeze()


def _closed_before_reply(exc: aiohttp.ClientError) -> bool:
    """Whether a request failed because its connection was found closed before any byte of a reply came back. On a
    kept-alive connection that is the provider having closed it meanwhile, and resending cannot make the provider
    answer twice; on a fresh one the provider may have acted on it, so the caller resends only a reused one."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # else the part of a response head that did arrive
    if isinstance(exc, aiohttp.ClientConnectorError):  # connecting failed: the provider is unreachable
        return False
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


class UpstreamResponse:
    """A provider's response once its head arrived: `status_code`, `headers` (case-insensitive), the body read with
    `aiter_raw` (as the bytes came, de-chunked, never decompressed) or `aread`. `aclose` before the end drops the
    connection (it cannot be reused); a response read to its end has already gone back to the pool."""

    __slots__ = ("_raw", "headers", "status_code")

    def __init__(self, raw: aiohttp.ClientResponse) -> None:
        self._raw = raw
        self.status_code = raw.status
        self.headers: CIMultiDictProxy[str] = raw.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._raw.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _io_error(exc) from None

    async def aread(self) -> bytes:
        try:
            return await self._raw.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _io_error(exc) from None

    async def aclose(self) -> None:
        self._raw.close()


class UpstreamClient:
    """The aiohttp session every route of one gateway shares, made on first use (it needs the running loop).

    No cookies are kept, redirects are not followed, proxy environment variables are not read (settings are the only
    configuration) and bodies are not decompressed: the response bytes are relayed and teed exactly as they arrive.
    TLS verifies against certifi's roots."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0,  # no cap on connections in flight (the gateway's own limits are elsewhere)
                ssl=ssl.create_default_context(cafile=certifi.where()),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trace_configs=[_REUSE],
                auto_decompress=False,
                trust_env=False,
                read_bufsize=_READ_BUFSIZE,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


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


def upstream_transport() -> UpstreamClient:
    """The client every route of a gateway shares (one aiohttp session, HTTP/1.1 keep-alive)."""
    return UpstreamClient()


class Upstream:
    """Sends chat-completions requests to one provider on the shared client.

    `accept-encoding: identity` because the response bytes are relayed and teed exactly as they arrive, which a
    compressed body would not survive.
    """

    def __init__(self, config: UpstreamConfig, client: UpstreamClient) -> None:
        self.config = config
        self._client = client
        url = URL(config.url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"an upstream URL must be http:// or https:// with a host, got {config.url!r}")
        self._url = url
        self._models_url = url.with_path(url.path.removesuffix("/chat/completions") + "/models")
        self._headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "accept-encoding": "identity",
            "user-agent": "sessionlog-gateway",
        }
        if config.api_key:
            self._headers["authorization"] = f"Bearer {config.api_key}"
        # `sock_read` also bounds the wait for the response's head, as the timeout always did
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=config.timeout_s)

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

    async def _send(self, method: str, url: URL, data: bytes | None) -> UpstreamResponse:
        config = self.config
        session = self._client.session
        resent = False
        while True:
            sent_on: dict[str, bool] = {}
            try:
                raw = await session.request(
                    method, url, data=data, headers=self._headers, timeout=self._timeout, allow_redirects=False,
                    trace_request_ctx=sent_on,
                )  # fmt: skip
                return UpstreamResponse(raw)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # aiohttp resends only idempotent methods itself; a POST is resent here, once, when a kept-alive
                # connection turned out closed before any reply byte
                reused = sent_on.get("reused", False)
                if not resent and reused and isinstance(exc, aiohttp.ClientError) and _closed_before_reply(exc):
                    resent = True
                    continue
                failure = _io_error(exc)
            if isinstance(failure, UpstreamReadTimeout):
                raise UpstreamTimeout(
                    f"the upstream provider {self.name!r} did not answer within {config.timeout_s}s ({failure})"
                )
            raise UpstreamUnreachable(f"the upstream provider {self.name!r} cannot be reached: {failure}")

    async def open(self, body: bytes) -> UpstreamResponse:
        """Send the request; the response's body is left unread. Raises `UPSTREAM_TIMEOUT` / `UPSTREAM_UNREACHABLE`."""
        return await self._send("POST", self._url, body)

    async def models(self) -> bytes:
        """The provider's model list (`GET {base}/models`), as it answers it; a typed error otherwise."""
        response = await self._send("GET", self._models_url, None)
        try:
            data = await response.aread()
        except UpstreamIOError as exc:
            raise stream_error(exc, self.name, self.config.timeout_s) from None
        finally:
            await response.aclose()
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
