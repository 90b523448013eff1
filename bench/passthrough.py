"""The floor for "an HTTP hop": a plain pass-through proxy on the gateway's own stack (Starlette, uvicorn with
httptools on the gateway's event loop, the gateway's `Upstream` and connection pool, its `RelayResponse`),
forwarding the request body as it came and streaming the answer back, with no log, no check, no tee: what remains
between it and the gateway is the gateway's own work.
`python -m bench.passthrough --port P --upstream URL` (URL is the provider's chat-completions endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.gateway.forward import RelayResponse
from services.gateway.serving import run
from services.gateway.upstream import Upstream, UpstreamConfig, upstream_transport
from sessionlog.asgi import serve_until_cancelled


def app(upstream_url: str) -> Starlette:
    base = upstream_url.removesuffix("/chat/completions")
    upstream = Upstream(UpstreamConfig(name="provider", base_url=base), upstream_transport())

    async def forward(request: Request) -> Response:
        body = await request.body()
        reply = await upstream.open(body)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        media = reply.headers.get("content-type", "text/event-stream")
        return RelayResponse(relay(), status_code=reply.status_code, media_type=media,
                                 headers={"cache-control": "no-cache"})  # fmt: skip

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/v1/chat/completions", forward, methods=["POST"]), Route("/healthz", healthz)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_until_cancelled(app(args.upstream), "127.0.0.1", args.port, lifespan="off"))


if __name__ == "__main__":
    main()
