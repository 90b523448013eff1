"""A NATS message's headers parsed as nats-py parses them, in about half the time.

nats-py (2.16) parses every delivered message's header block in Python, testing each character of each header name
for whitespace with a generator; a record carries eight headers, and on a projection's rebuild that parse was about
a third of the process's CPU (profiled 2026-12-04). `parse_header_lines` gives the same dict for every block (the
same splitting, stripping, decoding and skipping) with one regular-expression search per name instead.

`install(nc)` puts it on one connection (`sessionlog.connection.connect` does, for every connection it makes), after
checking that it answers as the connection's own parser does on blocks that exercise every rule; a nats-py that
parses differently keeps its own parser, with a warning.
"""

from __future__ import annotations

import logging
import re
from typing import Final

from nats.aio.client import Client

logger = logging.getLogger(__name__)

_CRLF: Final = b"\r\n"
_WHITESPACE: Final = re.compile(r"\s")  # str.isspace's characters (sre tests with the same Unicode predicate)

# Blocks on which both parsers must agree before this one is used: names with whitespace inside, around, or of other
# kinds, a name that is not ASCII, a line without a colon, values with colons, whitespace and bad UTF-8, a repeat.
SAMPLES: Final = (
    b"Sessionlog-Format: 1\r\nSessionlog-First-Seq: 12\r\nNats-Msg-Id: s:1:12\r\n\r\n",
    b"A:b\r\nB:\tc \r\n C : d\r\nD e: f\r\nE\x0bF: g\r\nG\x1cH: h\r\n\xc3\xa9: i\r\nno colon here\r\n\r\n",
    b"Url: http://x:1/y\r\nEmpty:\r\n: nameless\r\nBad: \xff\xfe\r\nUtf: \xc3\xa9t\xc3\xa9\r\nA: again\r\n",
    b"",
)


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """`Name: Value` per CRLF-separated line: the name stripped and ASCII, with no whitespace inside (else the line is
    skipped), the value stripped and decoded as UTF-8 with replacement; a line without a colon is skipped."""
    out: dict[str, str] = {}
    search = _WHITESPACE.search
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if search(key) is not None:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def install(nc: Client) -> bool:
    """Parse `nc`'s message headers with `parse_header_lines`, when it answers as the connection's own parser does on
    every sample; whether it was installed."""
    own = getattr(nc, "_parse_header_lines", None)
    if own is None:
        return False
    try:
        same = all(own(block) == parse_header_lines(block) for block in SAMPLES)
    except Exception:  # a parser with another signature: not the one this replaces
        same = False
    if not same:
        logger.warning("nats-py parses message headers differently from sessionlog's parser: keeping nats-py's")
        return False
    nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    return True


__all__ = ["SAMPLES", "install", "parse_header_lines"]
