"""Derivations sent as increments: a caller that holds a generation's first messages gets only the ones added.

Within a generation the derived messages only grow (SPEC 5: a replace starts a new generation), so the
context-deriver answers `known_generation` + `known_count` with `messages_from` and the messages after them; the
`sha256` still covers the whole list. The gateway's `ContextDeriverClient` keeps what it received and checks every
increment against that hash, fetching the whole list again when it does not check out. Real nats-server, real
context-deriver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from natsfixtures import log_settings, new_session_id
from sessiongen import user_turn

from services.context_deriver.service import ContextDeriverService
from services.gateway.derivation import ContextDeriverClient, StreamSource, _Known
from sessionlog.errors import InvalidRequest
from sessionlog.log import SessionLog
from sessionlog.micro import call
from sessionlog.session import messages_canonical
from sessionlog.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

DERIVE = "sessionlog.context.derive"
WAIT_S = 10.0


@pytest_asyncio.fixture(loop_scope="module")
async def log(provisioned: Settings) -> AsyncIterator[SessionLog]:
    assert provisioned.nats_url is not None
    opened = await SessionLog.connect(log_settings(provisioned.nats_url))
    service = ContextDeriverService(opened)
    await service.start()
    try:
        yield opened
    finally:
        await service.stop()
        await opened.close()


async def derive(log: SessionLog, body: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = await call(log.nc, DERIVE, body, timeout=WAIT_S)
    return reply


async def test_the_deriver_sends_only_the_messages_after_those_the_caller_holds(log: SessionLog) -> None:
    writer = await log.create(new_session_id("inc"))
    try:
        seq = await user_turn(writer, "first")
        whole = await derive(log, {"session": writer.session_id, "min_seq": seq})
        assert "messages_from" not in whole and len(whole["messages"]) == 1
        seq = await user_turn(writer, "second")
        body = {"session": writer.session_id, "min_seq": seq, "known_generation": 0, "known_count": 1}
        added = await derive(log, body)
        assert added["messages_from"] == 1
        assert [m["content"][0]["text"] for m in added["messages"]] == ["second"]
        full = await derive(log, {"session": writer.session_id, "min_seq": seq})
        assert added["sha256"] == full["sha256"] and whole["messages"] + added["messages"] == full["messages"]
        # Another generation, or more than the deriver has: the whole list, as without the fields.
        for generation, count in ((1, 1), (0, 5)):
            other = {**body, "known_generation": generation, "known_count": count}
            assert await derive(log, other) == full
    finally:
        await writer.close()


async def test_the_client_keeps_what_it_received_and_takes_increments_until_a_compaction(log: SessionLog) -> None:
    writer = await log.create(new_session_id("inc"))
    client = ContextDeriverClient(log.nc, StreamSource(log, wait_s=0.3), timeout_s=3.0)
    try:
        first = await client.derive(writer.session_id, await user_turn(writer, "one"))
        second = await client.derive(writer.session_id, await user_turn(writer, "two"))
        third = await client.derive(writer.session_id, await user_turn(writer, "three"))
        assert (client.incremental, client.fallbacks) == (2, 0)
        assert messages_canonical(third.messages) == messages_canonical(writer.session.derive_messages())
        assert [len(d.messages) for d in (first, second, third)] == [1, 2, 3], "earlier views never change"

        nodes = writer.session.surface.nodes
        await writer.compact(nodes[0], nodes[1], "Summary: one and two.")
        compacted = await client.derive(writer.session_id, await writer.flush())
        assert client.incremental == 2, "a new generation is fetched whole"
        assert compacted.generation == 1
        assert messages_canonical(compacted.messages) == messages_canonical(writer.session.derive_messages())
        after = await client.derive(writer.session_id, await user_turn(writer, "four"))
        assert client.incremental == 3
        assert messages_canonical(after.messages) == messages_canonical(writer.session.derive_messages())
    finally:
        await writer.close()


async def test_an_increment_that_does_not_continue_what_the_client_holds_is_fetched_whole(log: SessionLog) -> None:
    writer = await log.create(new_session_id("inc"))
    client = ContextDeriverClient(log.nc, StreamSource(log, wait_s=0.3), timeout_s=3.0)
    try:
        await client.derive(writer.session_id, await user_turn(writer, "real"))
        # The client's memory goes wrong (a session purged and created again under its id would do this): same
        # generation and count, other bytes. The increment's sha256 cannot check out.
        wrong = _Known(0)
        wrong.extend([b'{"content":[{"text":"not what the log holds","type":"text"}],"id":"x","role":"user",'
                      b'"source":{"kind":"user"}}'], ())  # fmt: skip
        client._known[writer.session_id] = wrong
        derived = await client.derive(writer.session_id, await user_turn(writer, "more"))
        assert client.incremental == 0
        assert messages_canonical(derived.messages) == messages_canonical(writer.session.derive_messages())
        again = await client.derive(writer.session_id, await user_turn(writer, "and more"))
        assert client.incremental == 1, "the whole list it fetched is what it builds on next"
        assert messages_canonical(again.messages) == messages_canonical(writer.session.derive_messages())
    finally:
        await writer.close()


async def test_bad_known_fields_are_refused_with_a_typed_error(log: SessionLog) -> None:
    writer = await log.create(new_session_id("inc"))
    try:
        await user_turn(writer, "x")
        for bad in ({"known_count": -1}, {"known_generation": "0"}, {"known_count": 1.5}):
            with pytest.raises(InvalidRequest, match=next(iter(bad))):
                await derive(log, {"session": writer.session_id, "known_generation": 0, **bad})
    finally:
        await writer.close()
