"""The publish window (backpressure.py) against a real nats-server, with a plain responder standing where JetStream
answers records, so that each answer can be held, reordered or withheld.

What the window promises: every record gets its own answer through one reply subscription per connection; a record
whose later sibling was answered first is sent again; an answer is never lost, not even one that comes before its
publish call returned; an answer to a record already given up on never reaches another record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from natsfixtures import new_session_id

from sessionlog.backpressure import PublishWindow
from sessionlog.embedded import EmbeddedServer

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

ATTEMPT_S = 0.3
BUDGET_S = 2.0


@pytest_asyncio.fixture(loop_scope="module")
async def client(nats_server: EmbeddedServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


async def ask(window: PublishWindow, subject: str, payload: bytes, *, attempt_s: float = ATTEMPT_S) -> Msg:
    return await window.request(
        subject, payload, {}, attempt_s=attempt_s, started=time.monotonic(), budget_s=BUDGET_S, cap_s=BUDGET_S
    )


class Responder:
    """Answers each request with its payload, unless told to hold the answer to a payload until released."""

    def __init__(self, nc: Client, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.held: dict[bytes, str] = {}  # payload -> the reply subject its answer is owed to
        self.hold: set[bytes] = set()
        self.replies: list[str] = []

    async def start(self) -> Responder:
        await self.nc.subscribe(self.subject, cb=self._answer)
        await self.nc.flush()
        return self

    async def _answer(self, msg: Msg) -> None:
        self.replies.append(msg.reply)
        if msg.data in self.hold:
            self.held[msg.data] = msg.reply
            return
        await self.nc.publish(msg.reply, msg.data)

    async def release(self, payload: bytes) -> None:
        await self.nc.publish(self.held.pop(payload), payload)
        await self.nc.flush()


async def test_every_record_gets_its_own_answer_through_one_reply_subscription(client: Client) -> None:
    subject = f"bp.{new_session_id()}"
    responder = await Responder(client, subject).start()
    window = PublishWindow(client, max_in_flight=8)  # fewer slots than records: some wait for one
    payloads = [f"record {i}".encode() for i in range(200)]

    answers = await asyncio.gather(*(ask(window, subject, p) for p in payloads))

    assert [a.data for a in answers] == payloads
    prefixes = {reply.rsplit(".", 1)[0] for reply in responder.replies}
    assert len(prefixes) == 1, prefixes
    assert len(set(responder.replies)) == len(payloads)


async def test_a_subject_nobody_answers_raises_no_responders(client: Client) -> None:
    window = PublishWindow(client)
    with pytest.raises(nats.errors.NoRespondersError):
        await ask(window, f"bp.nobody.{new_session_id()}", b"x")


async def test_a_record_overtaken_by_a_later_answer_is_sent_again_and_its_late_answer_reaches_nobody(
    client: Client,
) -> None:
    subject = f"bp.{new_session_id()}"
    responder = await Responder(client, subject).start()
    responder.hold.add(b"first")
    window = PublishWindow(client)

    first = asyncio.create_task(ask(window, subject, b"first"))
    while not responder.held:
        await asyncio.sleep(0.01)
    assert (await ask(window, subject, b"second")).data == b"second"
    with pytest.raises(nats.errors.TimeoutError):  # a later record was answered first: this one was lost
        await first

    responder.hold.clear()
    await responder.release(b"first")  # the answer to the record given up on comes after all
    third = await ask(window, subject, b"third")
    assert third.data == b"third"


async def test_an_answer_that_comes_before_its_publish_returned_is_not_lost(client: Client) -> None:
    subject = f"bp.{new_session_id()}"
    await Responder(client, subject).start()

    class SlowPublish:
        """A connection whose publish returns only after the answer was surely delivered."""

        def __getattr__(self, name: str) -> Any:
            return getattr(client, name)

        async def publish(self, *args: Any, **kwargs: Any) -> None:
            await client.publish(*args, **kwargs)
            await client.flush()
            await asyncio.sleep(0.2)

    window = PublishWindow(SlowPublish())  # type: ignore[arg-type]
    answer = await ask(window, subject, b"early", attempt_s=0.1)  # an attempt shorter than the publish took
    assert answer.data == b"early"


async def test_with_no_answer_at_all_the_oldest_record_is_the_one_sent_again(client: Client) -> None:
    subject = f"bp.{new_session_id()}"
    responder = await Responder(client, subject).start()
    responder.hold.update({b"old", b"young"})
    window = PublishWindow(client)
    finished: list[bytes] = []

    async def record(payload: bytes, attempt_s: float) -> None:
        with pytest.raises(nats.errors.TimeoutError):
            await ask(window, subject, payload, attempt_s=attempt_s)
        finished.append(payload)

    old = asyncio.create_task(record(b"old", ATTEMPT_S))
    while b"old" not in responder.held:
        await asyncio.sleep(0.01)
    # The younger record's attempts are shorter: several of them pass in silence while the older one is in flight,
    # and it waits through them all (one probe per silent attempt, the oldest's). The order follows from that
    # alone, not from how soon this task runs.
    young = asyncio.create_task(record(b"young", ATTEMPT_S / 6))
    await asyncio.wait_for(asyncio.gather(old, young), timeout=2 * BUDGET_S)
    assert finished == [b"old", b"young"]


WRONG_LAST = b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 7"}}'
IN_PROCESS = b'{"error":{"code":409,"err_code":10158,"description":"duplicate message id is in process"}}'
NO_LEADER = b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}'


@pytest.mark.parametrize(
    ("earlier", "progress"),
    [
        (b"an earlier copy", True),
        (WRONG_LAST, True),  # what JetStream answers a copy of a record that landed meanwhile
        (NO_LEADER, False),  # a stream without a leader: no progress, the budget runs out
        (IN_PROCESS, False),  # what the one node left of a stream without quorum answers a copy
    ],
    ids=["answered", "refused as a copy", "unavailable", "duplicate in process"],
)
async def test_answers_to_records_already_sent_again_are_progress_that_keeps_the_budget_alive(
    client: Client, earlier: bytes, progress: bool
) -> None:
    """A busy link: a record's first attempt goes unanswered for longer than an attempt, so it is sent again (at the
    back of the queue), and the server then answers the queue in order, its earlier copies first. Those answers reach
    no record, but they show the server working: the budget counts from them, unless they say the server cannot
    store anything. (Counting only answers that reached a record failed 100 of 100 writers of a loaded machine at
    once, while the server was answering their earlier copies "wrong last sequence" for longer than the budget.)"""
    subject = f"bp.{new_session_id()}"
    owed: list[str] = []  # reply subjects, in the order the requests came
    answering = False  # at the end, as JetStream does: every copy answered in turn, the ones still to come too

    async def hold(msg: Msg) -> None:
        owed.append(msg.reply)
        if answering:
            await client.publish(msg.reply, b"a later copy")

    await client.subscribe(subject, cb=hold)
    await client.flush()
    window = PublishWindow(client)
    # Answers come every half budget: a pause of this task longer than that (a second here) spends the budget.
    budget_s, attempt_s, cap_s = 2.0, 2.0 / 6, 30.0

    async def record() -> Msg:  # what the store does: attempts while the budget lasts
        started = time.monotonic()
        while window.remaining(started, budget_s, cap_s) > 0:
            try:
                return await window.request(subject, b"r", {}, attempt_s=attempt_s, started=started,
                                            budget_s=budget_s, cap_s=cap_s)  # fmt: skip
            except nats.errors.TimeoutError:
                continue
        raise TimeoutError("no answer within the budget")

    task = asyncio.create_task(record())
    while len(owed) < 3:  # three copies in the queue: the first two were each a silent attempt
        await asyncio.sleep(0.01)
    for copy in range(6):  # the earlier copies answered, one every half budget: 2.5 budgets with none to the record
        if copy:
            await asyncio.sleep(budget_s / 2)
        if task.done():
            break
        await client.publish(owed[copy], earlier)
        await client.flush()
    if not progress:
        with pytest.raises(TimeoutError, match="within the budget"):  # not wait_for's own, which has no message
            await asyncio.wait_for(task, timeout=budget_s)
        assert copy < 5, "the budget ran out while answers that are not progress came"
        return
    assert not task.done(), task
    answering = True
    for reply in owed[6:]:
        await client.publish(reply, b"a later copy")
    answer = await asyncio.wait_for(task, timeout=budget_s)
    assert answer.data == b"a later copy"


async def test_a_teed_message_whose_answer_is_late_is_kept_while_the_connection_is_answered(
    client: Client, nats_server: EmbeddedServer
) -> None:
    """The raw tee publishes through the writers' window (`RecordStore.publish_raw`): a message whose answer is late
    while other messages of its connection are answered is sent again and kept, not given up once its own budget
    passed (each message used to have a budget of its own: a server busy but answering lost the audit)."""
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.tee import RawTee
    from sessionlog.reader import StreamReader
    from sessionlog.record import raw_subject
    from sessionlog.settings import Settings
    from sessionlog.store import RecordStore

    session_id = new_session_id("tee")
    subject = raw_subject(session_id)
    stored: list[bytes] = []

    class Acks(Responder):
        """Answers as JetStream does (a stream seq), holding the answers to held payloads."""

        async def _answer(self, msg: Msg) -> None:
            self.replies.append(msg.reply)
            if msg.data in self.hold:
                return
            stored.append(msg.data)
            await self.nc.publish(msg.reply, b'{"stream": "RAW", "seq": %d}' % len(stored))

    responder = await Acks(client, subject).start()
    responder.hold.add(b"answered late")
    store = RecordStore(client, Settings(_env_file=None, nats_url=nats_server.url), StreamReader(client, "RAW"))
    metrics = GatewayMetrics()
    budget_s = 0.6
    tee = RawTee(store, stream="RAW", max_payload=client.max_payload, metrics=metrics, attempt_s=0.15,
                 retry_s=budget_s)  # fmt: skip
    tee.submit(session_id, [("request", b"answered late", {"Sessionlog-Request-Id": "late"})])
    for n in range(int(3 * budget_s / 0.1)):  # three budgets of other messages, each answered at once
        other = await store.publish_raw(subject, b"other %d" % n, {}, budget_s=budget_s, attempt_s=0.15)
        assert stored[other - 1] == b"other %d" % n
        await asyncio.sleep(0.1)
    copies = sum(1 for reply in responder.replies if reply) - len(stored)
    assert copies >= 3, copies  # sent again while held: its first budget has long passed
    responder.hold.clear()
    await tee.drain(timeout_s=5.0)
    assert b"answered late" in stored
    assert metrics.raw_tee_failures._value.get() == 0
