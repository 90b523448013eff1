"""The raw tee's request deltas, without a server: whatever sequence of request bodies the gateway tees (sharing
prefixes or not, split into parts, two sessions interleaved), a reader that takes the stream in order rebuilds every
request byte for byte; one that starts in the middle rebuilds them by reading the session's subject again from the
seq `wanted()` names; and a delta whose base is nowhere ends with empty request bytes, never with wrong ones."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given
from hypothesis import strategies as st

from services.gateway.tee import Bases, entry_parts, next_base, shared_prefix
from sessionlog.audit import RawAssembler, RawExchange
from sessionlog.record import H_RAW_BASE, H_RAW_REQUEST_ID, H_RAW_ROOT_SEQ, H_RAW_SESSION_SEQ

Message = tuple[int, str, dict[str, str], bytes]  # stream seq, subject, headers, data


def tee(
    exchanges: list[tuple[str, bytes, bytes]], *, part_size: int, min_shared: int = 8
) -> tuple[list[Message], dict[str, bytes]]:
    """What the tee publishes for `(session, request, response)` exchanges, in order, on an in-memory stream."""
    bases = Bases(min_shared=min_shared)
    stream: list[Message] = []
    requests: dict[str, bytes] = {}
    for n, (session, request, response) in enumerate(exchanges):
        request_id = f"req-{n}"
        requests[request_id] = request
        common = {H_RAW_REQUEST_ID: request_id, H_RAW_SESSION_SEQ: str(n)}
        delta = bases.delta(session, request)
        first = 0
        for part, headers in entry_parts("request", request, common, delta, part_size):
            stream.append((len(stream) + 1, session, headers, part))
            first = first or len(stream)
        bases.stored(session, next_base(request_id, request, delta, first))
        for part, headers in entry_parts("response", response, common, None, part_size):
            stream.append((len(stream) + 1, session, headers, part))
    return stream, requests


def read_in_order(stream: list[Message]) -> list[RawExchange]:
    assembler = RawAssembler()
    out: list[RawExchange] = []
    for _, _, headers, data in stream:
        out += assembler.take(headers, data)
    assert assembler.wanted() is None
    return out


def read_from(stream: list[Message], start: int, session: str) -> list[RawExchange]:
    """A reader of one session that starts at stream seq `start`, reading the subject again for missing bases."""
    assembler = RawAssembler()
    out: list[RawExchange] = []
    for seq, subject, headers, data in stream:
        if seq < start or subject != session:
            continue
        out += assembler.take(headers, data)
        root = assembler.wanted()
        if root is not None:
            for again_seq, again_subject, again_headers, again_data in stream:
                if root <= again_seq < seq and again_subject == session:
                    out += assembler.take_base(again_headers, again_data)
            out += assembler.give_up()
    return out


bodies = st.lists(
    st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 100), st.binary(max_size=60), st.binary(max_size=30)),
    min_size=1,
    max_size=12,
)


def grown(steps: list[tuple[str, int, bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """Each session's next request keeps a leading share of its previous one (`keep` percent) and adds bytes."""
    last: dict[str, bytes] = {}
    out = []
    for session, keep, added, response in steps:
        previous = last.get(session, b"")
        request = previous[: len(previous) * keep // 100] + added
        last[session] = request
        out.append((session, request, response))
    return out


@given(bodies, st.integers(1, 40))
def test_a_reader_in_stream_order_rebuilds_every_request_and_response(
    steps: list[tuple[str, int, bytes, bytes]], part_size: int
) -> None:
    exchanges = grown(steps)
    stream, requests = tee(exchanges, part_size=part_size)
    read = read_in_order(stream)
    assert [(e.request_id, e.request) for e in read] == list(requests.items())
    assert [e.response for e in read] == [response for _, _, response in exchanges]


@given(bodies, st.integers(1, 40), st.data())
def test_a_reader_starting_in_the_middle_rebuilds_what_it_reads_by_reading_the_subject_again(
    steps: list[tuple[str, int, bytes, bytes]], part_size: int, data: st.DataObject
) -> None:
    exchanges = grown(steps)
    stream, requests = tee(exchanges, part_size=part_size)
    start = data.draw(st.integers(1, len(stream)))
    for session in ("a", "b"):
        read = read_from(stream, start, session)
        # every exchange whose request entry begins at or after `start` comes back whole
        begun = {h[H_RAW_REQUEST_ID] for seq, subject, h, _ in stream
                 if seq >= start and subject == session and h.get("Sessionlog-Kind") == "request"
                 and h.get("Sessionlog-Part") == "0"}  # fmt: skip
        for exchange in read:
            if exchange.request_id in begun:
                assert exchange.request == requests[exchange.request_id]
            else:  # its request came before the reader started: as without deltas, no request bytes
                assert exchange.request == b""


def test_later_requests_of_a_growing_session_are_stored_as_deltas_and_chains_are_cut() -> None:
    context = b"x" * 2000
    exchanges = []
    for turn in range(150):
        context += b"message %d " % turn * 20
        exchanges.append(("a", context, b"answer"))
    compacted = context[:3000] + b"a summary of what came before"  # keeps little: a delta would outgrow the body
    exchanges.append(("a", compacted, b"answer"))
    stream, requests = tee(exchanges, part_size=1 << 20, min_shared=1024)
    request_entries = [(h, d) for _, _, h, d in stream if h.get("Sessionlog-Kind") == "request"]
    whole = [h[H_RAW_REQUEST_ID] for h, _ in request_entries if H_RAW_BASE not in h]
    assert whole == ["req-0", "req-65", "req-130", "req-150"]  # the first, after MAX_DEPTH deltas, the compaction
    stored = sum(len(d) for _, d in request_entries)
    assert stored < sum(len(r) for r in requests.values()) / 10
    roots = {int(h[H_RAW_ROOT_SEQ]) for h, _ in request_entries if H_RAW_BASE in h}
    assert all(stream[root - 1][2].get(H_RAW_BASE) is None for root in roots)  # a root is a whole entry
    assert [e.request for e in read_in_order(stream)] == list(requests.values())


def test_a_delta_whose_base_is_nowhere_reads_without_request_bytes_and_its_response_still_pairs() -> None:
    assembler = RawAssembler()
    delta = {H_RAW_BASE: "req-gone", "Sessionlog-Base-Prefix": "4", "Sessionlog-Size": "7", H_RAW_ROOT_SEQ: "3"}
    headers: Mapping[str, str] = {H_RAW_REQUEST_ID: "req-9", "Sessionlog-Kind": "request", **delta}
    assert assembler.take(headers, b"abc") == []
    assert assembler.wanted() == 3
    response = {H_RAW_REQUEST_ID: "req-9", "Sessionlog-Kind": "response", H_RAW_SESSION_SEQ: "5"}
    assert assembler.take(response, b"ok") == []
    assert assembler.give_up() == [RawExchange("req-9", 5, b"", b"ok")]
    assert assembler.wanted() is None


def test_a_delta_with_unreadable_headers_or_a_size_that_does_not_add_up_has_no_request_bytes() -> None:
    assembler = RawAssembler()
    assembler.take({H_RAW_REQUEST_ID: "req-1", "Sessionlog-Kind": "request"}, b"0123456789")
    bad = [
        {"Sessionlog-Base-Prefix": "four", "Sessionlog-Size": "7", H_RAW_ROOT_SEQ: "1"},
        {"Sessionlog-Base-Prefix": "4", "Sessionlog-Size": "99", H_RAW_ROOT_SEQ: "1"},
        {"Sessionlog-Base-Prefix": "40", "Sessionlog-Size": "43", H_RAW_ROOT_SEQ: "1"},  # more than the base holds
    ]
    for n, extra in enumerate(bad):
        request_id = f"req-bad-{n}"
        head = {H_RAW_REQUEST_ID: request_id, H_RAW_BASE: "req-1", **extra}
        assembler.take({**head, "Sessionlog-Kind": "request"}, b"abc")
        read = assembler.take({H_RAW_REQUEST_ID: request_id, "Sessionlog-Kind": "response"}, b"ok")
        read += assembler.give_up()
        assert [e.request for e in read] == [b""]


def test_shared_prefix_is_the_length_of_the_common_start() -> None:
    assert shared_prefix(b"", b"abc") == 0
    assert shared_prefix(b"abc", b"abd") == 2
    assert shared_prefix(b"abc", b"abc") == 3
    assert shared_prefix(b"abcdef", b"abc") == 3
    big = bytes(range(256)) * 4096
    assert shared_prefix(big, big[:700_001] + b"\xff") == 700_001
