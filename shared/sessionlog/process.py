"""Process-wide set-up of a long-running sessionlog service (`sessionlog serve`, `sessionlog up`, the gateway).

The garbage collector: a projection holds every resident session's events, tens of millions of objects, and creates
and drops a few objects per event it applies. With CPython's default thresholds (700, 10, 10) a young collection
runs every 700 allocations and older ones follow, so the collector's share grows with what the process holds: a
cold rebuild of the ui-replayer ran at 0.42-0.50 of the raw read floor with them and 0.58-0.70 with the thresholds
below (bench_projections, issue 16). Nearly everything a service allocates dies by reference counting (records,
events, replies hold no cycles); the collector is only there for the rare cycle (a task and its exception), which
a larger first generation reclaims a little later.
"""

from __future__ import annotations

import gc
from typing import Final

# Young collections every 50,000 net allocations, the middle generation every 20 of those, a full collection every
# 100 of the middle ones (and CPython still skips a full one until a quarter of the heap is new).
GC_THRESHOLDS: Final = (50_000, 20, 100)


def tune_gc() -> None:
    """Set the service thresholds, and move what exists now (modules, settings, the started services) out of the
    collector's sight: it lives as long as the process."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


__all__ = ["GC_THRESHOLDS", "tune_gc"]
