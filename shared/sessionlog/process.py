"""Process-wide set-up of a long-running sessionlog service (`sessionlog serve`, `sessionlog up`, the gateway).

The garbage collector: a projection holds every resident session's events, tens of millions of objects, and creates
and drops a few objects per event it applies. With CPython's default thresholds (700, 10, 10) a young collection
runs every 700 allocations and older ones follow, so the collector's share grows with what the process holds: a
cold rebuild of the slowest projection ran at 0.45 of the raw read floor with them in every bench_projections run
of 2026-12-03, and at 0.64 with the thresholds below (issue 16). Nearly everything a service allocates dies by
reference counting (records, events, replies hold no cycles); the collector is only there for the rare cycle (a
task and its exception), which a larger first generation reclaims a little later.
"""

from __future__ import annotations

import gc
from typing import Final

# Young collections every 50,000 net allocations instead of 700; the older generations keep CPython's cadence (10
# and 10), so cyclic garbage does not pile up between full collections (and CPython still skips a full one until a
# quarter of the heap is new). A first try with (50,000, 20, 100) rebuilt no faster.
GC_THRESHOLDS: Final = (50_000, 10, 10)


def tune_gc() -> None:
    """Set the service thresholds, and move what exists now (modules, settings, the started services) out of the
    collector's sight: it lives as long as the process."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


__all__ = ["GC_THRESHOLDS", "tune_gc"]
