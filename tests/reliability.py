"""What the reliability suite (tests/test_reliability_*.py, issue 15) shares: its scale and its figures.

One environment variable sets the scale: `SESSIONLOG_RELIABILITY=full` (what `make reliability` sets) runs every
fault many times and the 1,000-session load; unset, each test runs a small bounded subset that fits in `make test`.
Random moments come from a seeded generator (`SESSIONLOG_RELIABILITY_SEED`, default 15), so a run can be repeated.

Each test appends one JSON line of figures (events written, faults injected, events lost, time to recover, ...) to
`SESSIONLOG_RELIABILITY_FIGURES` (default `test-output/reliability-figures.jsonl`);
`python tests/reliability_table.py` turns the lines into the table of docs/reliability.md.

PYTEST_DONT_REWRITE: no assertions here.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCALE_ENV = "SESSIONLOG_RELIABILITY"
FIGURES_ENV = "SESSIONLOG_RELIABILITY_FIGURES"
SEED_ENV = "SESSIONLOG_RELIABILITY_SEED"
FULL = os.environ.get(SCALE_ENV, "").lower() == "full"
MODE = "full" if FULL else "default"


def scale(default: int, full: int) -> int:
    """`full` under SESSIONLOG_RELIABILITY=full, else `default` (the bounded subset of `make test`)."""
    return full if FULL else default


def rng(salt: str) -> random.Random:
    """A generator of random moments for one test: seeded, so a failing run can be repeated exactly."""
    return random.Random(f"{os.environ.get(SEED_ENV, '15')}:{salt}")


def figures_path() -> Path:
    return Path(os.environ.get(FIGURES_ENV) or REPO / "test-output" / "reliability-figures.jsonl")


def record_figures(test: str, **figures: Any) -> None:
    """Append one line of figures for `test` (its fault, what was written, injected, lost, and recovery times)."""
    path = figures_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"test": test, "mode": MODE, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=False) + "\n")


def peak_rss_mib(pid: int) -> float | None:
    """The peak resident set of a live process (VmHWM), in MiB; None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of `values`; 0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


class Stopwatch:
    """Times from a fault to the moment things work again (time to recover)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def since(self, started: float) -> float:
        took = time.monotonic() - started
        self.samples.append(took)
        return took

    @property
    def worst(self) -> float:
        return round(max(self.samples), 3) if self.samples else 0.0
