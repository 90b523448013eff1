"""Session library speed (issue 2): per-append cost at 1k/10k/100k events, JSONL ingest rate, replace cost.

Prints one JSON document. Figures are ratios within one run; absolute times depend on the machine.
"""

from __future__ import annotations

import gc
import json
import sys
import time

from sessionlog.events import encode_new_event
from sessionlog.jsonl import encode_jsonl, parse_jsonl
from sessionlog.session import Session

from .common import QUICK, scale
from .synth import HEADER, synthetic_log


def per_append_cost(n: int, tail: int = 2000) -> dict[str, float]:
    """Cost of append + derive_messages() per event for the last `tail` events of an n-event log."""
    events = synthetic_log(n + tail)
    session = Session(events[:n])
    session.derive_messages()
    gc.collect()
    start = time.perf_counter()
    for raw in events[n : n + tail]:
        session.append(raw)
        session.derive_messages()
    elapsed = time.perf_counter() - start
    return {"events_before": n, "us_per_append_and_derive": elapsed / tail * 1e6}


def ingest_rate(n: int) -> dict[str, float]:
    """Read a JSONL file's bytes, decode, validate and append every event, on one core."""
    data = encode_jsonl(HEADER, synthetic_log(n))
    best = 0.0
    for _ in range(3):
        gc.collect()
        start = time.perf_counter()
        log = parse_jsonl(data)
        session = Session(log.events)
        elapsed = time.perf_counter() - start
        best = max(best, len(session) / elapsed)
    return {"events": len(session), "jsonl_bytes": len(data), "events_per_s": best}


def replace_cost(n: int, after: int = 2000) -> dict[str, float]:
    """Appends after a compaction cost what appends before it cost: one rebuild, not one per append."""
    events = synthetic_log(n + after)
    base = Session(events[:n])
    base.derive_messages()

    def appends(session: Session, tail: list[bytes]) -> float:
        start = time.perf_counter()
        for raw in tail:
            session.append(raw)
            session.derive_messages()
        return (time.perf_counter() - start) / after * 1e6

    plain = base.copy()
    before_us = appends(plain, events[n : n + after])
    compacted = base.copy()
    nodes = compacted.surface.nodes
    summary = {
        "id": "sum",
        "role": "user",
        "source": {"kind": "plugin", "plugin": "compact"},
        "content": [{"type": "text", "text": "summary"}],
    }
    raw = encode_new_event(
        "user/message",
        summary,
        seq=len(compacted),
        time=1,
        surface_op={"op": "replace", "start": nodes[0], "end": nodes[len(nodes) // 2 - 1]},
        source_event_seqs=sorted(nodes[: len(nodes) // 2]),
    )
    start = time.perf_counter()
    try:
        compacted.append(raw)
    except Exception:  # a half that splits a tool pair: shadow everything instead
        raw = encode_new_event(
            "user/message",
            summary,
            seq=len(compacted),
            time=1,
            surface_op={"op": "replace", "start": nodes[0], "end": nodes[-1]},
            source_event_seqs=sorted(nodes),
        )
        compacted.append(raw)
    compacted.derive_messages()
    rebuild_us = (time.perf_counter() - start) * 1e6
    shifted = [_renumber(raw, seq + 1) for seq, raw in enumerate(events[n : n + after], start=n)]
    after_us = appends(compacted, shifted)
    return {
        "events_before": n,
        "us_per_append_before_replace": before_us,
        "us_replace_and_rebuild": rebuild_us,
        "us_per_append_after_replace": after_us,
        "after_over_before": after_us / before_us,
    }


def _renumber(raw: bytes, seq: int) -> bytes:
    """Give a synthetic event the seq it has after the extra replace event."""
    obj = json.loads(raw)
    obj["seq"] = seq
    return json.dumps(obj, separators=(",", ":")).encode()


def main() -> dict[str, object]:
    costs = [per_append_cost(n) for n in ((1_000, 10_000, 100_000) if not QUICK else (1_000, 5_000))]
    result: dict[str, object] = {
        "benchmark": "session",
        "per_append": costs,
        "per_append_100k_over_1k": costs[-1]["us_per_append_and_derive"] / costs[0]["us_per_append_and_derive"],
        "ingest": ingest_rate(scale(100_000, 5_000)),
        "replace": replace_cost(scale(10_000, 2_000)),
    }
    return result


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
