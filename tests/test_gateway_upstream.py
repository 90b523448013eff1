"""The gateway's client to its providers (`services/gateway/upstream.py`, on aiohttp) against a real provider
process's server: what keeps its pool healthy when connections end, and how its failures are typed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from services.gateway import ScriptedProvider, ServerThread
from services.gateway.scripted import ScriptError
from services.gateway.upstream import Upstream, UpstreamConfig, upstream_transport
from sessionlog.embedded import free_port
from sessionlog.errors import UpstreamTimeout, UpstreamUnreachable

BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture()
def provider() -> Iterator[tuple[ScriptedProvider, ServerThread]]:
    scripted = ScriptedProvider()
    # a short keep-alive: the server closes an idle connection the pool holds
    with ServerThread(scripted.app(), timeout_keep_alive=1) as server:
        yield scripted, server


async def test_a_kept_alive_connection_the_provider_closed_is_replaced(
    provider: tuple[ScriptedProvider, ServerThread],
) -> None:
    scripted, server = provider
    scripted.load([{"text": "one"}, {"text": "two"}, {"text": "three"}])
    pool = upstream_transport()
    upstream = Upstream(UpstreamConfig("p", server.url + "/v1", timeout_s=5, connect_timeout_s=2), pool)
    try:
        first = await upstream.open(BODY)
        assert first.status_code == 200 and b"one" in await first.aread()
        await asyncio.sleep(1.6)  # past the server's keep-alive: the pooled connection is closed on its side
        second = await upstream.open(BODY)
        assert second.status_code == 200 and b"two" in await second.aread()
        # a response closed unread drops its connection; the next request gets a fresh one
        third = await upstream.open(BODY)
        await third.aclose()
        scripted.load([{"text": "four"}])
        fourth = await upstream.open(BODY)
        assert b"four" in await fourth.aread()
    finally:
        await pool.aclose()
    assert len(scripted.received) == 4  # nothing was sent twice


async def test_failures_are_typed_timeout_and_unreachable(provider: tuple[ScriptedProvider, ServerThread]) -> None:
    scripted, server = provider
    pool = upstream_transport()
    slow = Upstream(UpstreamConfig("p", server.url + "/v1", timeout_s=0.3, connect_timeout_s=2), pool)
    nobody = Upstream(UpstreamConfig("q", f"http://127.0.0.1:{free_port()}/v1", timeout_s=1, connect_timeout_s=1), pool)
    try:
        scripted.load([{"text": "late", "delay_s": 2}])
        with pytest.raises(UpstreamTimeout):
            await slow.open(BODY)
        with pytest.raises(UpstreamUnreachable):
            await nobody.open(BODY)
        with pytest.raises(UpstreamUnreachable):
            await nobody.models()
    finally:
        await pool.aclose()


async def test_a_post_is_resent_once_only_when_a_kept_alive_connection_closes_before_any_reply_byte() -> None:
    # A provider that reads each request and hangs up without a byte of reply. On a fresh connection that says
    # nothing about whether it acted on the request, so the POST goes out once (a second could make it answer, and
    # bill, twice); on a kept-alive connection it is the pool's stale-connection race, and the POST is resent once.
    requests = 0
    answer_first = True

    async def provider(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests, answer_first
        while await reader.readuntil(b"\r\n\r\n"):
            requests += 1
            await reader.readexactly(len(BODY))
            if not answer_first:
                break
            answer_first = False
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(provider, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = upstream_transport()
    upstream = Upstream(UpstreamConfig("p", f"http://127.0.0.1:{port}/v1", timeout_s=2, connect_timeout_s=2), pool)
    try:
        first = await upstream.open(BODY)  # answered; its connection goes back to the pool
        assert await first.aread() == BODY
        # the kept-alive connection: read, hung up on; resent once on a fresh connection, hung up on again
        with pytest.raises(UpstreamUnreachable):
            await asyncio.wait_for(upstream.open(BODY), 10)
        assert requests == 3
        # a fresh connection hung up on: sent once
        await pool.aclose()
        with pytest.raises(UpstreamUnreachable):
            await asyncio.wait_for(upstream.open(BODY), 10)
        assert requests == 4
    finally:
        await asyncio.wait_for(pool.aclose(), 10)
        server.close()


def test_a_script_is_checked_when_it_is_loaded_and_a_bad_one_changes_nothing(
    provider: tuple[ScriptedProvider, ServerThread],
) -> None:
    """A misspelt field or a delay in words is refused with the reply and field it concerns, by the constructor, by
    `load` and over HTTP (400), and the provider keeps answering from the script it had."""
    scripted, server = provider
    with pytest.raises(ScriptError, match=r"unknown field `delay` - at `\$\[0\]`"):
        ScriptedProvider([{"text": "hi", "delay": 1}])
    scripted.load([{"text": "kept"}])
    with pytest.raises(ScriptError, match=r"Expected `float`, got `str` - at `\$\[1\].delay_s`"):
        scripted.load([{"text": "fine"}, {"delay_s": "soon"}])
    bad = [b"[{", b'{"text": "an object"}', b"{}", b"5", b"null", b'[{"status": 99}]',
           b'[{"tool_calls": [{"id": "c1", "name": 3}]}]', b'[{"error_after": -1}]', b'[{"headers": {"a": 1}}]',
           b'[{"headers": "retry-after: 2"}]']  # fmt: skip
    for body in bad:
        answer = httpx.post(server.url + "/_scripted/script", content=body)
        assert answer.status_code == 400, (body, answer.text)
        assert "not a script of replies" in answer.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/chat/completions", content=BODY)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "kept"


def test_stamped_chunks_carry_when_each_was_sent_and_a_stamp_that_is_not_a_bool_is_refused(
    provider: tuple[ScriptedProvider, ServerThread],
) -> None:
    """`stamp_chunks` (the benchmarks' per-chunk transit): each streamed chunk says when it was sent, on the
    machine's monotonic clock; without it nothing is added."""
    scripted, server = provider
    with pytest.raises(ScriptError, match=r"Expected `bool`, got `str` - at `\$\[0\].stamp_chunks`"):
        scripted.load([{"text": "a b", "stamp_chunks": "yes"}])
    scripted.load([{"text": "one two three", "stamp_chunks": True, "chunk_delay_s": 0.01}, {"text": "plain"}])
    stream = msgspec.json.encode({**msgspec.json.decode(BODY), "stream": True})
    before = time.monotonic_ns()
    body = httpx.post(server.url + "/v1/chat/completions", content=stream).content
    after = time.monotonic_ns()
    chunks = [msgspec.json.decode(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    sent = [int(c["system_fingerprint"].removeprefix("sent_ns=")) for c in chunks]
    assert len(sent) == len(chunks) >= 4
    assert before <= sent[0] and sent == sorted(sent) and sent[-1] <= after
    assert sent[2] - sent[1] >= 10_000_000  # the chunk delay lies between two stamps
    plain = httpx.post(server.url + "/v1/chat/completions", content=stream).content
    assert b"system_fingerprint" not in plain
